"""Bootstrap registry (embedded in the router; etcd-backed across nodes). Arrives with issue 3."""

from __future__ import annotations

__all__: list[str] = []
