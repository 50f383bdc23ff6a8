"""Where a request goes: the request's features, the policies, the skip-the-prefill rules.

May import: kv_cache, fleet, upstream (types), observability (metrics), the top level.
"""
