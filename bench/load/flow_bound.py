"""What any router order can do for flow-control figure (a), on the bench's fleet: a simulation.

``bench.load.flow_control`` (a) floods k prefills that compute one prompt at a time (S seconds
each) with tenant A's requests while tenant B sends at a fixed rate. A prompt in progress cannot
be interrupted, so the best order gives B the first place that comes free (what the worker queue
does for a tenant under its share). This simulates exactly that, event by event, and prints B's
TTFT p99 over S, its ratio to B alone (the target is <= 1.5), and A's share of the places, for
places held back from A (``reserve``: A may take a place only while more than that many are
free; 0 is work-conserving). No router and no network: the bound, not a measurement.

    python -m bench.load.flow_bound [--prefills 4] [--service-s 0.22] [--spread 0.05]
        [--b-rate 7] [--poisson] [--reserve 0,1,2] [--requests 100000] [--seed 1]
"""

from __future__ import annotations

import argparse
import heapq
import random
from collections import deque
from dataclasses import dataclass

__all__ = ["Bound", "Fleet", "main", "simulate"]


@dataclass(frozen=True)
class Bound:
    reserve: int
    b_p99_s: float  # B's TTFT p99
    b_alone_p99_s: float  # the same with A silent
    a_share: float  # A's completed prompts x S / (prefills x time): its share of the places

    @property
    def ratio(self) -> float:
        return self.b_p99_s / self.b_alone_p99_s


@dataclass(frozen=True)
class Fleet:
    prefills: int
    service_s: float  # one prompt's forward pass, on average
    spread: float  # each forward pass is service_s x uniform(1 - spread, 1 + spread)
    b_rate: float  # B's requests per second
    poisson: bool  # B's arrivals: Poisson, or one every 1 / b_rate s (the bench's open loop)

    def service(self, rng: random.Random) -> float:
        return self.service_s * rng.uniform(1.0 - self.spread, 1.0 + self.spread)

    def gap(self, rng: random.Random) -> float:
        return rng.expovariate(self.b_rate) if self.poisson else 1.0 / self.b_rate


def _b_p99(fleet: Fleet, reserve: int | None, requests: int, seed: int) -> tuple[float, float]:
    """B's TTFT p99 and A's share; ``reserve`` None: A silent."""
    rng = random.Random(seed)
    prefills = fleet.prefills
    busy: list[float] = []  # the places' end times
    if reserve is not None:
        busy = [rng.uniform(0.0, fleet.service_s) for _ in range(prefills - reserve)]
        heapq.heapify(busy)
    waiting: deque[float] = deque()  # B's arrival times
    next_b = fleet.gap(rng)
    ttfts: list[float] = []
    a_busy_s = 0.0
    now = 0.0
    while len(ttfts) < requests:
        if busy and busy[0] <= next_b:
            now = heapq.heappop(busy)
        else:
            now = next_b
            waiting.append(now)
            next_b = now + fleet.gap(rng)
        while waiting and len(busy) < prefills:  # B first, into any free place
            service = fleet.service(rng)
            heapq.heappush(busy, now + service)
            ttfts.append(now - waiting.popleft() + service)
        while reserve is not None and len(busy) < prefills - reserve:  # A: beyond the reserve
            service = fleet.service(rng)
            heapq.heappush(busy, now + service)
            a_busy_s += service
    ttfts.sort()
    return ttfts[int(0.99 * len(ttfts))], a_busy_s / (prefills * now)


def simulate(fleet: Fleet, reserves: list[int], requests: int, seed: int) -> list[Bound]:
    """B alone, then under A's flood with each of ``reserves`` places held back from A."""
    alone, _ = _b_p99(fleet, None, requests, seed)
    bounds = []
    for reserve in reserves:
        p99, share = _b_p99(fleet, reserve, requests, seed)
        bounds.append(Bound(reserve, p99, alone, share))
    return bounds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="bench.load.flow_bound", description=__doc__.split("\n")[0])
    p.add_argument("--prefills", type=int, default=4)
    p.add_argument("--service-s", type=float, default=0.22, help="one prompt's forward pass")
    p.add_argument("--spread", type=float, default=0.05, help="of a forward pass, +-")
    p.add_argument("--b-rate", type=float, default=7.0, help="B's requests per second")
    p.add_argument("--poisson", action="store_true", help="B's arrivals Poisson (else evenly)")
    p.add_argument("--reserve", default="0,1,2", help="places held back from A, comma-separated")
    p.add_argument("--requests", type=int, default=100_000, help="B's requests per run")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    reserves = [int(r) for r in args.reserve.split(",")]
    if args.prefills < 1 or args.service_s <= 0 or args.b_rate <= 0 or args.requests < 100:
        p.error("--prefills >= 1, --service-s > 0, --b-rate > 0, --requests >= 100")
    if not 0 <= args.spread < 1:
        p.error("--spread is 0 .. 1")
    if any(not 0 <= r < args.prefills for r in reserves):
        p.error("each --reserve is 0 .. prefills - 1")
    fleet = Fleet(args.prefills, args.service_s, args.spread, args.b_rate, args.poisson)
    bounds = simulate(fleet, reserves, args.requests, args.seed)
    print(
        f"flow_bound: {args.prefills} one-at-a-time prefills, S = {args.service_s:g} s "
        f"+-{args.spread:.0%}, B at {args.b_rate:g} req/s "
        f"({'Poisson' if args.poisson else 'evenly spaced'}; "
        f"{args.b_rate * args.service_s / args.prefills:.2f} of capacity), A always waiting; "
        f"{args.requests} of B's requests per row\n"
    )
    print("| places held back from A | B TTFT p99 / S | B p99 / B alone | A's share of places |")
    print("|---|---|---|---|")
    for b in bounds:
        p99 = b.b_p99_s / args.service_s
        print(f"| {b.reserve} | {p99:.2f} | {b.ratio:.2f} | {b.a_share:.2f} |")


if __name__ == "__main__":
    main()
