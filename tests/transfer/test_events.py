"""KV cache event feed: codec against docs/concepts/protocols.md 7, publisher and subscriber on
real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from transfer.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventGapError,
    KVEvent,
    KVEventDecodeError,
    KVEventPublisher,
    KVEventSubscriber,
    ReceivedBatch,
    ReplayTimeout,
    codec,
    decode_batch,
    encode_batch,
)
from transfer.events.codec import LiveMessage

# docs/concepts/protocols.md 7.2, verbatim (split only where JSON allows whitespace).
OLD_JSON = """[1.5, [["BlockStored", [11,12], null, [1,2,3,4], 2, null, "GPU"],
                ["AllBlocksCleared"]], 0]"""
NEW_JSON = """[1.5, [{"type":"BlockStored","block_hashes":[11,12],"parent_block_hash":null,
                       "token_ids":[1,2,3,4],
             "block_size":2,"lora_id":null,"medium":"GPU","lora_name":null},
            {"type":"BlockRemoved","block_hashes":[11],"medium":"GPU"},
            {"type":"AllBlocksCleared"}], 0]"""

STORED = BlockStored(
    block_hashes=[11, 12],
    parent_block_hash=None,
    token_ids=[1, 2, 3, 4],
    block_size=2,
    lora_id=None,
)
NEW_BATCH = EventBatch(
    ts=1.5, events=[STORED, BlockRemoved([11]), AllBlocksCleared()], data_parallel_rank=0
)
LOCAL = "tcp://127.0.0.1:0"
DEADLINE = 5.0


def msgpack_of(json_text: str) -> bytes:
    return msgspec.msgpack.encode(json.loads(json_text))


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# ---------------------------------------------------------------- payload codec


def test_encoder_writes_protocols_new_example_exactly() -> None:
    decoded = msgspec.msgpack.decode(encode_batch(NEW_BATCH))
    # Same values and the same key order as the documented example.
    assert compact(decoded) == compact(json.loads(NEW_JSON))


def test_decoder_reads_protocols_new_example() -> None:
    assert decode_batch(msgpack_of(NEW_JSON)) == NEW_BATCH


def test_decoder_reads_protocols_old_example() -> None:
    batch = decode_batch(msgpack_of(OLD_JSON))
    assert batch == EventBatch(1.5, [STORED, AllBlocksCleared()], 0)


def test_round_trip_is_identity() -> None:
    batch = EventBatch(2.0, [BlockStored([1], 7, [5], 1, 3, "CPU_PINNED", "adapter")], 4)
    assert decode_batch(encode_batch(batch)) == batch


def test_null_rank_is_written_as_null_and_two_element_batches_decode() -> None:
    batch = EventBatch(1.0, [AllBlocksCleared()])
    written = msgspec.msgpack.decode(encode_batch(batch))
    assert written == [1.0, [{"type": "AllBlocksCleared"}], None]
    assert decode_batch(msgspec.msgpack.encode([1.0, [["AllBlocksCleared"]]])) == batch
    assert decode_batch(encode_batch(batch)) == batch
    assert decode_batch(msgpack_of("[1.0, [], null]")).data_parallel_rank is None
    # A longer batch (a future field) still decodes, by either path.
    assert decode_batch(msgpack_of('[1.0, [], 3, "new"]')).data_parallel_rank == 3
    assert decode_batch(msgpack_of('[1.0, [["AllBlocksCleared"]], 3, "new"]')).events == [
        AllBlocksCleared()
    ]


@pytest.mark.parametrize(
    ("old_event", "expected"),
    [
        # SGLang <= 0.5.8: five fields, no medium.
        (["BlockStored", [1], None, [9], 1, None], BlockStored([1], None, [9], 1, None, "GPU")),
        # vLLM 0.11: six fields, up to medium.
        (["BlockStored", [1], 0, [9], 1, 5, None], BlockStored([1], 0, [9], 1, 5, None)),
        # vLLM 0.14+: lora_name appended.
        (
            ["BlockStored", [1], 0, [9], 1, None, "GPU", "a"],
            BlockStored([1], 0, [9], 1, None, "GPU", "a"),
        ),
        # vLLM 0.20-0.23: extra_keys and group_idx trail; ignored.
        (
            ["BlockStored", [1], 0, [9], 1, None, "DISK", None, [None], 2],
            BlockStored([1], 0, [9], 1, None, "DISK"),
        ),
        (["BlockRemoved", [4, 5]], BlockRemoved([4, 5], "GPU")),
        (["BlockRemoved", [4, 5], "CPU_PINNED", 3], BlockRemoved([4, 5], "CPU_PINNED")),
    ],
)
def test_old_array_events_of_every_length(old_event: list[Any], expected: Any) -> None:
    batch = decode_batch(msgspec.msgpack.encode([0.5, [old_event], 1]))
    assert batch.events == [expected]


def test_new_map_events_ignore_fields_we_do_not_model() -> None:
    vllm_033 = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": [2],
        "block_size": 1,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None],
        "group_idx": 0,
        "session_id": "s",
    }
    sglang_omitted_medium = {"type": "BlockRemoved", "block_hashes": [3]}
    batch = decode_batch(msgspec.msgpack.encode([0.0, [vllm_033, sglang_omitted_medium]]))
    assert batch.events == [BlockStored([1], None, [2], 1, None), BlockRemoved([3])]


def test_bytes_hashes_fold_to_their_low_64_bits() -> None:
    digest = bytes(range(32))
    event = ["BlockStored", [digest], digest, [1], 1, None, "GPU"]
    stored = decode_batch(msgspec.msgpack.encode([0.0, [event]])).events[0]
    low = int.from_bytes(digest[-8:], "big")
    assert isinstance(stored, BlockStored)
    assert (stored.block_hashes, stored.parent_block_hash) == ([low], low)


def test_unknown_event_types_are_skipped(caplog: pytest.LogCaptureFixture) -> None:
    events = [{"type": "BlockMoved"}, ["Future", 1], ["AllBlocksCleared"]]
    payload = msgspec.msgpack.encode([0.0, events])
    assert decode_batch(payload).events == [AllBlocksCleared()]
    assert "BlockMoved" in caplog.text and "Future" in caplog.text


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never valid msgpack
        msgspec.msgpack.encode({"ts": 1.0}),
        msgspec.msgpack.encode([1.0]),
        msgspec.msgpack.encode([1.0, "events", 0]),
        msgspec.msgpack.encode([1.0, [[1, 2]], 0]),  # untagged array event
        msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}], 0]),  # untagged map event
        msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]], 0]),  # too few fields
        msgspec.msgpack.encode(["soon", [], 0]),
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


# ---------------------------------------------------------------- frame codec


def test_frame_layouts() -> None:
    assert END_SEQ == b"\xff" * 8
    assert codec.live_frames("t", 258, b"p") == [b"t", b"\x00" * 6 + b"\x01\x02", b"p"]
    assert codec.replay_request_frames(1) == [b"", b"\x00" * 7 + b"\x01"]
    assert codec.replay_end_frames(b"id") == [b"id", b"", b"", END_SEQ, b""]
    reply = codec.replay_reply_frames(b"id", LiveMessage("t", 2, b"p"))
    assert reply == [b"id", b"", b"t", codec.encode_seq(2), b"p"]


@pytest.mark.parametrize(
    ("frames", "start"),
    [
        ([b"id", b"", codec.encode_seq(5)], 5),
        ([b"id", codec.encode_seq(5)], None),  # no empty delimiter
        ([b"id", b"x", codec.encode_seq(5)], None),
        ([b"id", b"", b"\x05"], None),  # short seq
        ([b"id", b"", codec.encode_seq(5), b""], None),
    ],
)
def test_replay_request_shape_is_exact(frames: list[bytes], start: int | None) -> None:
    request = codec.parse_replay_request(frames)
    assert (request.start_seq if request else None) == start


@pytest.mark.parametrize(
    ("frames", "parsed"),
    [
        ([b"", b"t", codec.encode_seq(3), b"p"], LiveMessage("t", 3, b"p")),
        ([b"", b"", END_SEQ, b""], codec.REPLAY_END),
        ([b"", codec.encode_seq(3), b"p"], LiveMessage(None, 3, b"p")),
        ([b"", END_SEQ, b""], codec.REPLAY_END),
    ],
)
def test_replay_replies_in_both_framings(frames: list[bytes], parsed: object) -> None:
    assert codec.parse_replay_reply(frames) == parsed


@pytest.mark.parametrize(
    "frames", [[b"", b"p"], [b"x", codec.encode_seq(3), b"p"], [b"", b"", b"\x01", b"p"]]
)
def test_malformed_replay_replies_raise(frames: list[bytes]) -> None:
    with pytest.raises(KVEventDecodeError):
        codec.parse_replay_reply(frames)


# ---------------------------------------------------------------- sockets


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def fixed_clock() -> float:
    return 1.5


class LossyPublisher(KVEventPublisher):
    """Drops the live copy of chosen seqs; they stay in the replay buffer."""

    drop: set[int] = set()

    async def _send_live(self, pub: zmq.asyncio.Socket, message: LiveMessage) -> None:
        if message.seq not in self.drop:
            await super()._send_live(pub, message)


class FakeEngine:
    """Hand-built PUB + ROUTER, for framings and faults our publisher never produces."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:  # closed by the ``fake`` fixture
        self.pub = ctx.socket(zmq.PUB)
        self.router = ctx.socket(zmq.ROUTER)
        for sock in (self.pub, self.router):
            sock.bind(LOCAL)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.seq = 0

    async def send(self, seq: int, payload: bytes | None = None) -> int:
        body = encode_batch(EventBatch(0.0, [AllBlocksCleared()])) if payload is None else payload
        await self.pub.send_multipart(codec.live_frames("", seq, body))
        return seq

    async def probe(self) -> int:
        self.seq += 1
        return await self.send(self.seq)

    async def serve_old_framing(self, buffer: dict[int, bytes]) -> None:
        """Answer one replay request as vLLM <= 0.24 did: [seq, payload] then [END_SEQ, b""]."""
        identity, _, start = await self.router.recv_multipart()
        for seq in sorted(s for s in buffer if s >= codec.decode_seq(start)):
            await self.router.send_multipart([identity, b"", codec.encode_seq(seq), buffer[seq]])
        await self.router.send_multipart([identity, b"", END_SEQ, b""])


