"""A simulated engine instance's configuration (``pd-worker``'s flags, validated).

``WorkerConfig`` is what ``worker.sim.SimWorker`` opens and ``worker.serving`` serves requests
by: the role, the PD protocol, the pool's shape, the simulated compute times, the prefix cache's
hash seed, the KV event feed (``worker.kv_events``) and the cache tiers
(``worker.hicache.config.TierConfig``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Literal

from worker.hicache.config import TierConfig
from worker.kv import PoolShape
from worker.kv_events import KVEventsConfig
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
    compute_s_per_token: float = 0.0  # simulated prefill forward time per prompt token
    decode_s_per_token: float = 0.0  # simulated time per generated token after the first
    tokenizer: str | None = None  # a Hugging Face tokenizer directory (None: bytes)
    hash_seed: str | None = None  # vLLM block hash root seed (None: random per process)
    kv_events: KVEventsConfig | None = None  # --kv-events-config
    tiers: TierConfig = field(default_factory=TierConfig)  # --hicache-* (default: none)

    def __post_init__(self) -> None:
        if self.dp_size < 1 or (self.dp_size > 1 and self.role != "prefill"):
            raise ValueError(f"dp_size={self.dp_size}: only a prefill runs more than one rank")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}")
        if self.compute_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError("simulated compute times must be >= 0")
