"""transfer/sender.py + receiver.py (+ control.py, rendezvous.py): KV moving for real, and failures.

A standalone registry (``create_registry_app``) on 127.0.0.1 is the rendezvous; a prefill
``KVSender`` and a decode ``KVReceiver`` move bytes between two pools through the loopback engine
(``transfer.engine.fake``: real memory copies, fault injection, delays). Deadlines are short and
every wait is bounded, so failures show up as ``TransferFailed`` / ``ReceiveFailed`` with a
reason well inside the test timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import socket
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import zmq
import zmq.asyncio

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from testkit.polling import await_until
from testkit.servers import run_server
from transfer.config import ReceiverConfig, SenderConfig
from transfer.control import ControlPlane, Peer, PeerUnreachable
from transfer.engine.fake import LoopbackEngine, LoopbackNetwork
from transfer.engine.mooncake import CODE_UNDRAINED, MooncakeEngine
from transfer.errors import TransferError, TransferFailed
from transfer.messages import TransferInfo, TransferStatus
from transfer.page_layout import KVPageLayout
from transfer.receiver import KVReceiver, ReceiveFailed, ReceiveResult
from transfer.rendezvous import PrefillRank, RendezvousClient, RendezvousError, bootstrap_url
from transfer.sender import KVSender
from transfer.state import KVPoll

PAGE_TOKENS = 4
LAYERS = 2
BYTES_PER_TOKEN = 8  # per layer: pages of 32 bytes, 4 regions (K and V of 2 layers)
NUM_PAGES = 32
AUX_LEN = 16
FAST = {"send_timeout_s": 0.3}
Ctx = zmq.asyncio.Context
STATUS = TransferStatus(room=1, status=KVPoll.Success, prefill_rank=0)
_rooms = itertools.count(1000)


class Pool:
    """A packed KV pool in a pinned bytearray."""

    def __init__(self, num_pages: int = NUM_PAGES, page_tokens: int = PAGE_TOKENS) -> None:
        probe = KVPageLayout.packed(
            0,
            num_layers=LAYERS,
            page_size_tokens=page_tokens,
            bytes_per_token_per_layer=BYTES_PER_TOKEN,
            num_pages=num_pages,
        )
        self.data = bytearray(probe.total_bytes)
        self._pin = (ctypes.c_char * len(self.data)).from_buffer(self.data)
        self.layout = KVPageLayout.packed(
            ctypes.addressof(self._pin),
            num_layers=LAYERS,
            page_size_tokens=page_tokens,
            bytes_per_token_per_layer=BYTES_PER_TOKEN,
            num_pages=num_pages,
        )

    def page(self, region: int, page: int) -> bytes:
        start = self.layout.base_ptrs[region] - self.layout.base_ptrs[0] + page * self.page_bytes
        return bytes(self.data[start : start + self.page_bytes])

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    def fill(self) -> None:
        """Every (region, page) holds its own bytes."""
        for region in range(self.layout.num_regions):
            for page in range(self.layout.num_pages):
                start = region * self.layout.region_bytes + page * self.page_bytes
                self.data[start : start + self.page_bytes] = bytes(
                    (region * 31 + page * 7 + i) % 251 + 1 for i in range(self.page_bytes)
                )


def assert_landed(prefill: Pool, decode: Pool, src: Sequence[int], dst: Sequence[int]) -> None:
    for region in range(prefill.layout.num_regions):
        for s, d in zip(src, dst, strict=True):
            assert decode.page(region, d) == prefill.page(region, s), (region, s, d)


def assert_empty(decode: Pool, pages: Sequence[int]) -> None:
    zero = bytes(decode.page_bytes)
    for region in range(decode.layout.num_regions):
        for page in pages:
            assert decode.page(region, page) == zero, (region, page)


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry() -> Iterator[str]:
    # the rendezvous tests below register addresses nothing listens on (the registry's
    # reachability check has tests of its own: tests/router/server/test_bootstrap_security.py)
    settings = RegistrySettings(bootstrap_check_reachable=False)
    with run_server(create_registry_app(settings)) as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()  # hangs (and times out) if a socket was left open


_namespaces = itertools.count()


@dataclass
class Pair:
    sender: KVSender
    receiver: KVReceiver
    prefill: Pool
    decode: Pool
    p_engine: LoopbackEngine  # (the engines passed in, when a test brings its own)
    d_engine: LoopbackEngine
    addr: str  # the bootstrap address decode requests use

    async def transfer(
        self,
        src: list[int],
        dst: list[int],
        tokens: int,
        *,
        aux: bytes = b"aux",
        aux_index: int = 0,
        timeout_s: float = 5.0,
        engine_id: str | None = None,
    ) -> ReceiveResult:
        room = next(_rooms)
        receiving = asyncio.create_task(
            self.receiver.request(room, self.addr, dst, aux_index, timeout_s, engine_id=engine_id)
        )
        await self.sender.send(room, src, tokens, is_last_chunk=True, aux=aux)
        return await receiving


@contextlib.asynccontextmanager
async def pair(
    context: Ctx,
    registry: str,
    *,
    namespace: str | None = None,
    sender: dict[str, Any] | None = None,
    receiver: dict[str, Any] | None = None,
    engines: tuple[Any, Any] | None = None,
    rank: PrefillRank | None = None,
) -> AsyncIterator[Pair]:
    ns = f"t{next(_namespaces)}" if namespace is None else namespace
    network = LoopbackNetwork()
    p_engine, d_engine = engines or (network.engine(), network.engine())
    prefill, decode = Pool(), Pool(**(receiver or {}).pop("pool", {}))
    prefill.fill()
    rank = rank or PrefillRank(page_size=PAGE_TOKENS)
    ns_arg = None if ns == "" else ns
    async with (
        KVSender(
            context,
            p_engine,
            prefill.layout,
            rank,
            SenderConfig(
                registry=registry,
                namespace=ns_arg,
                aux_item_len=AUX_LEN,
                aux_slots=8,
                **{**FAST, **(sender or {})},
            ),
        ) as kv_sender,
        KVReceiver(
            context,
            d_engine,
            decode.layout,
            ReceiverConfig(aux_item_len=AUX_LEN, aux_slots=64, **{**FAST, **(receiver or {})}),
        ) as kv_receiver,
    ):
        yield Pair(
            kv_sender,
            kv_receiver,
            prefill,
            decode,
            p_engine,
            d_engine,
            bootstrap_url(registry, ns_arg),
        )
        assert kv_sender.open_rooms == 0 and kv_receiver.open_rooms == 0
        assert kv_sender.unclaimed_infos == 0


# --- moving bytes ------------------------------------------------------------------------------


async def test_pages_and_aux_land_at_the_destination_pages(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        src, dst = [3, 4, 5, 9, 0], [20, 21, 22, 7, 30]
        result = await p.transfer(src, dst, tokens=18, aux=b"first-token=42")
        assert_landed(p.prefill, p.decode, src, dst)
        assert_empty(p.decode, [page for page in range(NUM_PAGES) if page not in dst])
        assert result.aux == b"first-token=42".ljust(AUX_LEN, b"\0")
        assert result.kv_bytes == len(dst) * p.decode.page_bytes * 4
        # pages contiguous on both sides share an entry: (3,4,5)->(20,21,22), 9->7, 0->30,
        # per region (4); the aux slot rides in the same engine call
        assert p.p_engine.stats.batch_sizes == [3 * 4 + 1]
        assert p.sender.stats.rooms_succeeded == p.receiver.stats.rooms_succeeded == 1


async def test_contiguous_pages_make_one_entry_per_region(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        await p.transfer(list(range(8)), list(range(8, 16)), tokens=32)
        assert_landed(p.prefill, p.decode, list(range(8)), list(range(8, 16)))
        assert p.p_engine.stats.batch_sizes == [4 + 1]  # KV and aux in one call


async def test_plain_route_of_the_default_namespace(context: Ctx, registry: str) -> None:
    async with pair(context, registry, namespace="") as p:
        assert p.addr == registry
        await p.transfer([1], [2], tokens=1)
        assert_landed(p.prefill, p.decode, [1], [2])


async def test_pages_move_over_the_mooncake_engine(context: Ctx, registry: str) -> None:
    pytest.importorskip("mooncake.engine")
    async with (
        await MooncakeEngine.start() as p_engine,
        await MooncakeEngine.start() as d_engine,
        pair(context, registry, engines=(p_engine, d_engine)) as p,
    ):
        for i in range(20):
            src, dst = [i, i + 1, i + 5], [3 * i % 32, (3 * i + 1) % 32, (3 * i + 17) % 32]
            result = await p.transfer(src, dst, tokens=10, aux=b"m%d" % i, aux_index=i % 8)
            assert_landed(p.prefill, p.decode, src, dst)
            assert result.aux.rstrip(b"\0") == b"m%d" % i


async def test_chunked_prefill_holds_the_partial_page_until_the_next_chunk(
    context: Ctx, registry: str
) -> None:
    async with pair(context, registry) as p:
        room, src, dst = next(_rooms), [10, 11, 12, 13], [1, 5, 6, 9]
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, dst, 3, 5.0))
        assert await p.sender.bootstrap(room) is KVPoll.WaitingForInput
        # chunk 1: 6 tokens = page 0 full, page 1 partial (held)
        assert await p.sender.send(room, src[:2], 6, is_last_chunk=False) is KVPoll.Transferring
        assert_landed(p.prefill, p.decode, src[:1], dst[:1])
        assert_empty(p.decode, dst[1:])
        # chunk 2: 13 tokens = pages 1 and 2 full, page 3 partial (held)
        assert await p.sender.send(room, src, 13, is_last_chunk=False) is KVPoll.Transferring
        assert_landed(p.prefill, p.decode, src[:3], dst[:3])
        assert_empty(p.decode, dst[3:])
        assert not receiving.done()
        # last chunk: page 3 (partial) and the aux slot
        assert await p.sender.send(room, src, 14, is_last_chunk=True, aux=b"x") is KVPoll.Success
        result = await receiving
        assert_landed(p.prefill, p.decode, src, dst)
        assert result.aux == b"x".ljust(AUX_LEN, b"\0")


async def test_decode_registers_once_per_session(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        for i in range(3):
            await p.transfer([i], [i], tokens=4)
        assert p.receiver.stats.registrations_sent == 1
        assert p.sender.stats.registrations == 1


async def test_dummy_request_receives_nothing_but_the_status(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [], None, 5.0))
        assert await p.sender.send(room, [0, 1], 8, is_last_chunk=True, aux=b"a") is KVPoll.Success
        assert (await receiving).kv_bytes == 0
        assert p.p_engine.stats.writes == 0


async def test_no_leaked_rooms_after_200_requests(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        outcomes: list[str] = []

        async def one(i: int) -> None:
            room, page = next(_rooms), i % 8
            receiving = asyncio.create_task(
                p.receiver.request(room, p.addr, [page * 4, page * 4 + 1], page, 5.0)
            )
            try:
                if i % 10 == 9:  # the prefill gives up on some rooms
                    await p.sender.bootstrap(room)
                    p.sender.abort(room, "client went away")
                else:
                    await p.sender.send(
                        room, [i % 30, i % 30 + 1], 7, is_last_chunk=True, aux=b"%d" % i
                    )
                result = await receiving
                assert result.aux.rstrip(b"\0") == b"%d" % i
                outcomes.append("ok")
            except ReceiveFailed as exc:
                assert exc.pages_safe and "client went away" in exc.reason
                outcomes.append("failed")

        for wave in range(25):
            await asyncio.gather(*(one(wave * 8 + i) for i in range(8)))
        assert outcomes.count("ok") == 180 and outcomes.count("failed") == 20
        assert p.sender.open_rooms == p.receiver.open_rooms == 0
        assert p.sender.stats.rooms_succeeded == 180 and p.sender.stats.rooms_failed == 20


# --- failures end Failed with a reason, in bounded time ----------------------------------------


async def test_engine_write_failure_fails_both_sides(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        p.p_engine.fail_writes(1)
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1, 2], 0, 5.0))
        with pytest.raises(TransferFailed, match="injected failure"):
            await p.sender.send(room, [1, 2], 8, is_last_chunk=True)
        with pytest.raises(ReceiveFailed, match="injected failure") as failed:
            await receiving
        assert failed.value.pages_safe  # the prefill reported after its write returned
        # the next request works again (the session survived)
        await p.transfer([3], [3], tokens=4)
        assert_landed(p.prefill, p.decode, [3], [3])


async def test_undrained_engine_failure_keeps_the_pages_out_of_use(
    context: Ctx, registry: str
) -> None:
    async with pair(context, registry, receiver={"drain_timeout_s": 0.1}) as p:
        p.p_engine.fail_writes(1, code=CODE_UNDRAINED)  # "entries may still be in flight"
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1, 2], 0, 0.3))
        with pytest.raises(TransferFailed, match="injected failure"):
            await p.sender.send(room, [1, 2], 8, is_last_chunk=True)
        started = time.monotonic()
        with pytest.raises(ReceiveFailed, match="timed out in Transferring") as failed:
            await receiving  # no status came: the deadline, then an unanswered Abort
        assert not failed.value.pages_safe
        assert time.monotonic() - started < 1.0


async def test_decode_never_sends_transfer_info(context: Ctx, registry: str) -> None:
    async with pair(context, registry, sender={"bootstrap_timeout_s": 0.2}) as p:
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="timed out in Bootstrapping"):
            await p.sender.bootstrap(next(_rooms), timeout_s=0.1)
        room = next(_rooms)  # the same through send(), with the sender's default deadline
        with pytest.raises(TransferFailed, match="timed out in Bootstrapping"):
            await p.sender.send(room, [0], 4, is_last_chunk=True)
        assert time.monotonic() - started < 1.0


async def test_idle_room_times_out_and_the_decode_is_told(context: Ctx, registry: str) -> None:
    async with pair(context, registry, sender={"transfer_timeout_s": 0.2}) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1], 0, 5.0))
        await p.sender.bootstrap(room)  # then the forward pass never comes
        started = time.monotonic()
        with pytest.raises(ReceiveFailed, match="timed out in WaitingForInput") as failed:
            await receiving
        assert time.monotonic() - started < 1.0 and failed.value.pages_safe
        with pytest.raises(TransferFailed, match="timed out"):
            await p.sender.send(room, [1], 4, is_last_chunk=True)


async def test_decode_timeout_aborts_and_the_prefill_acknowledges(
    context: Ctx, registry: str
) -> None:
    async with pair(context, registry) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1], 0, 0.3))
        await p.sender.bootstrap(room)
        with pytest.raises(ReceiveFailed, match="timed out in Transferring") as failed:
            await receiving
        assert failed.value.pages_safe  # Abort answered: the prefill will not write
        with pytest.raises(TransferFailed, match="aborted by the decode"):
            await p.sender.send(room, [1], 4, is_last_chunk=True)
        assert p.p_engine.stats.writes == 0


async def test_late_write_is_reported_only_after_it_drained(context: Ctx, registry: str) -> None:
    async with pair(context, registry, sender={"transfer_timeout_s": 0.15}) as p:
        p.p_engine.delay_s = 0.5
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [4], 0, 5.0))
        started = time.monotonic()
        # the write's own deadline or the ledger's sweep of overdue rooms, whichever runs first
        # at the room's deadline, names the failure; either way the report waits for the write
        late = "still running at the deadline|timed out in Transferring"
        with pytest.raises(TransferFailed, match=late):
            await p.sender.send(room, [4], 4, is_last_chunk=True)
        assert time.monotonic() - started < 0.4
        with pytest.raises(ReceiveFailed, match=late) as failed:
            await receiving
        # the Failed status came after the write landed: the pages are quiet now
        assert time.monotonic() - started >= 0.5 and failed.value.pages_safe
        assert_landed(p.prefill, p.decode, [4], [4])


async def test_prefill_shutting_down_fails_its_rooms(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1], 0, 5.0))
        await p.sender.bootstrap(room)
        await p.sender.aclose()
        with pytest.raises(ReceiveFailed, match="shutting down") as failed:
            await receiving
        assert failed.value.pages_safe


async def test_dead_prefill_rank_is_unreachable(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        await p.sender.aclose()  # still listed in the registry, but nobody listens
        started = time.monotonic()
        with pytest.raises(ReceiveFailed, match="unreachable") as failed:
            await p.receiver.request(next(_rooms), p.addr, [1], 0, 5.0)
        assert time.monotonic() - started < 1.0 and failed.value.pages_safe


_KILLED_PREFILL = """
import asyncio, sys
import zmq.asyncio
from transfer.config import SenderConfig
from transfer.page_layout import KVPageLayout
from transfer.rendezvous import PrefillRank
from transfer.sender import KVSender