@pytest.fixture
def fake(ctx: zmq.asyncio.Context) -> Iterator[FakeEngine]:
    engine = FakeEngine(ctx)
    yield engine
    engine.pub.close(linger=0)
    engine.router.close(linger=0)


async def join(sub: KVEventSubscriber, probe: Callable[[], Awaitable[int]]) -> list[ReceivedBatch]:
    """Beat the slow joiner: publish probes until the latest one is read; return what was read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + DEADLINE
    seen: list[ReceivedBatch] = []
    while loop.time() < deadline:
        last = await probe()
        try:
            while not seen or seen[-1].seq != last:
                seen.append(await sub.next(timeout=0.05))
            return seen
        except TimeoutError:
            continue
    raise AssertionError("subscriber never received a probe")


async def read(sub: KVEventSubscriber, count: int) -> list[ReceivedBatch]:
    return [await sub.next(timeout=DEADLINE) for _ in range(count)]


async def dealer_request(
    ctx: zmq.asyncio.Context, endpoint: str, *requests: list[bytes]
) -> list[list[bytes]]:
    """Send raw requests from one DEALER; collect replies up to the first end marker."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    replies: list[list[bytes]] = []
    async with asyncio.timeout(DEADLINE):
        for request in requests:
            await dealer.send_multipart(request)
        while not replies or replies[-1][2] != END_SEQ:
            replies.append(await dealer.recv_multipart())
    dealer.close(linger=0)
    return replies


