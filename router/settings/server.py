"""The client-facing side: the HTTP server's bounds and admission control (overload)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from router.settings.flags import DOCUMENTED, TUNING, PositiveFloat, cli

__all__ = ["MAX_WORKERS", "AdmissionSettings", "ServerSettings"]

MAX_WORKERS = 64  # router processes on one host (--workers)


class ServerSettings(BaseModel):
    """The client-facing HTTP server: where it listens, the bounds of a request (400 beyond
    them; ``router.schemas.RequestLimits``), connection limits (``router.server.http_limits``)
    and the graceful shutdown."""

    model_config = DOCUMENTED

    host: str = Field(default="127.0.0.1", json_schema_extra=cli("--host"))
    """address to listen on"""
    port: int = Field(default=8000, ge=0, le=65535, json_schema_extra=cli("--port"))
    """port to listen on"""
    workers: str = Field(default="1", json_schema_extra=cli("--workers", metavar="N|auto"))
    """router processes serving the client port, 1 to 64 (`auto`: the cores this process may
    use, cgroup-aware); with more than one this process supervises them: it holds the shared
    registry store (with `--registry memory://`), restarts a process that dies, and on SIGTERM
    drains them all (docs/processes.md)"""
    worker_sockets: Literal["reuseport", "shared"] = Field(
        default="reuseport", json_schema_extra=cli("--worker-sockets")
    )
    """how the processes share the client port: `reuseport`, a listening socket each
    (SO_REUSEPORT: the kernel spreads new connections evenly), or `shared`, one socket bound by
    the supervisor and inherited (the processes race to accept)"""
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, gt=0, json_schema_extra=cli("--max-body-bytes")
    )
    """larger request bodies get 413 (completions, `/admin` and the engine bootstrap
    listeners)"""
    max_n: int = Field(default=128, ge=1, json_schema_extra=cli("--max-n"))
    """largest `n`: each sample is a full sequence, and with SGLang a request and a bootstrap
    room of its own; 128 is OpenAI's own cap on chat `n` and covers best-of sampling"""
    max_batch: int = Field(default=256, ge=1, json_schema_extra=cli("--max-batch"))
    """most prompts in one batched `/v1/completions` request"""
    max_sequences: int = Field(default=1024, ge=1, json_schema_extra=cli("--max-sequences"))
    """most sequences one request asks for, `n` x prompts"""
    max_request_id_bytes: int = Field(
        default=256, ge=1, le=4096, json_schema_extra=cli("--max-request-id-bytes")
    )
    """longest `X-Request-Id`; a longer one, or one with a byte outside printable ASCII
    (0x21-0x7E), gets 400 (the id goes into both legs' headers, which the engines echo within
    an 8190-byte limit, and into every log line)"""
    max_json_depth: int = Field(default=64, ge=1, le=512, json_schema_extra=TUNING)
    """deepest nesting of arrays and objects in a request body, the body being level 1 (chat
    content parts need ~6, nested tool schemas a few dozen)"""
    graceful_shutdown_s: PositiveFloat = Field(
        default=30.0, json_schema_extra=cli("--shutdown-grace")
    )
    """on SIGTERM, `/ready` answers 503 and new connections are refused; requests in flight
    get this many seconds to finish, then end with an error; exit status 0"""
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, le=16 * 1024 * 1024, json_schema_extra=cli("--max-header-bytes")
    )
    """most bytes of a request's head (request line + headers); beyond it 431 and the
    connection closes"""
    header_timeout_s: PositiveFloat = Field(default=10.0, json_schema_extra=cli("--header-timeout"))
    """seconds a request's headers may take from their first byte; then 408 and close (idle
    keep-alive connections between requests are uvicorn's: 75 s)"""
    body_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=cli("--body-timeout"))
    """seconds a request body may go without data (idle time, not a total); then 408"""
    max_connections: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra=cli("--max-connections", default="from the open file limit"),
    )
    """open client connections; at the cap a new one first closes the longest-idle keep-alive
    connection (between requests), and is answered 503 at once where none is idle (by default a
    third of the open file limit, raised to its hard limit at start, minus 256, within
    64..16384)"""
    max_connections_per_source: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra=cli("--max-connections-per-source", default="half --max-connections"),
    )
    """open client connections from one peer IP address; one more from it is answered 503 at
    once, others are unaffected (0: no per-source cap; behind a proxy or gateway every client
    shares its address: set it to `--max-connections` or 0 there)"""

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, value: object) -> str:
        text = str(value).strip().lower()
        if text == "auto" or (text.isdigit() and 1 <= int(text) <= MAX_WORKERS):
            return text
        raise ValueError(f"expected 1 to {MAX_WORKERS} or auto, got {value!r}")


