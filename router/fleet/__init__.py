"""Keep the pool true: discovery, health probes, engine load, DP rank layouts, breakers.

May import: upstream, the registry package, the top level.
"""