def batch_of(i: int) -> list[KVEvent]:
    return [BlockStored([i], i - 1 if i else None, [i, i], 2, None)]


async def test_live_stream_in_order_with_topic_prefix(ctx: zmq.asyncio.Context) -> None:
    async with (
        KVEventPublisher(LOCAL, topic="kv@rank0", context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, topic="kv", context=ctx) as sub,
    ):
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith(":0")
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
        first = pub.next_seq
        for i in range(20):
            await pub.publish(batch_of(i), dp_rank=0)
        got = await read(sub, 20)
    assert [g.seq for g in got] == list(range(first, first + 20))
    assert [g.batch.events for g in got] == [batch_of(i) for i in range(20)]
    assert {(g.topic, g.replayed, g.batch.data_parallel_rank) for g in got} == {
        ("kv@rank0", False, 0)
    }
    assert sub.stats.lost == sub.stats.replayed == 0


async def test_next_times_out_when_nothing_arrives(ctx: zmq.asyncio.Context) -> None:
    async with (
        KVEventPublisher(LOCAL, context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, context=ctx) as sub,
    ):
        with pytest.raises(TimeoutError):
            await sub.next(timeout=0.05)


async def test_timeouts_racing_arrivals_lose_no_batch(ctx: zmq.asyncio.Context) -> None:
    """A reader polling with short timeouts (a thread that must notice a stop flag) while the
    publisher sends: a timeout that fires as a message arrives must not swallow it. Without
    replay, a swallowed batch is lost for good (an idle engine sends nothing that reveals it)."""
    count = 1000
    async with (
        KVEventPublisher(LOCAL, context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, context=ctx) as sub,
    ):
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
        first = pub.next_seq

        async def produce() -> None:
            for i in range(count):
                await pub.publish(batch_of(i))
                await asyncio.sleep((i % 7) * 0.0001)

        producer = asyncio.create_task(produce())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE * 4
        got: list[int] = []
        while len(got) < count and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                got.append((await sub.next(timeout=(1 + len(got) % 5) * 0.0001)).seq)
        await producer
    assert sub.stats.lost == 0
    assert got == list(range(first, first + count))


