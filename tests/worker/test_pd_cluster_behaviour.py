"""pd-worker clusters behind the real router (SGLang and vLLM Mooncake adapters): equality,
faults, leaks.

Every cluster (``testkit.worker_cluster``) runs in this process on 127.0.0.1: one standalone
registry per prefill (its bootstrap API: SGLang ``/route`` or vLLM ``/register`` + ``/query``),
simulated prefill (one or two DP ranks) and decode workers sharing a ``LoopbackNetwork`` (KV
really moves between their pools), a co-located ``--role both`` worker for the reference output
and the router. Faults are injected through the prefills' ``LoopbackEngine`` knobs; every fault test
checks that the client gets an error JSON in bounded time and that pages and rooms come back.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from testkit.polling import wait_until
from testkit.worker_cluster import SHAPE, TRANSFER_TIMEOUT_S, PDCluster, pd_cluster

MAX_TOKENS = 12


@pytest.fixture(
    scope="module",
    params=[
        (1, 1, "sglang", 1),
        (2, 2, "sglang", 1),
        (1, 1, "sglang", 2),
        (1, 1, "vllm-mooncake", 1),
        (2, 2, "vllm-mooncake", 2),
    ],
    ids=["sglang-1P1D", "sglang-2P2D", "sglang-1P1D-DP2", "vllm-1P1D", "vllm-2P2D-DP2"],
)
def cluster(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    with pd_cluster(*request.param) as c:
        yield c


def _prompts(count: int = 56) -> list[str]:
    """Mixed lengths: page boundaries, tiny and several-thousand-token prompts."""
    rng = random.Random(11)
    fixed = [
        1,
        2,
        3,
        15,
        16,
        17,
        31,
        32,
        33,
        63,
        64,
        65,
        100,
        255,
        256,
        257,
        511,
        512,
        513,
        1000,
        1023,
        1024,
        1025,
        2047,
        2048,
        2049,
        3000,
        4095,
        4096,
        5000,
        6000,
        8000,
    ]
    lengths = fixed + [rng.randint(1, 4000) for _ in range(count - len(fixed))]
    return ["".join(rng.choice("abcdefghij klmnopqrstuvwxyz.") for _ in range(n)) for n in lengths]


def _post(url: str, path: str, body: dict[str, Any], timeout: float = 20.0) -> httpx.Response:
    return httpx.post(
        f"{url}{path}",
        json={"model": "sim-model", "max_tokens": MAX_TOKENS, **body},
        timeout=timeout,
    )


def _ok(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _texts(answer: dict[str, Any]) -> list[str]:
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    return [c["message"]["content"] if "message" in c else c["text"] for c in choices]


def _kv_bytes(tokens: int) -> int:
    pages = -(-tokens // SHAPE.page_size)
    return pages * SHAPE.page_size * SHAPE.bytes_per_token * SHAPE.layers


def _pd_and_reference(
    cluster: PDCluster, path: str, body: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    return _ok(_post(cluster.router, path, body)), _ok(_post(cluster.reference, path, body))


# --- 1. disaggregated == co-located ----------------------------------------------------------


def test_disaggregated_equals_colocated(cluster: PDCluster) -> None:
    prompts = _prompts()

    def one(prompt: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
        return (prompt, *_pd_and_reference(cluster, "/v1/completions", {"prompt": prompt}))

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, prompts))
    for prompt, pd, ref in results:
        assert _texts(pd) == _texts(ref), len(prompt)
        assert len(pd["choices"][0]["text"]) == MAX_TOKENS
        assert pd["usage"]["prompt_tokens"] == len(prompt)
        assert pd["usage"]["kv_bytes_received"] == _kv_bytes(len(prompt))
    assert len({_texts(pd)[0] for _, pd, _ in results}) == len(prompts)  # outputs depend on KV
    for side in cluster.prefills:  # every prefill DP rank did some of the work
        for rank in side.worker.ranks:
            assert rank.sender is not None and rank.sender.stats.rooms_succeeded > 0
    cluster.wait_idle()


def test_batched_completions_equal_colocated(cluster: PDCluster) -> None:
    prompts = [p for p in _prompts(40) if len(p) < 3000][:6]
    if cluster.engine == "vllm-mooncake":  # one transfer_id per request: the router refuses
        refused = _post(cluster.router, "/v1/completions", {"prompt": prompts})
        assert refused.status_code == 400 and "vllm-mooncake" in refused.text, refused.text
        return
    pd, ref = _pd_and_reference(cluster, "/v1/completions", {"prompt": prompts})
    assert len(pd["choices"]) == len(prompts)
    assert _texts(pd) == _texts(ref)
    assert pd["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    assert pd["usage"]["kv_bytes_received"] == sum(_kv_bytes(len(p)) for p in prompts)
    cluster.wait_idle()


def test_chat_with_two_samples_equals_colocated(cluster: PDCluster) -> None:
    n = 2 if cluster.engine == "sglang" else 1  # vLLM: one sequence per transfer_id
    body = {
        "n": n,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello " * 300},
        ],
    }
    pd, ref = _pd_and_reference(cluster, "/v1/chat/completions", body)
    assert len(pd["choices"]) == n
    assert _texts(pd) == _texts(ref)
    cluster.wait_idle()


# --- 2. faults: a clear error in bounded time, everything released ---------------------------


@pytest.fixture(params=["sglang", "vllm-mooncake"])
def small(request: pytest.FixtureRequest) -> Iterator[PDCluster]:
    with pd_cluster(engine=request.param) as c:
        yield c


def _prefill_fields(engine: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """What the router would send a prefill, with no decode ever pulling."""
    if engine == "sglang":
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": room,
        }
    return {
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": f"xfer-{room}",
        }
    }


def _decode_fields(engine: str, bootstrap_port: int, room: int) -> dict[str, Any]:
    """What the router would send a decode for a prefill whose bootstrap API is at the port."""
    if engine == "sglang":
        return {
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bootstrap_port,
            "bootstrap_room": room,
        }
    return {
        "kv_transfer_params": {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap_port}",
            "remote_engine_id": "some-engine",
            "transfer_id": f"x{room}",
        }
    }


def _timed_error(url: str, path: str, body: dict[str, Any], within: float) -> dict[str, Any]:
    started = time.monotonic()
    response = _post(url, path, body, timeout=within + 10.0)
    elapsed = time.monotonic() - started
    assert 500 <= response.status_code < 600, response.text
    assert elapsed < within, f"error after {elapsed:.2f} s"
    error = response.json()["error"]
    assert isinstance(error, dict) and error["message"], error
    return error


def test_engine_write_failure_is_a_5xx(small: PDCluster) -> None:
    small.prefills[0].engine.fail_writes(1, after_entries=1)
    error = _timed_error(small.router, "/v1/completions", {"prompt": "x" * 2000}, within=5.0)
    assert "transfer" in str(error["message"]).lower(), error
    small.wait_idle()
    _ok(_post(small.router, "/v1/completions", {"prompt": "after the fault"}))
    small.wait_idle()


def test_slow_transfer_times_out(small: PDCluster) -> None:
    """A write outliving the transfer deadline: an error near the deadline, pages come back."""
    small.prefills[0].engine.delay_s = TRANSFER_TIMEOUT_S * 1.5
    try:
        _timed_error(
            small.router, "/v1/completions", {"prompt": "y" * 300}, within=TRANSFER_TIMEOUT_S + 3.0
        )
        small.wait_idle(TRANSFER_TIMEOUT_S + 5.0)
    finally:
        small.prefills[0].engine.delay_s = 0.0
    _ok(_post(small.router, "/v1/completions", {"prompt": "after the fault"}))


def test_transfer_info_never_arriving(small: PDCluster) -> None:
    """A prefill request whose decode never sends transfer info ends at the deadline.

    SGLang: the prefill's answer is the error. vLLM: the prefill answers once computed (as vLLM
    does) and holds the KV for the pull until the deadline, then releases it.
    """
    body = {"prompt": "z" * 100, **_prefill_fields(small.engine, small.registries[0], 4242)}
    if small.engine == "sglang":
        error = _timed_error(
            small.worker_urls[0], "/v1/completions", body, within=TRANSFER_TIMEOUT_S + 2.0
        )
        assert "bootstrapping" in str(error["message"]).lower(), error
    else:
        answer = _ok(_post(small.worker_urls[0], "/v1/completions", body, timeout=2.0))
        assert answer["kv_transfer_params"] is None
        assert small.prefills[0].worker.queues["inflight"] == 1  # waiting for the pull
    small.wait_idle(TRANSFER_TIMEOUT_S + 3.0)


def test_registry_lookup_failing_at_the_decode(small: PDCluster) -> None:
    """A decode pointed at a closed bootstrap port: a clear 5xx at once, nothing held."""
    body = {"prompt": "w" * 200, **_decode_fields(small.engine, _closed_port(), 77)}
    error = _timed_error(small.worker_urls[1], "/v1/completions", body, within=3.0)
    assert "transfer failed" in str(error["message"]).lower(), error
    small.wait_idle()


def test_registry_stopped_behind_the_router() -> None:
    """The registry goes away after the router checked it: the client gets a clear 5xx."""
    with pd_cluster(health={"interval_s": 60.0, "failure_threshold": 1000}) as c:
        c.registry_servers[0].close()
        error = _timed_error(
            c.router, "/v1/completions", {"prompt": "v" * 200}, within=TRANSFER_TIMEOUT_S + 3.0
        )
        assert error["message"]
        c.wait_idle(TRANSFER_TIMEOUT_S + 5.0)
        c.registry_servers.clear()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- 3. no leak across many requests ---------------------------------------------------------


@pytest.mark.slow  # ~17 s each: scripts/test-slow (CI runs it)
def test_no_leak_across_200_requests(small: PDCluster) -> None:
    rng = random.Random(5)
    prompts = [_prompts(60)[i % 60][: rng.randint(1, 600)] for i in range(200)]
    statuses: list[int] = []
    with ThreadPoolExecutor(8) as pool:
        for start in range(0, 200, 40):
            if start:  # a burst of failing writes between batches of requests
                small.prefills[0].engine.fail_writes(2, after_entries=rng.choice([0, 1]))
            chunk = prompts[start : start + 40]
            statuses += [r.status_code for r in pool.map(_completion(small.router), chunk)]
            wait_until(
                lambda: small.prefills[0].engine._failures.count == 0,
                5.0,
                "injected failures consumed",
            )
    failures = [s for s in statuses if s != 200]
    assert all(500 <= s < 600 for s in failures), failures
    assert 1 <= len(failures) <= 16, failures
    small.wait_idle()


def _completion(router: str) -> Callable[[str], httpx.Response]:
    def call(prompt: str) -> httpx.Response:
        return _post(router, "/v1/completions", {"prompt": prompt}, timeout=10.0)

    return call


# --- 4. pd-cluster as a process --------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _children(pid: int) -> list[int]:
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True
    ).stdout
    return [int(p) for p, pp in (line.split() for line in out.splitlines()) if int(pp) == pid]


# a glog line (Mooncake's transfer engine logs through glog): "I1126 19:38:21.082234 31721 x.cpp:1]"
_GLOG_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]", re.MULTILINE)
_READY_LINE = re.compile(r"^pd-cluster ready: http://127\.0\.0\.1:\d+ ", re.MULTILINE)
_CURL_LINE = re.compile(r"^  curl http://127\.0\.0\.1:\d+/v1/completions ", re.MULTILINE)
_LOGS_LINE = re.compile(r"^  worker logs: (?P<dir>.+)$", re.MULTILINE)


def _start_pd_cluster(tmp_path: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """pd-cluster with small workers, its console (stdout and stderr) in ``pd-cluster.log`` and
    its temporary files (the default worker log directory) under ``tmp_path``."""
    with (tmp_path / "pd-cluster.log").open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "worker.cluster", "--port", str(port), "--ready-timeout", "12"]
            + [*args, "--", "--pages", "256", "--bytes-per-token", "64"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "TMPDIR": str(tmp_path)},
        )


def _wait_ready(proc: subprocess.Popen[bytes], tmp_path: Path, url: str) -> str:
    """Wait for the router's /ready and pd-cluster's ready lines; the console so far."""
    console = tmp_path / "pd-cluster.log"

    def ready() -> bool:
        assert proc.poll() is None, console.read_text()
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        return False

    wait_until(ready, 12.0, "pd-cluster ready")
    wait_until(lambda: _CURL_LINE.search(console.read_text()) is not None, 5.0, "its ready lines")
    return console.read_text()


def _stop(proc: subprocess.Popen[bytes], children: list[int]) -> None:
    """Kill pd-cluster and its children (each in its own session), also those it started before
    the test failed without collecting them."""
    if proc.poll() is None:
        children = children or _children(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


def _assert_quiet_start(console: str) -> None:
    """The ready line and the curl, and neither Mooncake's native log lines (the workers' are in
    their log files) nor the router's 'load unknown' lines for workers still starting."""
    assert _READY_LINE.search(console) and _CURL_LINE.search(console), console
    assert not _GLOG_LINE.search(console) and "InitGoogleLogging" not in console, console
    assert "is unknown" not in console, console


