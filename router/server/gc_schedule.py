"""When the router's process collects its cyclic garbage.

``tune_gc`` (at start-up) freezes the start-up objects and raises the young generation's threshold
to 50,000: the hot path allocates many short-lived objects (coroutines, futures, dicts), and with
the default threshold of 700 the collector ran every few requests (measured with bench.load.run on
the
2-core dev machine: -15% router CPU per request at 32 concurrent streams).

That threshold alone let cyclic garbage pile up for minutes: every ``httpx`` response is a
reference cycle (``Response`` <-> ``BoundAsyncStream``), so each health probe and engine load read
leaves ~40 objects (~5 KiB with their buffers) that only the collector frees, as do exceptions
kept with their tracebacks on error paths; an automatic collection came only after 50,000 of
them. The soak saw the router's RSS climb ~15% over 5,000 requests (bench/soak/rss_drift.py showed
it linear in time). ``collect_periodically`` (a task on the router's event loop) therefore collects
the young generations every ``interval_s`` (cost: the objects allocated since the last tick) and
everything every ``full_every`` ticks, so garbage lives about a second, not until 50,000 objects.
"""

from __future__ import annotations

import asyncio
import gc
import itertools

__all__ = ["FULL_EVERY", "INTERVAL_S", "collect_periodically", "tune_gc"]

INTERVAL_S = 1.0
FULL_EVERY = 600  # ticks: a full collection every 10 minutes (what outlived two young ones)


def tune_gc() -> None:
    """Freeze start-up objects and collect the young generation automatically less often."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)


async def collect_periodically(
    interval_s: float = INTERVAL_S, full_every: int = FULL_EVERY
) -> None:
    """Collect generations 0 and 1 every ``interval_s``, all of them every ``full_every`` ticks,
    until cancelled."""
    for tick in itertools.count(1):
        await asyncio.sleep(interval_s)
        gc.collect(2 if tick % full_every == 0 else 1)
