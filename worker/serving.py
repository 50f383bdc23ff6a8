"""How a simulated engine serves one sequence, by role (``worker.sim.SimWorker.complete``).

``prefill`` computes the prompt's KV into its rank's pool and sends it with ``KVSender`` to the
decode named by the request's PD fields (``worker.protocol``), through the lifecycle of
``worker.prefill`` (SGLang answers once the transfer reached Success, 500 with the reason
otherwise; vLLM answers after the forward pass and serves the pull in the background); the rank
is SGLang's ``routed_dp_rank``, else ``room % dp_size``, vLLM's ``X-data-parallel-rank``.
``decode`` allocates pages, receives the KV with ``KVReceiver`` from the prefill's bootstrap API,
verifies it and generates tokens from it; ``both`` (or a vLLM decode without
``kv_transfer_params``) computes the KV locally (the co-located reference output), reusing its
cached prefix and serving what it can beyond L1 from the cache tiers. Pages are released on every
path (withheld only when the transfer library says writes may still land in them).

The prefill's cached token count travels to the decode in the aux slot, so the answer's
``usage.prompt_tokens_details.cached_tokens`` is the prefill's cache hit (as SGLang and vLLM's
NIXL decode report it; vLLM's Mooncake decode counts every received token), and (vLLM protocols)
``Completion.computed_tokens`` the prompt tokens computed in this process, as vLLM 0.32 reports
them (``created_cache_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import struct
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from transfer.errors import TransferError
from transfer.receiver import KVReceiver, ReceiveFailed, ReceiveResult
from worker.block_hash import BlockHasher
from worker.config import WorkerConfig
from worker.hicache.layer_loading import simulate_forward
from worker.kv import KVPool, PoolExhausted, detokenize, generate
from worker.metrics import WorkerMetrics
from worker.prefill import PrefillJob, PrefillScheduler
from worker.prefix_cache import Lease
from worker.protocol import Seq, WorkerError
from worker.rank import AUX_LEN, Progress, Rank
from worker.settling import settled

__all__ = ["Completion", "RequestServer"]


@dataclass(frozen=True, slots=True)
class Completion:
    """One sequence's outcome: its text, token counts and what its KV transfer moved and took."""

    text: str
    prompt_tokens: int
    completion_tokens: int
    kv_bytes: int
    transfer_s: float
    cached_tokens: int = 0  # prompt tokens served from the (prefill's) prefix cache
    # prompt tokens computed in this process (vLLM >= 0.32 reports them as
    # ``created_cache_tokens``); None: not reported (SGLang)
    computed_tokens: int | None = None