async def test_a_waiting_reader_is_woken_by_each_batch(ctx: zmq.asyncio.Context) -> None:
    """A reader waiting on an idle stream gets each batch as it arrives, not when its wait's
    periodic re-check (0.5 s, for a wake-up libzmq lost) comes round: the router's KV index is
    that much fresher."""
    async with (
        KVEventPublisher(LOCAL, context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, context=ctx) as sub,
    ):
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
        loop = asyncio.get_running_loop()
        delays = []
        for i in range(10):
            waiting = asyncio.create_task(sub.next(timeout=DEADLINE))
            await asyncio.sleep(0.02)  # let the reader reach its wait on the idle stream
            sent = loop.time()
            await pub.publish(batch_of(i))
            await waiting
            delays.append(loop.time() - sent)
    assert sorted(delays)[5] < 0.1, delays  # the median: a wake-up, not the 0.5 s re-check


async def test_publish_requires_an_open_publisher() -> None:
    pub = KVEventPublisher(LOCAL)
    with pytest.raises(RuntimeError):
        await pub.publish([AllBlocksCleared()])
    with pytest.raises(RuntimeError):
        _ = pub.endpoint


async def test_failed_bind_closes_what_was_opened(ctx: zmq.asyncio.Context) -> None:
    publisher = KVEventPublisher(LOCAL, replay_endpoint="tcp://127.0.0.1:not-a-port", context=ctx)
    with pytest.raises(zmq.ZMQError):
        async with publisher:
            pass
    with pytest.raises(RuntimeError):
        await publisher.publish([AllBlocksCleared()])


