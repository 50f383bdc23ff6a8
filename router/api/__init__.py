"""HTTP edge: read, admit, hand over, render; health, models, admin, status and explain views.

May import: context, pipeline, observability, kv_cache, scheduling, fleet, the top level.
"""
