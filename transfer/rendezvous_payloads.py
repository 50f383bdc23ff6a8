"""The rendezvous's payloads (``transfer.rendezvous``): what a prefill rank announces
(``PrefillRank``), what a decode reads back (``PrefillInfo``, ``RankAnswer``), and where
(``bootstrap_url``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import msgspec

from transfer.control import Peer

__all__ = ["PrefillInfo", "PrefillRank", "RankAnswer", "bootstrap_url"]


def bootstrap_url(registry: str, namespace: str | None = None) -> str:
    """The base URL of a namespace's bootstrap API on ``registry`` ("host:port" or a URL).

    ``namespace=None`` (or ``"default"`` on a plain port) uses the plain paths.
    """
    url = httpx.URL(registry)
    if url.scheme not in ("http", "https"):
        url = httpx.URL(f"http://{registry}")
    base = str(url).rstrip("/")
    return f"{base}/bootstrap/{namespace}" if namespace else base


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """One prefill rank's place in its instance's parallel layout (SGLang 0.5.x names)."""

    page_size: int
    kv_cache_dtype: str = "auto"
    attn_tp_size: int = 1
    attn_tp_rank: int = 0
    attn_dp_size: int = 1
    attn_dp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    system_dp_size: int = 1
    system_dp_rank: int = 0
    engine_id: str | None = None  # set: announce with vLLM's POST /register under this id

    def __post_init__(self) -> None:
        for rank, size in (
            ("attn_tp_rank", "attn_tp_size"),
            ("attn_dp_rank", "attn_dp_size"),
            ("pp_rank", "pp_size"),
            ("system_dp_rank", "system_dp_size"),
        ):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise ValueError(f"{rank}={getattr(self, rank)} outside [0, {size})")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    @property
    def dp_rank(self) -> int:
        """The DP rank decoders address (SGLang: system DP when > 1, else attention DP)."""
        return self.attn_dp_rank if self.system_dp_size == 1 else self.system_dp_rank

    @property
    def unique_rank(self) -> int:
        """SGLang's ``prefill_unique_rank`` (no context parallelism): the status sender's id."""
        return self.attn_tp_rank * self.pp_size + self.pp_rank

    def route_body(self, address: Peer) -> dict[str, Any]:
        """The 0.5.x ``PUT /route`` payload announcing this rank at ``address``."""
        return {
            "attn_tp_size": self.attn_tp_size,
            "attn_tp_rank": self.attn_tp_rank,
            "attn_dp_size": self.attn_dp_size,
            "attn_dp_rank": self.attn_dp_rank,
            "pp_size": self.pp_size,
            "pp_rank": self.pp_rank,
            "system_dp_size": self.system_dp_size,
            "system_dp_rank": self.system_dp_rank,
            "rank_ip": address.host,
            "rank_port": address.port,
            "page_size": self.page_size,
            "kv_cache_dtype": self.kv_cache_dtype,
        }

    def register_body(self, address: Peer) -> dict[str, Any]:
        """vLLM's ``POST /register`` payload announcing this rank at ``address``."""
        return {
            "engine_id": self.engine_id,
            "dp_rank": self.dp_rank,
            "tp_rank": self.attn_tp_rank,
            "pp_rank": self.pp_rank,
            "addr": f"tcp://{address.host}:{address.port}",
        }


class PrefillInfo(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    rename={"tp_size": "attn_tp_size", "cp_size": "attn_cp_size"},
):
    """A prefill instance's layout, as the 0.5.10+ parallel-info query answers it."""

    tp_size: int
    cp_size: int = 1
    dp_size: int
    pp_size: int
    page_size: int | None = None
    kv_cache_dtype: str | None = None
    follow_bootstrap_room: bool = True

    def mismatches(self, *, page_size: int, kv_cache_dtype: str | None, tp_size: int) -> list[str]:
        """Why a decode rank of this geometry cannot receive from this prefill (empty: it can).

        ``kv_cache_dtype`` None (on either side) matches any dtype.
        """
        problems = []
        if self.page_size is not None and self.page_size != page_size:
            problems.append(f"page_size {self.page_size} != {page_size}")
        dtypes = (self.kv_cache_dtype, kv_cache_dtype)
        if None not in dtypes and dtypes[0] != dtypes[1]:
            problems.append(f"kv_cache_dtype {dtypes[0]} != {dtypes[1]}")
        if self.tp_size != tp_size:
            problems.append(
                f"attn_tp_size {self.tp_size} != decode tp_size {tp_size} "
                "(TP resharding is not supported)"
            )
        if (self.pp_size, self.cp_size) != (1, 1):
            problems.append(f"pp_size={self.pp_size} cp_size={self.cp_size} (only 1 supported)")
        return problems


class RankAnswer(msgspec.Struct, frozen=True):
    """One rank's address, as the 0.5.10+ rank query answers it."""

    rank_ip: str
    rank_port: int
