"""What the router knows of the engines' prefix caches: block index (keys, slots,
predictions, lower tiers, eviction), event feed, prefix tree.

May import: ``transfer.events`` (the engines' KV event wire format), the top level.
"""