class Engine:
    session_id = "killed:0"
    def register(self, ptr, length): pass
    def unregister(self, ptr): pass
    async def write(self, session, entries): raise AssertionError("no writes expected")
    async def close(self): pass

async def main():
    layout = KVPageLayout.packed(1 << 20, num_layers=2, page_size_tokens=4,
                             bytes_per_token_per_layer=8, num_pages=32)
    config = SenderConfig(registry=sys.argv[1], namespace=sys.argv[2])
    async with KVSender(zmq.asyncio.Context(), Engine(), layout, PrefillRank(page_size=4),
                        config) as sender:
        print("ready", flush=True)
        await sender.bootstrap(int(sys.argv[3]))
        print("bootstrapped", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_prefill_killed_mid_transfer_is_seen_at_once(context: Ctx, registry: str) -> None:
    namespace, room = f"killed{next(_namespaces)}", next(_rooms)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _KILLED_PREFILL,
        registry,
        namespace,
        str(room),
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(10):
            assert await proc.stdout.readline() == b"ready\n"
        decode = Pool()
        engine = LoopbackNetwork().engine()
        async with KVReceiver(
            context,
            engine,
            decode.layout,
            ReceiverConfig(aux_item_len=AUX_LEN, aux_slots=4, send_timeout_s=0.3),
        ) as receiver:
            receiving = asyncio.create_task(
                receiver.request(room, bootstrap_url(registry, namespace), [1, 2], 0, 10.0)
            )
            async with asyncio.timeout(5):
                assert await proc.stdout.readline() == b"bootstrapped\n"
            proc.kill()
            started = time.monotonic()
            with pytest.raises(ReceiveFailed, match="lost connection to prefill") as failed:
                await receiving
            assert time.monotonic() - started < 1.0 and failed.value.pages_safe
            assert receiver.open_rooms == 0
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


_KILLED_DECODE = """
import asyncio, sys
import zmq.asyncio
from transfer.config import ReceiverConfig
from transfer.page_layout import KVPageLayout
from transfer.receiver import KVReceiver

class Engine:
    session_id = "doomed:0"
    def register(self, ptr, length): pass
    def unregister(self, ptr): pass
    async def close(self): pass

async def main():
    layout = KVPageLayout.packed(1 << 20, num_layers=2, page_size_tokens=4,
                             bytes_per_token_per_layer=8, num_pages=32)
    async with KVReceiver(zmq.asyncio.Context(), Engine(), layout,
                          ReceiverConfig(aux_item_len=16, aux_slots=4)) as receiver:
        await receiver.request(int(sys.argv[2]), sys.argv[1], [1, 2], 0, 60.0)

asyncio.run(main())
"""


async def test_decode_killed_before_the_prefill_claims_its_info(
    context: Ctx, registry: str
) -> None:
    """Transfer info arrived before the prefill's request; its decode dies: the request, when it
    comes, fails at once instead of waiting out the bootstrap timeout."""
    async with pair(context, registry, sender={"bootstrap_timeout_s": 30.0}) as p:
        room = next(_rooms)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _KILLED_DECODE, p.addr, str(room)
        )
        try:
            await await_until(lambda: p.sender.unclaimed_infos == 1, 10.0, "the decode's info")
        finally:
            proc.kill()
            await proc.wait()
        await await_until(lambda: p.sender.unclaimed_infos == 0, 5.0, "the loss to be noticed")
        started = time.monotonic()
        with pytest.raises(TransferFailed, match="lost connection to decode"):
            await p.sender.bootstrap(room)
        assert time.monotonic() - started < 0.5 and p.sender.open_rooms == 0