async def test_replay_returns_batches_from_start_then_end(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher(
        LOCAL, replay_endpoint=LOCAL, topic="t", buffer_steps=5, clock=fixed_clock, context=ctx
    ) as pub:
        assert pub.replay_endpoint is not None
        for i in range(8):  # seqs 0..7; the buffer keeps 3..7
            await pub.publish(batch_of(i))
        from_five = await dealer_request(ctx, pub.replay_endpoint, codec.replay_request_frames(5))
        from_zero = await dealer_request(ctx, pub.replay_endpoint, codec.replay_request_frames(0))
        past_end = await dealer_request(ctx, pub.replay_endpoint, codec.replay_request_frames(8))
    end = [b"", b"", END_SEQ, b""]
    assert from_five == [
        [b"", b"t", codec.encode_seq(i), encode_batch(EventBatch(1.5, batch_of(i)))]
        for i in (5, 6, 7)
    ] + [end]
    assert [codec.decode_seq(r[2]) for r in from_zero[:-1]] == [3, 4, 5, 6, 7]
    assert past_end == [end]


async def test_malformed_replay_requests_are_ignored(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    async with KVEventPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub:
        assert pub.replay_endpoint is not None
        await pub.publish(batch_of(0))
        replies = await dealer_request(
            ctx,
            pub.replay_endpoint,
            [codec.encode_seq(0)],  # no empty delimiter
            [b"", b"\x00"],  # short seq
            [b"", codec.encode_seq(0), b"more"],
            [b"x", codec.encode_seq(0)],
            codec.replay_request_frames(0),
        )
        # The four bad requests got nothing; the good one got seq 0 and the end marker.
        assert [r[2] for r in replies] == [codec.encode_seq(0), END_SEQ]
        assert await pub.publish(batch_of(1)) == 1
        again = await dealer_request(ctx, pub.replay_endpoint, codec.replay_request_frames(1))
    assert [r[2] for r in again] == [codec.encode_seq(1), END_SEQ]
    assert caplog.text.count("ignoring malformed KV event replay request") == 4


async def test_gap_in_a_burst_is_filled_from_replay(ctx: zmq.asyncio.Context) -> None:
    async with (
        LossyPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub,
    ):
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
        base = pub.next_seq
        pub.drop = {base + 3, base + 4, base + 7}
        for i in range(10):
            await pub.publish(batch_of(i))
        got = await read(sub, 10)
        # The first gap's replay already yielded base+3..base+9: their live copies are dropped.
        await pub.publish(batch_of(10))
        got += await read(sub, 1)
    assert [g.seq for g in got] == list(range(base, base + 11))
    assert [g.batch.events for g in got] == [batch_of(i) for i in range(11)]
    assert {g.seq for g in got if g.replayed} >= pub.drop
    assert not got[-1].replayed
    assert (sub.stats.duplicates, sub.stats.lost, sub.stats.restarts) == (3, 0, 0)


async def test_gap_while_streaming_then_live_resumes(ctx: zmq.asyncio.Context) -> None:
    async with (
        LossyPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub,
        KVEventSubscriber(pub.endpoint, replay_endpoint=pub.replay_endpoint, context=ctx) as sub,
    ):
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
        base = pub.next_seq
        pub.drop = {base}
        await pub.publish(batch_of(0))  # lost live
        await pub.publish(batch_of(1))  # reveals the gap
        recovered = await read(sub, 2)
        await pub.publish(batch_of(2))
        (live,) = await read(sub, 1)
    assert [(g.seq, g.replayed) for g in recovered] == [(base, True), (base + 1, True)]
    assert (live.seq, live.replayed, live.batch.events) == (base + 2, False, batch_of(2))
    assert (sub.stats.replayed, sub.stats.duplicates, sub.stats.lost) == (2, 0, 0)


async def test_start_seq_catches_up_on_batches_published_before_connecting(
    ctx: zmq.asyncio.Context,
) -> None:
    async with KVEventPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub:
        for i in range(5):
            await pub.publish(batch_of(i))
        async with KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0, context=ctx
        ) as sub:
            seen = await join(sub, lambda: pub.publish([AllBlocksCleared()]))
    assert [g.seq for g in seen] == list(range(len(seen)))
    assert [g.batch.events for g in seen[:5]] == [batch_of(i) for i in range(5)]
    assert all(g.replayed for g in seen[:5])


async def test_catch_up_learns_an_idle_publishers_past_without_a_live_message(
    ctx: zmq.asyncio.Context,
) -> None:
    """An engine that published and then went quiet: nothing live would ever reveal the gap."""
    async with KVEventPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub:
        for i in range(5):
            await pub.publish(batch_of(i))
        async with KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0, context=ctx
        ) as sub:
            assert await sub.catch_up() == 5
            caught = await read(sub, 5)
            assert [g.seq for g in caught] == [0, 1, 2, 3, 4] and all(g.replayed for g in caught)
            live = await join(sub, lambda: pub.publish([AllBlocksCleared()]))
    # no batch comes twice (the probes that beat the slow joiner may be replayed themselves)
    assert [g.seq for g in caught + live] == list(range(len(caught) + len(live)))
    assert sub.stats.lost == 0 and sub.stats.restarts == 0


