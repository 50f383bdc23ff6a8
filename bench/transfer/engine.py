"""Transfer engine microbenchmark: bytes/s of 4 KiB pages, one entry per page vs coalesced.

    python -m bench.transfer.engine [--total-mib 64] [--page 4096] [--run-pages 64] [--repeat 3]

Two ``MooncakeEngine``s in this process (TCP over 127.0.0.1) copy ``--total-mib`` of pages from
one registered buffer into another; every run checks the bytes that arrived. Rows:

* ``engine, 1 entry/page``: ``MooncakeEngine.write`` with one entry per page (16384 for 64 MiB);
* ``engine, runs of N pages``: the same pages coalesced into entries of ``--run-pages`` pages;
* ``engine, 1 entry``: everything coalesced into a single entry;
* ``raw sync, ...``: the wheel's ``batch_transfer_sync_write`` on two other native engines, in
  batches of 1024 entries, as the baseline the adapter is compared with.

Columns: GB/s and wall ms (best of ``--repeat``), CPU ms of the whole process (every thread, so the
transport's too) and CPU us per entry for that best run.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import importlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from transfer.engine.mooncake import MooncakeEngine
from transfer.page_layout import MAX_ENTRIES_PER_BATCH, Entry, batches, columns

__all__ = ["Row", "main", "run_bench"]


class _RawNative(Protocol):
    def initialize(self, host: str, metadata: str, protocol: str, device: str, /) -> int: ...

    def get_rpc_port(self) -> int: ...

    def register_memory(self, ptr: int, length: int, /) -> int: ...

    def batch_transfer_sync_write(
        self, session: str, srcs: list[int], dsts: list[int], lens: list[int], /
    ) -> int: ...


@dataclass(frozen=True)
class Row:
    name: str
    entries: int
    nbytes: int
    wall_s: float
    cpu_s: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9

    def render(self) -> str:
        return (
            f"{self.name:<28} {self.entries:>7} {self.gbps:>7.2f} {self.wall_s * 1e3:>9.1f} "
            f"{self.cpu_s * 1e3:>9.1f} {self.cpu_s / self.entries * 1e6:>8.1f}"
        )


HEADER = f"{'path':<28} {'entries':>7} {'GB/s':>7} {'wall ms':>9} {'cpu ms':>9} {'us/entry':>8}"


def plan(src: int, dst: int, total: int, page: int, run_pages: int) -> list[Entry]:
    """Entries copying ``total`` bytes in runs of ``run_pages`` pages (0 means a single entry)."""
    size = total if run_pages == 0 else page * run_pages
    return [Entry(src + off, dst + off, min(size, total - off)) for off in range(0, total, size)]


async def measure(
    name: str,
    entries: Sequence[Entry],
    move: Callable[[], Awaitable[None]],
    check: Callable[[], bool],
    repeat: int,
) -> Row:
    best: Row | None = None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        await move()
        row = Row(
            name,
            len(entries),
            sum(e.length for e in entries),
            time.perf_counter() - wall,
            time.process_time() - cpu,
        )
        if not check():
            raise RuntimeError(f"{name}: the destination does not hold the source bytes")
        best = row if best is None or row.wall_s < best.wall_s else best
    assert best is not None
    return best


def raw_engines() -> tuple[_RawNative, _RawNative]:
    factory: Callable[[], _RawNative] = importlib.import_module("mooncake.engine").TransferEngine
    natives = (factory(), factory())
    for native in natives:
        if native.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
            raise RuntimeError("raw Mooncake engine failed to initialise")
    return natives


def raw_sync(native: _RawNative, session: str, entries: Sequence[Entry]) -> None:
    for batch in batches(entries, MAX_ENTRIES_PER_BATCH):
        if native.batch_transfer_sync_write(session, *columns(batch)) != 0:
            raise RuntimeError("batch_transfer_sync_write failed")


async def run_bench(total: int, page: int, run_pages: int, repeat: int) -> list[Row]:
    src, dst = ctypes.create_string_buffer(total), ctypes.create_string_buffer(total)
    src_addr, dst_addr = ctypes.addressof(src), ctypes.addressof(dst)
    ctypes.memmove(src_addr, bytes(range(256)) * (total // 256), total)

    def check() -> bool:
        ok = ctypes.string_at(dst_addr, total) == ctypes.string_at(src_addr, total)
        ctypes.memset(dst_addr, 0, total)
        return ok

    shapes = [("1 entry/page", 1), (f"runs of {run_pages} pages", run_pages), ("1 entry", 0)]
    rows: list[Row] = []
    a, b = await asyncio.gather(MooncakeEngine.start(), MooncakeEngine.start())
    try:
        a.register(src_addr, total)
        b.register(dst_addr, total)
        for label, run in shapes:
            entries = plan(src_addr, dst_addr, total, page, run)

            async def write(e: Sequence[Entry] = entries) -> None:
                await a.write(b.session_id, e)

            rows.append(await measure(f"engine, {label}", entries, write, check, repeat))
    finally:
        await asyncio.gather(a.close(), b.close())
    raw_a, raw_b = raw_engines()
    raw_a.register_memory(src_addr, total)
    raw_b.register_memory(dst_addr, total)
    session = f"127.0.0.1:{raw_b.get_rpc_port()}"
    for label, run in shapes:
        entries = plan(src_addr, dst_addr, total, page, run)

        async def move(e: Sequence[Entry] = entries) -> None:
            raw_sync(raw_a, session, e)

        rows.append(await measure(f"raw sync, {label}", entries, move, check, repeat))
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bench.transfer.engine", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--total-mib", type=int, default=64)
    parser.add_argument("--page", type=int, default=4096)
    parser.add_argument("--run-pages", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rows = asyncio.run(run_bench(args.total_mib << 20, args.page, args.run_pages, args.repeat))
    print(HEADER)
    for row in rows:
        print(row.render())


if __name__ == "__main__":
    main()