async def test_registry_unreachable(context: Ctx, registry: str) -> None:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]  # bound, not listening: connections are refused
        async with pair(context, registry) as p:
            started = time.monotonic()
            with pytest.raises(ReceiveFailed, match="bootstrap lookup.*ConnectError") as failed:
                await p.receiver.request(next(_rooms), f"127.0.0.1:{closed_port}", [1], 0, 0.3)
            assert time.monotonic() - started < 1.0 and failed.value.pages_safe


async def test_registry_without_the_prefill(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        with pytest.raises(ReceiveFailed, match="not fully registered"):
            await p.receiver.request(next(_rooms), bootstrap_url(registry, "nobody"), [1], 0, 0.3)


async def test_page_size_mismatch_fails_at_once(context: Ctx, registry: str) -> None:
    async with pair(context, registry, receiver={"pool": {"page_tokens": 8}}) as p:
        started = time.monotonic()
        with pytest.raises(ReceiveFailed, match="page_size 4 != 8"):
            await p.receiver.request(next(_rooms), p.addr, [1], 0, 5.0)
        assert time.monotonic() - started < 1.0


async def test_unregistered_session_gets_failed_status(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p, ControlPlane(context) as stranger:
        info = TransferInfo(
            room=next(_rooms),
            ip="127.0.0.1",
            port=stranger.address.port,
            session_id="mini:nobody",
            dst_kv_indices=(1,),
            dst_aux_index=0,
            required_dst_info_num=1,
        )
        await stranger.send(p.sender.address, info)
        async with asyncio.timeout(2):
            status = await stranger.recv()
        assert isinstance(status, TransferStatus) and status.status is KVPoll.Failed
        assert status.reason is not None and "not registered" in status.reason


async def test_foreign_frames_are_dropped_and_the_rank_keeps_working(
    context: Ctx, registry: str
) -> None:
    async with pair(context, registry) as p:
        push = context.socket(zmq.PUSH)
        try:
            push.connect(p.sender.address.endpoint)
            await push.send_multipart([b"None", b"10.0.0.1", b"1234"])  # SGLang's registration
            await push.send_multipart([b"PDKV/99/ABORT", b"1"])  # another protocol version
            await p.transfer([2], [3], tokens=4)
            assert_landed(p.prefill, p.decode, [2], [3])
        finally:
            push.close(linger=0)


async def test_receiver_cancel_fails_the_request(context: Ctx, registry: str) -> None:
    async with pair(context, registry) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [1], 0, 5.0))
        await p.sender.bootstrap(room)
        assert p.receiver.cancel(room, "client disconnected")
        with pytest.raises(ReceiveFailed, match="client disconnected") as failed:
            await receiving
        assert failed.value.pages_safe