async def test_old_framing_and_old_encoding_from_a_fake_engine(
    ctx: zmq.asyncio.Context, fake: FakeEngine
) -> None:
    old = msgpack_of(OLD_JSON)
    async with KVEventSubscriber(
        fake.endpoint, replay_endpoint=fake.replay_endpoint, context=ctx
    ) as sub:
        server = asyncio.create_task(fake.serve_old_framing({2: old, 3: old, 4: old}))
        replayed = await sub.replay(3)
        await server
        # Now a live gap, recovered through the same old framing.
        last = (await join(sub, fake.probe))[-1].seq
        buffer = {s: old for s in range(last + 1, last + 4)}
        server = asyncio.create_task(fake.serve_old_framing(buffer))
        await fake.send(last + 3, old)
        recovered = await read(sub, 3)
        await server
    expected = EventBatch(1.5, [STORED, AllBlocksCleared()], 0)
    assert [(r.seq, r.topic, r.batch) for r in replayed] == [(s, None, expected) for s in (3, 4)]
    assert [(r.seq, r.replayed, r.batch) for r in recovered] == [
        (s, True, expected) for s in range(last + 1, last + 4)
    ]


async def test_replay_timeout_is_an_error_not_a_hang(
    ctx: zmq.asyncio.Context, fake: FakeEngine
) -> None:
    # The fake's ROUTER never answers.
    async with KVEventSubscriber(
        fake.endpoint, replay_endpoint=fake.replay_endpoint, replay_timeout=0.1, context=ctx
    ) as sub:
        with pytest.raises(ReplayTimeout):
            await sub.replay(0)
        last = (await join(sub, fake.probe))[-1].seq
        await fake.send(last + 5)
        (item,) = await read(sub, 1)
    assert (item.seq, item.replayed) == (last + 5, False)
    assert sub.stats.lost == 4


async def test_late_replies_to_a_timed_out_replay_are_not_mixed_in(
    ctx: zmq.asyncio.Context, fake: FakeEngine
) -> None:
    old = msgpack_of(OLD_JSON)
    async with KVEventSubscriber(
        fake.endpoint, replay_endpoint=fake.replay_endpoint, replay_timeout=0.25, context=ctx
    ) as sub:
        server = asyncio.create_task(fake.serve_old_framing({0: old}))
        assert [r.seq for r in await sub.replay(0)] == [0]  # connected and working
        await server
        unanswered = asyncio.ensure_future(fake.router.recv_multipart())
        with pytest.raises(ReplayTimeout):
            await sub.replay(0)
        identity = (await unanswered)[0]
        # The answer comes too late, to the DEALER the subscriber has since replaced.
        await fake.router.send_multipart([identity, b"", codec.encode_seq(7), old])
        await fake.router.send_multipart([identity, b"", END_SEQ, b""])
        server = asyncio.create_task(fake.serve_old_framing({1: old}))
        fresh = await sub.replay(0)
        await server
    assert [r.seq for r in fresh] == [1]


async def test_strict_subscriber_raises_on_unrecoverable_gap(
    ctx: zmq.asyncio.Context, fake: FakeEngine
) -> None:
    async with KVEventSubscriber(fake.endpoint, strict=True, context=ctx) as sub:  # no replay
        last = (await join(sub, fake.probe))[-1].seq
        await fake.send(last + 3)
        with pytest.raises(EventGapError) as gap:
            await sub.next(timeout=DEADLINE)
        (item,) = await read(sub, 1)  # the message that revealed the gap is still delivered
    assert (gap.value.first, gap.value.last) == (last + 1, last + 2)
    assert item.seq == last + 3


async def test_restart_and_malformed_messages(ctx: zmq.asyncio.Context, fake: FakeEngine) -> None:
    async with KVEventSubscriber(fake.endpoint, context=ctx) as sub:
        last = (await join(sub, fake.probe))[-1].seq
        await fake.pub.send_multipart([b"", b"\x01", b"x"])  # seq frame too short
        await fake.send(last + 1, b"\xc1")  # undecodable payload: seq consumed, batch skipped
        await fake.send(last + 2)
        await fake.send(0)  # publisher restarted
        got = await read(sub, 2)
    assert [g.seq for g in got] == [last + 2, 0]
    assert (sub.stats.malformed, sub.stats.restarts, sub.stats.lost) == (2, 1, 0)


async def test_publisher_logs_nothing_at_warning_in_normal_use(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with (
        KVEventPublisher(LOCAL, replay_endpoint=LOCAL, context=ctx) as pub,
        KVEventSubscriber(
            pub.endpoint, replay_endpoint=pub.replay_endpoint, start_seq=0, context=ctx
        ) as sub,
    ):
        await join(sub, lambda: pub.publish([AllBlocksCleared()]))
    assert caplog.records == []
