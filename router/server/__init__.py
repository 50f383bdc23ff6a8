"""The process: flags, connection limits, GC schedule, drain, the extra listeners.

May import: scheduling (policy names), upstream, the registry package, the top level.
"""