@contextlib.contextmanager
def statuses_held(monkeypatch: pytest.MonkeyPatch, hold_s: float) -> Iterator[asyncio.Event]:
    """Every ``TransferStatus`` waits ``hold_s`` before it is sent; the event is set when the
    first one starts to (the prefill's call is then reporting)."""
    reporting = asyncio.Event()
    send = ControlPlane.send

    async def held(self: ControlPlane, peer: Peer, msg: Any, **kw: Any) -> None:
        if isinstance(msg, TransferStatus):
            reporting.set()
            await asyncio.sleep(hold_s)
        await send(self, peer, msg, **kw)

    with monkeypatch.context() as patch:
        patch.setattr(ControlPlane, "send", held)
        yield reporting


@pytest.mark.parametrize("then_close", [False, True])
async def test_final_status_survives_a_caller_cancelled_while_reporting(
    context: Ctx, registry: str, monkeypatch: pytest.MonkeyPatch, then_close: bool
) -> None:
    # the prefill's request is cancelled (its client left) just as the call pushes Success:
    # the decode still hears, at once, rather than withholding its pages until its deadline;
    # closing the sender right after waits for that report
    async with pair(context, registry) as p:
        room = next(_rooms)
        receiving = asyncio.create_task(p.receiver.request(room, p.addr, [4], 0, 5.0))
        with statuses_held(monkeypatch, 0.1) as reporting:
            sending = asyncio.create_task(p.sender.send(room, [4], 4, is_last_chunk=True))
            await asyncio.wait_for(reporting.wait(), 2.0)
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            if then_close:
                await p.sender.aclose()
            result = await asyncio.wait_for(receiving, 2.0)
        assert result.kv_bytes == p.decode.page_bytes * 4
        assert_landed(p.prefill, p.decode, [4], [4])