class RequestServer:
    """Serves sequences on a worker's ranks (module docstring); ``SimWorker`` owns one."""

    def __init__(
        self,
        config: WorkerConfig,
        ranks: Sequence[Rank],
        hasher: BlockHasher,
        metrics: WorkerMetrics,
    ) -> None:
        self.config = config
        self.ranks = ranks
        self.metrics = metrics
        self._hasher = hasher

    async def complete(self, seq: Seq, max_new: int) -> Completion:
        """Serve ``seq`` by the role (module docstring); ``WorkerError`` when it cannot."""
        limit = min(self.config.max_prompt_tokens, self.ranks[0].pool.max_tokens)
        if not seq.tokens:
            raise WorkerError(400, "empty prompt")
        if len(seq.tokens) > limit:
            raise WorkerError(400, f"prompt of {len(seq.tokens)} tokens is longer than {limit}")
        role, started = self.config.role, time.monotonic()
        if role == "both" or seq.local:
            index, result = 0, await self._local(self.ranks[0], seq, max_new)
        elif role == "prefill":
            index = self._prefill_rank(seq)
            result = await self._prefill(self.ranks[index], seq)
        else:
            index, result = 0, await self._decode(self.ranks[0], seq, max_new)
        self.metrics.observe_ttft(index, time.monotonic() - started)
        if self.config.protocol == "sglang":
            return result
        # what vLLM >= 0.32 reports as created_cache_tokens: a decode that received the KV
        # computed none of the prompt
        computed = (
            0 if role == "decode" and not seq.local else len(seq.tokens) - result.cached_tokens
        )
        return dataclasses.replace(result, computed_tokens=computed)

    def _prefill_rank(self, seq: Seq) -> int:
        dp_size, room = self.config.dp_size, seq.room
        if room is None:
            raise WorkerError(
                400,
                "a prefill request needs bootstrap_room "
                "(vLLM: kv_transfer_params with a transfer_id)",
            )
        dp = seq.dp_rank
        if dp is not None and not 0 <= dp < dp_size:
            raise WorkerError(400, f"DP rank {dp} outside [0, {dp_size})")
        if self.config.protocol == "sglang" and dp_size > 1:
            if dp is not None and dp != room % dp_size:
                raise WorkerError(
                    400,
                    f"follow_bootstrap_room conflict: routed_dp_rank {dp} "
                    f"but bootstrap_room % {dp_size} = {room % dp_size}",
                )
            dp = room % dp_size
        return dp or 0

    async def _acquire(self, rank: Rank, seq: Seq) -> Lease:
        """``seq``'s pages on ``rank`` (its cached prefix reused), once they fit: enter
        ``rank.leased`` with them at once."""
        return await rank.acquire(seq.tokens, self._hasher(seq.tokens, self.config.shape.page_size))

    @contextlib.asynccontextmanager
    async def _pages(self, rank: Rank, seq: Seq) -> AsyncIterator[_Held]:
        """Pages and an aux slot for ``seq`` to receive into, once they fit (SGLang's decode
        prealloc queue); released afterwards (withheld when not ``safe``)."""

        def attempt() -> _Held:
            if not rank.aux_free:
                raise PoolExhausted("no free aux slot")
            pages = rank.pool.allocate(len(seq.tokens))
            return _Held(pages, rank.aux_free.pop())

        rank.stats.prealloc += 1
        try:
            held = await rank.queue.take(attempt)
        finally:
            rank.stats.prealloc -= 1
        try:
            yield held
        finally:
            if held.safe:
                rank.aux_free.append(held.aux_index)
                rank.pool.release(held.pages)  # wakes the line (aux slot included)
            else:
                rank.pool.quarantine(held.pages)

    async def _local(self, rank: Rank, seq: Seq, max_new: int) -> Completion:
        cfg = self.config
        rank.stats.queued += 1
        try:
            leased = await self._acquire(rank, seq)
        finally:
            rank.stats.queued -= 1
        with rank.leased(leased) as lease:
            await lease.ready()
            start, load = await lease.begin()
            compute_s = cfg.compute_s_per_token * (len(seq.tokens) - start)
            await simulate_forward(compute_s, cfg.shape.layers, load, cfg.tiers.layerwise)
            rank.pool.write(lease.pages, seq.tokens, start)
            lease.computed(len(seq.tokens))
            done = self._decode_tokens(rank.pool, seq, lease.pages, max_new, 0, 0.0)
            return dataclasses.replace(done, cached_tokens=start)

    async def _prefill(self, rank: Rank, seq: Seq) -> Completion:
        assert rank.scheduler is not None and seq.room is not None
        if self.config.protocol == "vllm-mooncake":
            return await self._prefill_and_hand_off(rank, rank.scheduler, seq)
        served: list[Progress] = []

        @contextlib.asynccontextmanager
        async def admit() -> AsyncIterator[PrefillJob]:
            leased = await self._acquire(rank, seq)
            with rank.leased(leased) as lease:
                served.append(lease)
                yield self._job(seq, lease)

        try:
            transfer_s = await rank.scheduler.run(seq.room, admit)
        except TransferError as exc:
            raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        return Completion("", len(seq.tokens), 0, 0, transfer_s, served[0].cached_tokens)

    def _job(self, seq: Seq, lease: Progress) -> PrefillJob:
        room = seq.room
        assert room is not None

        def aux() -> bytes:  # when sent: the cached count includes what came from L2/L3
            return struct.pack("<QQQ", len(seq.tokens), room & ((1 << 64) - 1), lease.cached_tokens)

        tiers = lease if lease.rank.tiers is not None else None
        return PrefillJob(
            room, seq.tokens, lease.pages, aux, lease.cached_tokens, lease.computed, tiers
        )

    async def _prefill_and_hand_off(
        self, rank: Rank, scheduler: PrefillScheduler, seq: Seq
    ) -> Completion:
        with scheduler.queued():
            leased = await self._acquire(rank, seq)
        with contextlib.ExitStack() as stack:
            lease = stack.enter_context(rank.leased(leased))
            job = self._job(seq, lease)
            await scheduler.compute(job)
            scheduler.hand_off(job, stack.pop_all().close)
        return Completion("", len(seq.tokens), 0, 0, 0.0, lease.cached_tokens)

    async def _decode(self, rank: Rank, seq: Seq, max_new: int) -> Completion:
        if rank.receiver is None or seq.room is None or seq.bootstrap is None:
            raise WorkerError(
                400, "a decode request needs bootstrap_host/port/room (vLLM: kv_transfer_params)"
            )
        async with self._pages(rank, seq) as held:
            with rank.receiving():
                return await self._receive_and_decode(rank, rank.receiver, seq, held, max_new)

    async def _receive_and_decode(
        self, rank: Rank, receiver: KVReceiver, seq: Seq, held: _Held, max_new: int
    ) -> Completion:
        got = await self._receive(receiver, seq, held)
        length, _, cached = struct.unpack("<QQQ", got.aux[:AUX_LEN])
        if length != len(seq.tokens):
            raise WorkerError(500, "aux from the prefill names another prompt length")
        rank.stats.received_tokens += length
        done = self._decode_tokens(rank.pool, seq, held.pages, max_new, got.kv_bytes, got.elapsed_s)
        if self.config.protocol == "vllm-mooncake":
            # vLLM's Mooncake decode counts what it did not compute: every received token
            # (the router writes its kv_transfer_params: no remote_prefill_cached_tokens)
            cached = length
        return dataclasses.replace(done, cached_tokens=cached)

    async def _receive(self, receiver: KVReceiver, seq: Seq, held: _Held) -> ReceiveResult:
        """``seq``'s KV into ``held``'s pages and aux slot; ``held.safe`` follows the
        transfer's outcome (``WorkerError`` 500 when it failed).

        Cancelled (the client went away, a sibling sequence failed), it fails the room at once:
        the receiver aborts it at the prefill and learns whether the pages are safe (within its
        drain timeout) before ``CancelledError`` goes on, so the pages come back now rather than
        at the transfer deadline, and never while a write may still land in them.
        """
        room = seq.room
        assert room is not None and seq.bootstrap is not None
        request = asyncio.ensure_future(
            receiver.request(
                room,
                seq.bootstrap,
                held.pages,
                held.aux_index,
                self.config.transfer_timeout_s,
                dp_rank=seq.source_dp_rank,
                engine_id=seq.engine_id,
            )
        )
        try:
            return await settled(request, lambda: receiver.cancel(room, _CANCELLED))
        except (TransferError, ValueError) as exc:  # ReceiveFailed included
            raise WorkerError(500, f"KV transfer failed: {exc}") from exc
        finally:
            held.safe = _pages_safe(request)

    def _decode_tokens(
        self,
        pool: KVPool,
        seq: Seq,
        pages: list[int],
        max_new: int,
        kv_bytes: int,
        transfer_s: float,
    ) -> Completion:
        digest, bad = pool.read_digest(pages, seq.tokens)
        if bad >= 0:
            raise WorkerError(500, f"received KV does not match the prompt at position {bad}")
        tokens = generate(digest, max_new)
        return Completion(detokenize(tokens), len(seq.tokens), len(tokens), kv_bytes, transfer_s)


_CANCELLED = "the decode request was cancelled (its client went away)"


@dataclass(slots=True)
class _Held:
    """A decode request's pages and aux slot; not ``safe`` (a transfer may still write them):
    withheld."""

    pages: list[int]
    aux_index: int
    safe: bool = True


def _pages_safe(request: asyncio.Future[ReceiveResult]) -> bool:
    """Whether a receive's destination pages (and aux slot) may be reused now."""
    if not request.done() or request.cancelled():
        return False  # the receiver aborts a cancelled request in the background
    error = request.exception()
    return not isinstance(error, ReceiveFailed) or error.pages_safe
