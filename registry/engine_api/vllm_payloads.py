"""vLLM MooncakeConnector's bootstrap API payloads (``POST /register``, ``GET /query``).

Field for field vLLM 0.32's own (``mooncake_utils.py``, docs/concepts/protocols.md 3.2), so schema
errors are
the same 422s and answers the same JSON.
"""

from __future__ import annotations

from typing import TypedDict

from pydantic import BaseModel

__all__ = ["EngineEntry", "RegisterWorkerPayload"]


class RegisterWorkerPayload(BaseModel):
    """vLLM's ``/register`` body, field for field (``mooncake_utils.py``), so 422s match."""

    engine_id: str
    dp_rank: int
    tp_rank: int
    pp_rank: int
    addr: str


class EngineEntry(TypedDict):
    """One dp rank in ``GET /query``: ``worker_addr`` is ``{tp_rank: {pp_rank: addr}}``."""

    engine_id: str
    worker_addr: dict[str, dict[str, str]]