# --- control plane and rendezvous client on their own -----------------------------------------


async def test_send_to_a_dead_peer_times_out(context: Ctx) -> None:
    async with ControlPlane(context, send_timeout_s=0.1) as control:
        started = time.monotonic()
        with pytest.raises(PeerUnreachable, match="unreachable"):
            await control.send(Peer("127.0.0.1", 1), STATUS)
        assert time.monotonic() - started < 0.5


async def test_wildcard_bind_needs_an_advertised_host(context: Ctx) -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        ControlPlane(context, host="0.0.0.0")


async def test_rendezvous_registration_refused_is_an_error(registry: str) -> None:
    async with RendezvousClient() as client:
        rank = PrefillRank(page_size=4, attn_tp_size=2, attn_tp_rank=1)
        base = bootstrap_url(registry, "refused")
        await client.register(base, rank, Peer("127.0.0.1", 5000))
        other = PrefillRank(page_size=8, attn_tp_size=2, attn_tp_rank=0)  # contradicts, partial
        with pytest.raises(RendezvousError, match="refused") as refused:
            await client.register(base, other, Peer("127.0.0.1", 5001))
        assert isinstance(refused.value, TransferError) and refused.value.code == 400


async def test_vllm_engine_is_found_by_engine_id(context: Ctx, registry: str) -> None:
    rank = PrefillRank(
        page_size=PAGE_TOKENS, system_dp_size=2, system_dp_rank=1, engine_id="sim-engine_dp1"
    )
    async with pair(context, registry, rank=rank) as p:
        async with httpx.AsyncClient() as http:
            table = (await http.get(f"{p.addr}/query")).json()
        address = p.sender.address
        assert table["1"] == {
            "engine_id": "sim-engine_dp1",
            "worker_addr": {"0": {"0": f"tcp://{address.host}:{address.port}"}},
        }
        result = await p.transfer([2, 3], [9, 10], tokens=7, engine_id="sim-engine_dp1")
        assert_landed(p.prefill, p.decode, [2, 3], [9, 10])
        assert result.kv_bytes == 2 * p.decode.page_bytes * 4
        started = time.monotonic()
        with pytest.raises(ReceiveFailed, match="not found from bootstrap server"):
            await p.receiver.request(next(_rooms), p.addr, [1], 0, 5.0, engine_id="other_dp0")
        assert time.monotonic() - started < 1.0  # an unknown engine fails at once


