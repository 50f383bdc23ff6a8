"""L3 page stores: the seam (``base``), the page codec, the directory and Mooncake backends.

May import: ``worker.hicache.stores.base`` and ``codec`` (the backends); nothing above.
"""
