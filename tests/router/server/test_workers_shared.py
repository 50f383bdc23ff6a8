"""``router --workers N`` decides as one router: the caps count every process's requests (the
host's load board). Each request below is on a connection of its own, so that SO_REUSEPORT
spreads them over the processes; without the board about half of them would reach the process
that is not serving the slow stream, see its own count at 0, and be served."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from testkit.fake_engine import FakeConfig
from testkit.polling import wait_until
from tests.router.server.test_workers import BODY, STREAM, fresh, processes_of, supervised

SLOW = FakeConfig(tokens=20, token_delay=0.1, check_kv=False)  # 1.2 s per 12-token stream


def stream_in_background(url: str, done: list[int]) -> threading.Thread:
    def read() -> None:
        with httpx.stream("POST", url + "/v1/completions", json=STREAM, timeout=30) as response:
            for _ in response.iter_lines():
                pass
            done.append(response.status_code)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def busy(url: str) -> bool:
    return sum(int(p["requests_inflight"]) for p in processes_of(url)) == 1  # type: ignore[call-overload]


def test_the_per_worker_cap_counts_every_process() -> None:
    with supervised("--max-inflight-per-decode", "1", config=SLOW) as (url, _):
        done: list[int] = []
        thread = stream_in_background(url, done)
        wait_until(lambda: busy(url), 10, "the stream in flight")
        statuses = [fresh(url, "POST", "/v1/completions", json=BODY).status_code for _ in range(8)]
        assert statuses == [429] * 8
        thread.join(30)
        assert done == [200]
        assert fresh(url, "POST", "/v1/completions", json=BODY).status_code == 200


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_the_concurrency_cap_counts_every_process_and_a_release_anywhere_admits() -> None:
    argv = ("--max-concurrent-requests", "1", "--max-queued-requests", "0")
    with supervised(*argv, config=SLOW) as (url, _):
        done: list[int] = []
        thread = stream_in_background(url, done)
        wait_until(lambda: busy(url), 10, "the stream in flight")
        statuses = [fresh(url, "POST", "/v1/completions", json=BODY).status_code for _ in range(8)]
        assert statuses == [429] * 8
        thread.join(30)
    argv = ("--max-concurrent-requests", "1", "--max-queued-requests", "8")
    with supervised(*argv, config=SLOW) as (url, _):
        done = []
        started = time.monotonic()
        threads = [stream_in_background(url, done) for _ in range(4)]
        for thread in threads:
            thread.join(30)
        # one at a time, whichever process queued them: 4 x 1.2 s (two at a time: 2.4 s)
        assert done == [200] * 4
        assert time.monotonic() - started > 4.0
        served = [int(p["requests_served"]) for p in processes_of(url)]  # type: ignore[call-overload]
        assert sum(served) == 4


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_the_worker_queue_waits_for_a_place_any_process_frees() -> None:
    """``--queue-at-worker-caps``: at the host's cap (one decode leg, counted over both
    processes) the requests that reach either process wait instead of 429, and each is served
    once a place frees, whichever process freed it (a process looks for places freed by the
    other's legs every 50 ms): one at a time."""
    argv = ("--max-inflight-per-decode", "1", "--queue-at-worker-caps")
    with supervised(*argv, config=SLOW) as (url, _):
        done: list[int] = []
        started = time.monotonic()
        first = stream_in_background(url, done)
        wait_until(lambda: busy(url), 10, "the stream in flight")
        threads = [first, *(stream_in_background(url, done) for _ in range(3))]
        for thread in threads:
            thread.join(30)
        assert done == [200] * 4  # none refused at the cap
        # one at a time, whichever process took them: 4 x 1.2 s (two at a time: 2.4 s)
        assert time.monotonic() - started > 4.0