async def test_rendezvous_lookup_of_vllm_engines(registry: str) -> None:
    async with RendezvousClient() as client:
        base = bootstrap_url(registry, "vllm-lookup")
        for dp in range(2):
            rank = PrefillRank(
                page_size=16, system_dp_size=2, system_dp_rank=dp, engine_id=f"e_dp{dp}"
            )
            await client.register(base, rank, Peer("127.0.0.1", 7100 + dp))
            await client.register(base, rank, Peer("127.0.0.1", 7100 + dp))  # idempotent
        assert await client.engine_address(base, "e_dp1", tp=0, timeout_s=1) == Peer(
            "127.0.0.1", 7101
        )
        with pytest.raises(RendezvousError, match="lists no rank tp=1"):
            await client.engine_address(base, "e_dp0", tp=1, timeout_s=1)
        moved = PrefillRank(page_size=16, system_dp_size=2, system_dp_rank=0, engine_id="e_dp0")
        with pytest.raises(RendezvousError, match="needs the admin token") as refused:
            await client.register(base, moved, Peer("127.0.0.1", 7200))
        assert refused.value.code == 409  # a live rank moving elsewhere: the registry's guard


async def test_rendezvous_lookup_of_a_registered_rank(registry: str) -> None:
    async with httpx.AsyncClient(timeout=2) as http, RendezvousClient(http) as client:
        base = bootstrap_url(registry, "lookup")
        for dp in range(2):
            await client.register(
                base,
                PrefillRank(page_size=16, attn_dp_size=2, attn_dp_rank=dp),
                Peer("127.0.0.1", 7000 + dp),
            )
        info = await client.prefill_info(base, timeout_s=1)
        assert (info.dp_size, info.tp_size, info.page_size) == (2, 1, 16)
        assert await client.rank_address(base, dp=1, tp=0, timeout_s=1) == Peer("127.0.0.1", 7001)
        with pytest.raises(RendezvousError, match="404"):
            await client.rank_address(base, dp=0, tp=3, timeout_s=1)


