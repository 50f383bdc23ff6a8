"""What the registry stores about a worker, and where (the key layout)."""

from __future__ import annotations

import hashlib
import re
from typing import Literal

import msgspec

__all__ = [
    "NAMESPACE_PATTERN",
    "NAMESPACE_RE",
    "WORKERS_PREFIX",
    "WorkerRecord",
    "decode_worker",
    "encode_worker",
    "worker_id",
    "worker_key",
]

WORKERS_PREFIX = "workers/"
# A bootstrap namespace (one prefill instance): also a path segment and a store key part.
NAMESPACE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
NAMESPACE_RE = re.compile(NAMESPACE_PATTERN)

Role = Literal["prefill", "decode"]


class WorkerRecord(msgspec.Struct, kw_only=True, frozen=True):
    """One engine instance as registered: the wire schema shared by routers and engines.

    ``epoch`` grows by one whenever the worker re-registers with a different bootstrap address or
    engine (a restart), so cached engine ids and addresses can be dropped at once.
    """

    id: str
    role: Role
    url: str
    bootstrap_port: int | None = None
    bootstrap_namespace: str | None = None  # the prefill registers its ranks with the registry
    engine: str | None = None
    draining: bool = False
    epoch: int = 1
    source: Literal["static", "admin", "engine"] = "admin"
    # the prefill's KV cache event stream (DP rank 0; rank r at port + r) and its replay
    # endpoint, ``tcp://host:port``; None: not advertised (older records decode as None)
    kv_events: str | None = None
    kv_events_replay: str | None = None


def worker_id(role: str, url: str) -> str:
    """A stable id: the same role and URL always name the same worker, on every router."""
    digest = hashlib.sha256(f"{role} {url.rstrip('/')}".encode()).hexdigest()
    return f"{role[0]}-{digest[:12]}"


def worker_key(worker_id: str) -> str:
    return WORKERS_PREFIX + worker_id


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(WorkerRecord)


def encode_worker(record: WorkerRecord) -> bytes:
    return _encoder.encode(record)


def decode_worker(raw: bytes) -> WorkerRecord:
    """Raises msgspec.ValidationError / DecodeError for a malformed record."""
    return _decoder.decode(raw)