class AdmissionSettings(BaseModel):
    """Overload: admission control before routing, per-worker in-flight caps, and the back-off
    from an engine that answered it is full (``router.pipeline.admission``, ``WorkerPool``)."""

    model_config = DOCUMENTED

    max_concurrent_requests: int = Field(
        default=1024, ge=0, json_schema_extra=cli("--max-concurrent-requests")
    )
    """sequences served at once, not requests: a completion request takes one unit per
    sequence it asks for (`n` x prompts, what the engines generate), at most all of them, so
    that one big request still runs alone; requests are admitted after their body was read and
    parsed, and those that do not fit wait in a queue ordered by priority, deadline and tenant
    fairness (0: no limit)"""
    max_queued_requests: int = Field(
        default=2048, ge=0, json_schema_extra=cli("--max-queued-requests")
    )
    """requests waiting for a slot; beyond it 429 with `Retry-After` at once, unless the
    arrival is more urgent than the least urgent waiter: that one is shed with 503 (0: no
    queue)"""
    queue_timeout_s: PositiveFloat = Field(default=30.0, json_schema_extra=cli("--queue-timeout"))
    """a request queued this long gets 429"""
    aging_s: float = Field(default=10.0, ge=0, json_schema_extra=cli("--priority-aging"))
    """seconds of waiting in the admission queue that make a priority class one level more
    urgent (by its oldest request's wait), so that nothing starves (0: no aging)"""
    default_priority: int = Field(default=0, json_schema_extra=cli("--default-priority"))
    """the priority of a request that names none (header, body `priority`, its tenant's):
    lower is more urgent, as vLLM's; the queue's order clamps it to -8..8"""
    priority_header: str = Field(
        default="x-priority", pattern=r"^[a-z0-9-]+$", json_schema_extra=TUNING
    )
    """the header giving a request's priority (an integer; lower is more urgent)"""
    deadline_header: str = Field(
        default="x-deadline-ms", pattern=r"^[a-z0-9-]+$", json_schema_extra=TUNING
    )
    """the header giving how many milliseconds a request may wait in the admission queue (at
    most `--queue-timeout`); past it the request gets 503 at once"""
    forward_priority: bool = Field(
        default=False, json_schema_extra=cli("--forward-priority", switch=True)
    )
    """the vLLM engines schedule by priority (`--scheduling-policy priority`): a priority from
    the header or the tenant's default goes into the body's `priority` (vLLM refuses a non-zero
    `priority` without that policy; a body's own `priority` is always passed on as is)"""
    retry_after_s: int = Field(default=1, ge=1, le=3600, json_schema_extra=TUNING)
    """the `Retry-After` (whole seconds) of the router's 429s"""
    max_body_memory_bytes: int = Field(
        default=2 * 1024 * 1024 * 1024, ge=0, json_schema_extra=cli("--max-body-memory")
    )
    """estimated memory of the completion request bodies in the router (being read, parsed,
    queued or served): a request holds 8x its body's length (the bytes, their parsed form and
    the legs' copies) from its first byte until it ends; one that would pass the budget gets 429
    with `Retry-After` at once, before its body is read when it has a Content-Length (a body
    larger than the whole budget is taken when no other is held; 0: no limit)"""
    max_inflight_per_worker: int = Field(
        default=0, ge=0, json_schema_extra=cli("--max-inflight-per-worker")
    )
    """legs one worker (all its DP ranks) may have in flight from this router; at the cap it
    is no candidate, and with every candidate at it the request gets 429 (0: no cap)"""
    max_inflight_per_prefill: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra=cli("--max-inflight-per-prefill", default="--max-inflight-per-worker"),
    )
    """the same for prefill workers only"""
    max_inflight_per_decode: int | None = Field(
        default=None,
        ge=0,
        json_schema_extra=cli("--max-inflight-per-decode", default="--max-inflight-per-worker"),
    )
    """the same for decode workers only"""
    queue_at_worker_caps: bool = Field(
        default=False, json_schema_extra=cli("--queue-at-worker-caps", switch=True)
    )
    """a request that finds every candidate worker of its model at its in-flight cap waits in
    the router's worker queue (ordered as the admission queue: most urgent first, fair between
    tenants; at most `--queue-timeout` or its deadline) until a leg ends, instead of 429: the
    engines then queue at most their cap, the router orders the rest (a second stage of
    admission, in front of the workers)"""
    worker_queue_reserve: int = Field(
        default=0, ge=0, json_schema_extra=cli("--worker-queue-reserve")
    )
    """with `--queue-at-worker-caps`: places of each model's workers held back from a tenant
    that has more than its weighted share of the requests in flight while another tenant has
    some (0: none, every free place goes to the next in the queue). A tenant within its share
    then finds a place at once instead of waiting for a prefill to finish behind a flood; the
    cost is up to this many idle places while it does not use them"""
    capacity_backoff_s: float = Field(
        default=1.0, ge=0, json_schema_extra=cli("--capacity-backoff")
    )
    """a worker that answered 429/503 (full) is avoided this long while another candidate
    exists; it stays healthy (0: never avoided)"""

    def worker_caps(self) -> tuple[int, int]:
        """The in-flight caps of a prefill and of a decode worker (0: none)."""
        default = self.max_inflight_per_worker
        prefill, decode = self.max_inflight_per_prefill, self.max_inflight_per_decode
        return (default if prefill is None else prefill, default if decode is None else decode)