async def test_concurrent_lookups_of_one_prefill_make_one_call_each(registry: str) -> None:
    """A burst of rooms to a prefill the decode has not looked up yet asks the registry once
    (an SGLang decode's scheduler looks a prefill up once), not once per room: with the
    router's registry behind ``--workers N`` each lookup costs the registry's store round
    trips."""
    sent: list[str] = []

    async def count(request: httpx.Request) -> None:
        sent.append(request.url.path)

    async with (
        httpx.AsyncClient(timeout=2, event_hooks={"request": [count]}) as http,
        RendezvousClient(http) as client,
    ):
        base = bootstrap_url(registry, "burst")
        rank = PrefillRank(page_size=16, attn_dp_size=1, attn_dp_rank=0)
        await client.register(base, rank, Peer("127.0.0.1", 7300))
        sent.clear()
        infos = await asyncio.gather(*(client.prefill_info(base, timeout_s=2) for _ in range(20)))
        peers = await asyncio.gather(
            *(client.rank_address(base, dp=0, tp=0, timeout_s=2) for _ in range(20))
        )
        assert {info.dp_size for info in infos} == {1}
        assert set(peers) == {Peer("127.0.0.1", 7300)}
        assert sent == ["/bootstrap/burst/route"] * 2  # the parallel info, then the rank