@pytest.mark.parametrize(("engine", "dp"), [("sglang", 1), ("vllm-mooncake", 2)])
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_pd_cluster_process_smoke(tmp_path: Path, engine: str, dp: int) -> None:
    port = _closed_port()
    proc = _start_pd_cluster(
        tmp_path, port, "--prefill", "1", "--decode", "1", "--engine", engine, "--dp", str(dp)
    )
    children: list[int] = []
    try:
        url = f"http://127.0.0.1:{port}"
        console = _wait_ready(proc, tmp_path, url)
        children = _children(proc.pid)
        assert len(children) == 3, children  # router, prefill, decode
        status = httpx.get(f"{url}/ready").json()
        assert status["prefill"][0]["dp_size"] == dp
        for _ in range(2 * dp):  # the router spreads requests over the DP ranks
            response = _post(url, "/v1/completions", {"prompt": "hello"})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["kv_bytes_received"] > 0
        _assert_quiet_start((tmp_path / "pd-cluster.log").read_text())
        match = _LOGS_LINE.search(console)
        assert match is not None
        logs = Path(match["dir"])
        assert logs.parent == tmp_path  # a new temporary directory by default
        for worker in ("prefill-0", "decode-0"):  # the native lines went to the workers' logs
            assert _GLOG_LINE.search((logs / f"{worker}.log").read_text()), worker
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        wait_until(lambda: not any(_alive(pid) for pid in children), 5.0, "children gone")
        assert not logs.exists()  # a clean stop leaves no temporary log directory behind
    finally:
        _stop(proc, children)


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_a_dying_worker_says_where_its_log_is(tmp_path: Path) -> None:
    port = _closed_port()
    proc = _start_pd_cluster(tmp_path, port, "--log-dir", str(tmp_path / "logs"))
    children: list[int] = []
    try:
        _wait_ready(proc, tmp_path, f"http://127.0.0.1:{port}")
        children = _children(proc.pid)
        decode = next(
            pid
            for pid in children
            if b"--role\x00decode\x00" in Path(f"/proc/{pid}/cmdline").read_bytes()
        )
        os.killpg(decode, signal.SIGKILL)
        proc.wait(15)  # a worker exiting stops the cluster
        console = (tmp_path / "pd-cluster.log").read_text()
        log = tmp_path / "logs" / "decode-0.log"
        assert f"pd-cluster: decode-0 exited with -9; its log: {log}" in console, console
        assert log.is_file()
    finally:
        _stop(proc, children)
