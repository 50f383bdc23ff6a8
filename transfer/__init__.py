"""Engine-side KV transfer library on the Mooncake transfer engine. Arrives with issue 4."""

from __future__ import annotations

__all__: list[str] = []
