"""The simulated prefill's lifecycle (``worker.prefill``), chunked prefill, DP ranks and the
protocol edge cases of ``worker.protocol``, through the real router where a client would be.

The lifecycle is observable in the prefill's ``GET /health`` (``queues``): a request waiting for
its decode sits in ``bootstrap`` without taking forward time; the forward pass runs one chunk at a
time; the last chunk waits in ``inflight`` for Success.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from testkit.polling import wait_until
from testkit.worker_cluster import SHAPE, PDCluster, pd_cluster

COMPUTE_S_PER_TOKEN = 0.001
CHUNK_TOKENS = 64
TIMEOUT_S = 3.0  # above the longest forward queue here (3 x 0.4 s)


@pytest.fixture(scope="module")
def slow() -> Iterator[PDCluster]:
    """1P1D SGLang with a prefill computing 1 ms per token in chunks of 64 tokens."""
    options = {"compute_s_per_token": COMPUTE_S_PER_TOKEN, "chunk_tokens": CHUNK_TOKENS}
    with pd_cluster(prefill_options=options, transfer_timeout_s=TIMEOUT_S) as c:
        yield c


def _post(
    url: str, body: dict[str, Any], *, headers: dict[str, str] | None = None, timeout: float = 20.0
) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": "sim-model", "max_tokens": 8, **body},
        headers=headers,
        timeout=timeout,
    )


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def _queues(cluster: PDCluster) -> dict[str, int]:
    health = httpx.get(f"{cluster.worker_urls[0]}/health", timeout=2).json()
    queues: dict[str, int] = health["queues"]
    return queues


def _text(answer: dict[str, Any]) -> str:
    text: str = answer["choices"][0]["text"]
    return text


class _Watcher:
    """Polls the prefill's queues in a thread and keeps the maximum of each."""

    def __init__(self, cluster: PDCluster) -> None:
        self._cluster = cluster
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watcher:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            for stage, count in _queues(self._cluster).items():
                self.peak[stage] = max(self.peak.get(stage, 0), count)


def test_the_forward_pass_runs_one_chunk_at_a_time(slow: PDCluster) -> None:
    prompts = [chr(ord("a") + i) * 400 for i in range(3)]  # 7 chunks of <= 64 tokens each
    with _Watcher(slow) as watcher, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(lambda p: _ok(_post(slow.router, {"prompt": p})), prompts))
    assert watcher.peak["forward"] == 1  # never two forward passes at once
    assert watcher.peak["waiting"] >= 1  # the others queued behind it
    for prompt, answer in zip(prompts, answers, strict=True):
        assert _text(answer) == _text(_ok(_post(slow.reference, {"prompt": prompt})))
    slow.wait_idle()
    assert _queues(slow) == {"bootstrap": 0, "waiting": 0, "forward": 0, "inflight": 0}


def test_chunked_prefill_sends_kv_chunk_by_chunk(slow: PDCluster) -> None:
    prompt = "chunked prefill " * 63  # 1008 tokens: 16 chunks, the last one partial
    engine = slow.prefills[0].engine
    writes_before = len(engine.stats.batch_sizes)
    answer = _ok(_post(slow.router, {"prompt": prompt}))
    assert _text(answer) == _text(_ok(_post(slow.reference, {"prompt": prompt})))
    pages = -(-len(prompt) // SHAPE.page_size)
    assert answer["usage"]["kv_bytes_received"] == pages * SHAPE.page_size * (
        SHAPE.bytes_per_token * SHAPE.layers
    )
    # one engine call per chunk: 64-token chunks are 4 whole pages each
    assert len(engine.stats.batch_sizes) - writes_before == -(-len(prompt) // CHUNK_TOKENS)
    slow.wait_idle()


def test_a_request_waiting_for_its_decode_takes_no_forward_time(slow: PDCluster) -> None:
    """SGLang's bootstrap queue: no transfer info yet, no forward pass; others go first."""
    orphan = {
        "prompt": "o" * 300,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": slow.registries[0],
        "bootstrap_room": 987654321,
    }
    with ThreadPoolExecutor(1) as pool:
        stuck = pool.submit(_post, slow.worker_urls[0], orphan)
        wait_until(lambda: _queues(slow)["bootstrap"] == 1, 5.0, "the orphan in bootstrap")
        started = time.monotonic()
        answer = _ok(_post(slow.router, {"prompt": "served while the orphan waits"}))
        assert time.monotonic() - started < 1.5  # not queued behind the orphan's 0.3 s
        assert answer["usage"]["kv_bytes_received"] > 0
        assert _queues(slow)["bootstrap"] == 1
        failed = stuck.result(timeout=TIMEOUT_S + 5.0)
    assert failed.status_code == 500 and "bootstrapping" in failed.text.lower(), failed.text
    slow.wait_idle()


def test_sglang_dp_rank_must_follow_the_room() -> None:
    with pd_cluster(dp=2) as cluster:
        body = {
            "prompt": "dp",
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": cluster.registries[0],
            "bootstrap_room": 3,
            "routed_dp_rank": 0,
        }
        refused = _post(cluster.worker_urls[0], body)
        assert refused.status_code == 400 and "follow_bootstrap_room" in refused.text
        outside = _post(cluster.worker_urls[0], {**body, "routed_dp_rank": 2})
        assert outside.status_code == 400 and "DP rank 2" in outside.text
        cluster.wait_idle()


def test_vllm_prefill_rejects_a_dp_rank_it_does_not_have() -> None:
    with pd_cluster(engine="vllm-mooncake") as cluster:
        body = {
            "prompt": "dp",
            "kv_transfer_params": {"do_remote_decode": True, "transfer_id": "xfer-dp"},
        }
        refused = _post(cluster.worker_urls[0], body, headers={"X-data-parallel-rank": "1"})
        assert refused.status_code == 400 and "DP rank 1" in refused.text
        missing = _post(
            cluster.worker_urls[0],
            {"prompt": "dp", "kv_transfer_params": {"do_remote_decode": True}},
        )
        assert missing.status_code == 400 and "Missing transfer_id" in missing.text
        # a decode given incomplete params prefills locally, as vLLM does
        local = _ok(
            _post(
                cluster.worker_urls[1],
                {
                    "prompt": "local",
                    "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": "xfer-local"},
                },
            )
        )
        assert local["usage"]["kv_bytes_received"] == 0
        assert _text(local) == _text(_ok(_post(cluster.reference, {"prompt": "local"})))
        cluster.wait_idle()
