"""One completion request: admission, attempts, both legs, relay, retry before the first byte.

May import: adapters, scheduling, upstream, fleet, observability, the top level.
"""
