"""What reading a KV event stream costs the reader: CPU per batch, this tree against another.

    python -m bench.transfer.event_read [--batches 2000] [--rate 300] [--blocks 8]
        [--repeats 3] [--compare-pythonpath DIR]

A publisher process (this tree's ``KVEventPublisher``) sends ``--batches`` batches of one
``BlockStored`` of ``--blocks`` 16-token blocks, paced at ``--rate`` a second (one wake-up of
the reader per batch, as engines publish them), to a reader process that follows the stream
with ``KVEventSubscriber`` and reports its own CPU time (every thread: libzmq's I/O thread too)
per batch, from its first batch to its last. Readers, interleaved in every repeat:

* ``current``: this tree's subscriber;
* ``compare``: the subscriber of the tree at ``--compare-pythonpath`` (e.g. a ``git archive`` of
  an older commit), when given;
* ``floor``: a bare ZeroMQ SUB socket read with NOBLOCK on each wake-up of the event loop,
  nothing decoded: what a wake-up per batch costs whatever reads it.

Prints each reader's median µs per batch (min-max) and the ratios to ``floor`` and ``compare``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import IO

__all__ = ["main", "read_once"]

TREE = str(Path(__file__).resolve().parents[2])  # this source tree

_PUBLISHER = """
import asyncio, sys, time
from transfer.events import BlockStored, KVEventPublisher
count, rate, blocks = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
async def main():
    async with KVEventPublisher("tcp://127.0.0.1:0") as publisher:
        print(publisher.endpoint, flush=True)
        sys.stdin.readline()
        due = time.monotonic()
        for i in range(count):
            event = BlockStored(block_hashes=list(range(i * blocks, (i + 1) * blocks)),
                parent_block_hash=None, token_ids=list(range(16 * blocks)), block_size=16,
                lora_id=None)
            await publisher.publish([event])
            due += 1 / rate
            await asyncio.sleep(max(0.0, due - time.monotonic()))
        await asyncio.sleep(2)
asyncio.run(main())
"""

_READER = """
import asyncio, sys, time
import uvloop, zmq
endpoint, count, kind, limit_s = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
async def subscriber():
    from transfer.events import KVEventSubscriber
    async with KVEventSubscriber(endpoint) as sub:
        await asyncio.sleep(0.5)  # joined before the first batch (ZeroMQ's slow joiner)
        print("ready", flush=True)
        await sub.next(30)
        start = time.process_time()
        for _ in range(count - 1):
            await sub.next(30)
        return time.process_time() - start
async def floor():
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)
    loop = asyncio.get_running_loop()
    done, got, start = loop.create_future(), 0, 0.0
    def drain():
        nonlocal got, start
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            socket.recv_multipart(zmq.NOBLOCK)
            got += 1
            if got == 1:
                start = time.process_time()
            if got == count and not done.done():
                done.set_result(time.process_time() - start)
    loop.add_reader(socket.getsockopt(zmq.FD), drain)
    await asyncio.sleep(0.5)
    print("ready", flush=True)
    return await asyncio.wait_for(done, limit_s)
uvloop.install()
spent = asyncio.run(floor() if kind == "floor" else subscriber())
print(f"{1e6 * spent / (count - 1):.1f}", flush=True)
"""


def read_once(reader_path: str, kind: str, batches: int, rate: float, blocks: int) -> float:
    """One run: µs of the reader's CPU per batch (``kind``: ``subscriber`` or ``floor``), the
    reader importing ``transfer`` from ``reader_path``."""
    limit_s = batches / rate + 30  # a reader that lost batches fails, never hangs
    publisher_argv = [sys.executable, "-P", "-c", _PUBLISHER, str(batches), str(rate), str(blocks)]
    with subprocess.Popen(
        publisher_argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": TREE},
    ) as publisher:
        assert publisher.stdin is not None and publisher.stdout is not None
        try:
            endpoint = publisher.stdout.readline().strip()
            return _read(reader_path, kind, endpoint, batches, limit_s, publisher.stdin)
        finally:
            publisher.kill()


def _read(
    reader_path: str, kind: str, endpoint: str, batches: int, limit_s: float, go: IO[str]
) -> float:
    """Start the reader, let the publisher ``go`` once it is ready, and take its result."""
    argv = [sys.executable, "-P", "-c", _READER, endpoint, str(batches), kind, str(limit_s)]
    env = {**os.environ, "PYTHONPATH": reader_path}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env) as reader:
        assert reader.stdout is not None
        try:
            if reader.stdout.readline().strip() != "ready":
                raise RuntimeError(f"the reader did not start ({kind}, {reader_path})")
            go.write("go\n")
            go.flush()
            result = reader.stdout.readline().strip()
            if reader.wait(timeout=limit_s) != 0 or not result:
                raise RuntimeError(f"the reader failed ({kind}, {reader_path})")
            return float(result)
        finally:
            reader.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=300.0, help="batches a second")
    parser.add_argument("--blocks", type=int, default=8, help="16-token blocks a batch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compare-pythonpath", help="a source tree whose subscriber to compare")
    args = parser.parse_args(argv)
    if args.batches < 2 or args.rate <= 0 or args.blocks < 1 or args.repeats < 1:
        parser.error("--batches >= 2, --rate > 0, --blocks >= 1, --repeats >= 1")
    readers = {"current": (TREE, "subscriber"), "floor": (TREE, "floor")}
    if args.compare_pythonpath:
        readers["compare"] = (str(Path(args.compare_pythonpath).resolve()), "subscriber")
    runs: dict[str, list[float]] = {name: [] for name in readers}
    for repeat in range(args.repeats):
        names = list(readers)[repeat % len(readers) :] + list(readers)[: repeat % len(readers)]
        for name in names:
            path, kind = readers[name]
            runs[name].append(read_once(path, kind, args.batches, args.rate, args.blocks))
    print(
        f"event_read: {args.batches} batches of {args.blocks} blocks at {args.rate:g}/s, "
        f"{args.repeats} repeat(s); reader CPU µs per batch, median (min-max)"
    )
    medians = {name: statistics.median(values) for name, values in runs.items()}
    for name, values in runs.items():
        ratios = [f"{name}/floor {medians[name] / medians['floor']:.2f}"]
        if "compare" in medians and name == "current":
            ratios.append(f"current/compare {medians['current'] / medians['compare']:.2f}")
        print(
            f"  {name:8} {medians[name]:7.1f} ({min(values):.1f}-{max(values):.1f})  "
            + "  ".join(ratios)
        )


if __name__ == "__main__":
    main()
