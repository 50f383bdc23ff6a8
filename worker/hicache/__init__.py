"""The tiered KV cache of a simulated rank, after SGLang's HiCache: L2 host pool, L3 page stores,
the controller.

May import: the worker's own modules below it (kv, prefix_cache, block_hash) and ``transfer``.
"""
