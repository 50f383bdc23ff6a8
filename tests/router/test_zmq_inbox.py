"""``read_forever``: a SUB socket's messages reach the taker on the socket's wake-up, and every
interval when the wake-up is lost (the descriptor is edge-triggered)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import zmq

from router.zmq_inbox import DRAIN_BATCH, read_forever
from testkit.polling import await_until


@pytest.fixture
def sockets() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pub, sub = context.socket(zmq.PUB), context.socket(zmq.SUB)
    pub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub.connect(f"tcp://127.0.0.1:{port}")
    yield pub, sub
    pub.close()
    sub.close()
    context.term()


async def _until_heard(pub: zmq.Socket[bytes], taken: list[bytes], count: int) -> None:
    """Publish (again, until the subscription has reached the PUB) until ``count`` were taken."""

    async def resend() -> None:
        while True:
            for n in range(count):
                pub.send(b"%d" % n)
            await asyncio.sleep(0.05)

    sender = asyncio.create_task(resend())
    try:
        await await_until(lambda: len(set(taken)) >= count, 10, f"{count} messages taken")
    finally:
        sender.cancel()


async def test_a_message_is_taken_on_the_sockets_wake_up(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    pub, sub = sockets
    taken: list[bytes] = []
    reader = asyncio.create_task(read_forever(sub, taken.append, 3600))  # no interval helps
    try:
        started = time.monotonic()
        await _until_heard(pub, taken, DRAIN_BATCH + 10)  # more than one batch
        assert time.monotonic() - started < 5
    finally:
        reader.cancel()


async def test_messages_are_taken_every_interval_when_no_wake_up_comes(
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    pub, sub = sockets
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(loop, "add_reader", lambda *_: None)  # every wake-up lost
    monkeypatch.setattr(loop, "remove_reader", lambda *_: True)
    taken: list[bytes] = []
    reader = asyncio.create_task(read_forever(sub, taken.append, 0.02))
    try:
        await _until_heard(pub, taken, 3)
    finally:
        reader.cancel()
