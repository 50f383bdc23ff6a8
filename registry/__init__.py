"""The worker registry: the PD cluster's workers and the engines' bootstrap APIs over one store.

Embedded in the router, or served on its own (``registry serve``); the store is in memory, etcd, or
another registry over HTTP.
"""

from __future__ import annotations

__all__: list[str] = []
