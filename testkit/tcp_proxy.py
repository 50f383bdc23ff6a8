"""A TCP forwarder on 127.0.0.1 that can cut the link the way a network partition does: no reset,
no close, the bytes simply stop arriving (``cut``); ``heal`` lets new connections through again
while the connections that were cut stay dead, as a TCP connection whose other end gave up."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PartitionProxy", "partition_proxy"]

_READ_BYTES = 65536


class PartitionProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut_now = False
        self._dead: set[int] = set()  # ids of the connections cut (their bytes are dropped)
        self._live: set[int] = set()
        self.connections = 0

    def cut(self) -> None:
        """Every connection stops carrying bytes (and so does every new one until ``heal``)."""
        self.cut_now = True
        self._dead |= self._live

    def heal(self) -> None:
        """New connections carry bytes again; those cut stay dead."""
        self.cut_now = False

    async def serve(self, started: threading.Event, stop: asyncio.Event) -> None:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        async with server:
            await stop.wait()
        handlers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for handler in handlers:
            handler.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        key = id(writer)
        (self._dead if self.cut_now else self._live).add(key)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, key), self._pipe(up_reader, writer, key))

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, key: int
    ) -> None:
        try:
            while data := await reader.read(_READ_BYTES):
                if key not in self._dead:
                    writer.write(data)
                    await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()


@contextmanager
def partition_proxy(target_port: int) -> Iterator[PartitionProxy]:
    """A ``PartitionProxy`` to ``target_port``, served on a thread of its own."""
    proxy = PartitionProxy(target_port)
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    thread = threading.Thread(
        target=loop.run_until_complete, args=(proxy.serve(started, stop),), daemon=True
    )
    thread.start()
    if not started.wait(10):
        raise RuntimeError("the proxy did not start")
    try:
        yield proxy
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
