"""A simulated engine instance's configuration (``pd-worker``'s flags, validated).

``WorkerConfig`` is what ``worker.sim.SimWorker`` opens and ``worker.serving`` serves requests
by: the role, the PD protocol, the pool's shape and its waiting line (``worker.page_queue``),
the simulated compute times, the prefix cache's hash seed, the KV event feed
(``worker.kv_events``) and the cache tiers (``worker.hicache.config.TierConfig``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from worker.hicache.config import TierConfig
from worker.kv import PoolShape
from worker.kv_events import KVEventsConfig
from worker.page_queue import DEFAULT_MAX_WAITING, DEFAULT_WAITING_TIMEOUT_S
from worker.protocol import PDProtocol

__all__ = ["Role", "WorkerConfig"]

Role = Literal["prefill", "decode", "both"]


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: Role
    model: str = "sim-model"
    shape: PoolShape = field(default_factory=PoolShape)
    protocol: PDProtocol = "sglang"  # how a prefill registers and reads its requests
    registry: str | None = None  # the registry whose bootstrap API a prefill publishes to
    namespace: str | None = None
    host: str = "127.0.0.1"  # control-plane bind address
    dp_size: int = 1  # prefill DP ranks in this process
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))  # vLLM engine id
    chunk_tokens: int = 2048  # chunked prefill: tokens per forward chunk
    max_prompt_tokens: int = 8192
    transfer_timeout_s: float = 30.0
    # the waiting line for KV pages (worker.page_queue), per rank: its length and how long a
    # request may wait in it (a PD request: at most transfer_timeout_s, its peer's patience)
    max_queued_requests: int = DEFAULT_MAX_WAITING
    waiting_timeout_s: float = DEFAULT_WAITING_TIMEOUT_S
    # decode: how long a failed or abandoned receive waits for the prefill to confirm that its
    # writes into the request's pages are over (beyond it the pages are withheld for good);
    # the prefill engine's writes end within their write timeout (Mooncake: 30 s + 1 s per GB)
    kv_drain_timeout_s: float = 40.0
    compute_s_per_token: float = 0.0  # simulated prefill forward time per prompt token
    decode_s_per_token: float = 0.0  # simulated time per generated token after the first
    tokenizer: str | None = None  # a Hugging Face tokenizer directory (None: bytes)
    hash_seed: str | None = None  # vLLM block hash root seed (None: random per process)
    # a fault to diagnose: every request hashes its blocks with a fresh seed, so the prefix cache
    # never hits, yet every block is stored and published (KV events flow, hits stay at 0)
    rehash_each_request: bool = False
    # whole answers carry usage.prompt_tokens_details (False: as vLLM without
    # --enable-prompt-tokens-details, SGLang without --enable-cache-report)
    report_cached_tokens: bool = True
    kv_events: KVEventsConfig | None = None  # --kv-events-config
    tiers: TierConfig = field(default_factory=TierConfig)  # --hicache-* (default: none)

    def __post_init__(self) -> None:
        if self.dp_size < 1 or (self.dp_size > 1 and self.role != "prefill"):
            raise ValueError(f"dp_size={self.dp_size}: only a prefill runs more than one rank")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.compute_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError("simulated compute times must be >= 0")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.waiting_timeout_s <= 0 or self.kv_drain_timeout_s <= 0:
            raise ValueError("waiting_timeout_s and kv_drain_timeout_s must be > 0")

    @property
    def page_wait_s(self) -> float:
        """How long a request may wait for KV pages: a PD request no longer than its peer
        waits for it (the transfer timeout)."""
        if self.role == "both":
            return self.waiting_timeout_s
        return min(self.waiting_timeout_s, self.transfer_timeout_s)
