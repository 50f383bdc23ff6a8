"""Real processes, real SIGKILL: a worker dying mid-transfer ends in a clear client error.

Each test starts, as ``pd-cluster`` does, the router (its embedded registry serving namespace
``p0`` on a bootstrap port), one prefill registering there and one decode, speaking SGLang's or
vLLM MooncakeConnector's protocol, each a ``python -m``
child on 127.0.0.1 with the real Mooncake engine (TCP over loopback). The prefill simulates
compute (``--compute-s-per-token``) in chunks of ``CHUNK_TOKENS``, so a ``PROMPT_TOKENS``-token
prompt keeps its room open for ~2.5 s after the decode has asked the prefill for the KV. The
victim is SIGKILLed in that window, once the decode's ``/health`` reports the room open and the
prefill's reports the request in its forward pass (``queues.forward``):

- SGLang sends each chunk's pages right after computing it, so the kill waits until the prefill's
  ``kv_bytes_sent`` has grown as well: the first chunks' pages are in decode memory, the rest are
  still to be written. That is a kill in the middle of the transfer.
- vLLM's MooncakeConnector writes the whole prompt's KV in one go after the forward pass (a few
  milliseconds for this prompt), so there the kill lands after the decode's TransferInfo arrived
  and before the write: the rendezvous is done, the destination pages are reserved.

Checked: the client gets an OpenAI error naming the dead worker (a 5xx JSON, or a final SSE
``error`` event once the stream started) within ``ERROR_WITHIN_S``; the survivor ends with every
page free, none quarantined and no open room; the router notices the death (``/ready`` 503) and,
once the victim is restarted with the same command, serves the next request; nothing is left
in flight at the router.

Why no quarantine is expected: a decode whose prefill died releases the room's pages (the
prefill's control connection dropped, so its process and its writes are gone: ``transfer.receiver``
module notes), and a prefill's own pages are its source, never a destination.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest

from testkit.polling import wait_until
from testkit.servers import free_port

PAGES = 256
PAGE_SIZE = 16
TRANSFER_TIMEOUT_S = 5.0
COMPUTE_S_PER_TOKEN = 0.0125
PROMPT_TOKENS = 200  # one token per byte
CHUNK_TOKENS = 32  # seven chunks, ~0.4 s of compute each
COMPUTE_S = PROMPT_TOKENS * COMPUTE_S_PER_TOKEN  # 2.5 s: the window the kill lands in
ERROR_WITHIN_S = TRANSFER_TIMEOUT_S + 5.0  # the decode's deadline, its 2 s drain, slack
# A prefill whose decode died fails the room at once (its control connection dropped) but its
# forward pass runs to the end before the pages come back; the sender's transfer deadline bounds
# the rest should the loss go unnoticed.
RELEASED_WITHIN_S = COMPUTE_S + TRANSFER_TIMEOUT_S + 3.0
START_TIMEOUT_S = 20.0
CLIENT_TIMEOUT_S = 25.0
MAX_TOKENS = 8

Role = Literal["prefill", "decode"]


# --- child processes ---------------------------------------------------------------------------


@dataclass
class Child:
    """One ``python -m`` child whose stdout and stderr go to ``log`` (appended over restarts)."""

    name: str
    argv: list[str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        assert self.process is None or self.process.poll() is not None, f"{self.name} running"
        with self.log.open("ab") as out:
            out.write(f"--- start {self.name} at {time.monotonic():.3f}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                [sys.executable, "-m", *self.argv], stdout=out, stderr=subprocess.STDOUT
            )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL, then reap."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(10)

    def terminate(self) -> None:
        if self.alive():
            assert self.process is not None
            self.process.terminate()

    def reap(self, timeout: float) -> None:
        """Wait for the exit (SIGKILL after ``timeout``); never leaves an orphan."""
        if self.process is None:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"==== {self.name} ({self.log}) ====\n" + "\n".join(text.splitlines()[-lines:])


@dataclass
class KillCluster:
    """The router, one prefill and one decode as separate processes."""

    router_url: str
    urls: dict[Role, str]
    router: Child
    workers: dict[Role, Child]

    @property
    def children(self) -> list[Child]:
        return [self.router, *self.workers.values()]

    def logs(self) -> str:
        return "\n".join(child.tail() for child in self.children)

    def health(self, role: Role) -> dict[str, Any]:
        body: dict[str, Any] = httpx.get(f"{self.urls[role]}/health", timeout=2).json()
        return body

    def ready_status(self) -> int:
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.router_url}/ready", timeout=2).status_code
        return 0

    def wait(self, predicate: Callable[[], object], timeout: float, what: str) -> None:
        """``wait_until`` that fails with every child's log tail and notices dead children."""

        def check() -> bool:
            for child in self.children:
                if child.process is not None and child.process.poll() is not None:
                    expected = child in self.workers.values() and child.process.returncode == -9
                    assert expected, f"{child.name} exited ({child.process.returncode})"
            return bool(predicate())

        try:
            wait_until(check, timeout, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.logs()}") from None

    def wait_ready(self) -> None:
        self.wait(lambda: self.ready_status() == 200, START_TIMEOUT_S, "router /ready 200")

    def wait_router_idle(self, timeout: float) -> None:
        """The router's in-flight counters (its load guards) are all back to zero."""

        def idle() -> bool:
            body = httpx.get(f"{self.router_url}/ready", timeout=2).json()
            return all(w["inflight"] == 0 for w in body["prefill"] + body["decode"])

        self.wait(idle, timeout, "router in-flight counters at zero")

    def wait_idle(self, role: Role, timeout: float) -> None:
        """``role``'s pool is whole again: every page free, none quarantined, no open room."""
        last: dict[str, Any] = {}

        def idle() -> bool:
            last.update(self.health(role))
            return (last["free_pages"], last["quarantined_pages"], last["open_rooms"]) == (
                PAGES,
                0,
                0,
            )

        try:
            self.wait(idle, timeout, f"{role} idle")
        except AssertionError as exc:
            raise AssertionError(f"{role} /health: {last}\n{exc}") from None


def _worker_argv(
    role: Role, port: int, ns_port: int, engine: str, decode_s_per_token: float
) -> list[str]:
    argv = (
        f"worker --role {role} --port {port} --engine mooncake --layers 2 --pages {PAGES} "
        f"--page-size {PAGE_SIZE} --bytes-per-token 256 --transfer-timeout {TRANSFER_TIMEOUT_S} "
        f"--decode-s-per-token {decode_s_per_token} --log-level info"
    ).split()
    if role == "prefill":
        argv += (
            f"--registry 127.0.0.1:{ns_port} --compute-s-per-token {COMPUTE_S_PER_TOKEN} "
            f"--chunk-tokens {CHUNK_TOKENS} --protocol {engine}".split()
        )
    return argv


def _router_argv(port: int, ns_port: int, prefill: str, decode: str, engine: str) -> list[str]:
    """What ``pd-cluster`` runs (``worker.cluster._router_args``), with fast health probes."""
    return (
        f"router --engine {engine} --host 127.0.0.1 --port {port} --advertise-host 127.0.0.1 "
        f"--bootstrap-namespace p0={ns_port} --prefill {prefill} ns:p0 --decode {decode} "
        "--health-interval 0.2 --health-timeout 1 --log-level info"
    ).split()


@pytest.fixture
def decode_s_per_token() -> float:
    """The decode's simulated step (seconds between streamed tokens); 0: all at once."""
    return 0.0


@pytest.fixture
def cluster(tmp_path: Path, engine: str, decode_s_per_token: float) -> Iterator[KillCluster]:
    port, ns_port = free_port(), free_port()
    ports: dict[Role, int] = {"prefill": free_port(), "decode": free_port()}
    urls: dict[Role, str] = {role: f"http://127.0.0.1:{p}" for role, p in ports.items()}
    router = Child(
        "router",
        _router_argv(port, ns_port, urls["prefill"], urls["decode"], engine),
        tmp_path / "router.log",
    )
    workers = {
        role: Child(
            role,
            _worker_argv(role, ports[role], ns_port, engine, decode_s_per_token),
            tmp_path / f"{role}.log",
        )
        for role in ports
    }
    c = KillCluster(f"http://127.0.0.1:{port}", urls, router, workers)
    try:
        router.start()
        c.wait(lambda: _answers(f"{c.router_url}/health"), START_TIMEOUT_S, "router up")
        for child in workers.values():
            child.start()
        c.wait_ready()
        yield c
    finally:
        for child in c.children:
            child.terminate()
        for child in c.children:
            child.reap(timeout=5)
        print(c.logs())  # shown by pytest only when the test failed


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=1).status_code == 200
    return False


# --- client ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    status: int
    content_type: str
    body: bytes
    elapsed_s: float

    def events(self) -> list[dict[str, Any]]:
        """The JSON ``data:`` events of an SSE body (``[DONE]`` left out)."""
        lines = self.body.decode(errors="replace").splitlines()
        payloads = [line[5:].strip() for line in lines if line.startswith("data:")]
        return [json.loads(p) for p in payloads if p and p != "[DONE]"]

    def text(self) -> str:
        if self.content_type.startswith("text/event-stream"):
            return "".join(c.get("text", "") for e in self.events() for c in e.get("choices", []))
        return "".join(c["text"] for c in json.loads(self.body)["choices"])


def _complete(url: str, prompt: str, stream: bool) -> Outcome:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": stream}
    started = time.monotonic()
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT_S) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as response,
    ):
        content = response.read()
    return Outcome(
        response.status_code,
        response.headers.get("content-type", ""),
        content,
        time.monotonic() - started,
    )


def _error_of(outcome: Outcome) -> dict[str, Any]:
    """The OpenAI error object: a 5xx JSON, or a stream's final ``data:`` event."""
    described = f"HTTP {outcome.status} {outcome.content_type}: {outcome.body[-600:]!r}"
    if outcome.status >= 500:
        assert outcome.content_type.startswith("application/json"), described
        error = json.loads(outcome.body)["error"]
        assert error.get("code") == outcome.status, described
    else:
        assert outcome.status == 200, described
        assert outcome.content_type.startswith("text/event-stream"), described
        events = outcome.events()
        assert events and "error" in events[-1], described
        error = events[-1]["error"]
    assert isinstance(error, dict) and error.get("message"), described
    return error


def _ok(outcome: Outcome) -> str:
    assert outcome.status == 200, outcome.body[-600:]
    text = outcome.text()
    assert len(text) == MAX_TOKENS, outcome.body[-600:]
    return text


# --- the tests ---------------------------------------------------------------------------------


def _in_transfer(c: KillCluster, sent_before: int | None) -> bool:
    """The decode waits for the room's KV; the prefill has its TransferInfo and computes (and,
    unless ``sent_before`` is None, has written more KV bytes than ``sent_before``)."""
    prefill = c.health("prefill")
    queues: dict[str, int] = prefill.get("queues", {})
    return (
        c.health("decode")["open_rooms"] >= 1
        and queues.get("forward", 0) >= 1
        and (sent_before is None or prefill["kv_bytes_sent"] > sent_before)
    )


def _kill_mid_transfer(c: KillCluster, engine: str, victim: Role, stream: bool) -> Outcome:
    """Start a long-prefill request, SIGKILL ``victim`` once the room is mid-transfer."""
    sent_before = c.health("prefill")["kv_bytes_sent"] if engine == "sglang" else None
    with ThreadPoolExecutor(1) as pool:
        future: Future[Outcome] = pool.submit(_complete, c.router_url, "k" * PROMPT_TOKENS, stream)
        what = "decode room open, prefill in its forward pass" + (
            " and its first chunks written" if sent_before is not None else ""
        )
        c.wait(lambda: future.done() or _in_transfer(c, sent_before), COMPUTE_S, what)
        assert not future.done(), f"finished before the kill: {future.result()}"
        c.workers[victim].kill()
        try:
            return future.result(timeout=CLIENT_TIMEOUT_S + 5)
        except httpx.TransportError as exc:  # a hang or a dropped connection, not an answer
            raise AssertionError(f"no answer from the router: {exc!r}\n{c.logs()}") from exc


@pytest.mark.parametrize(
    ("engine", "victim", "stream"),
    [
        ("sglang", "prefill", False),
        ("sglang", "prefill", True),
        ("sglang", "decode", False),
        ("sglang", "decode", True),
        ("vllm-mooncake", "prefill", True),
        ("vllm-mooncake", "decode", False),
    ],
    ids=lambda value: {False: "whole", True: "stream"}.get(value, value),
)
def test_kill_mid_transfer(cluster: KillCluster, engine: str, victim: Role, stream: bool) -> None:
    survivor: Role = "decode" if victim == "prefill" else "prefill"
    _ok(_complete(cluster.router_url, "warm up " * 2, stream))  # connections and registration
    cluster.wait_idle(survivor, 2.0)

    outcome = _kill_mid_transfer(cluster, engine, victim, stream)
    error = _error_of(outcome)
    assert outcome.elapsed_s < ERROR_WITHIN_S, f"error after {outcome.elapsed_s:.2f}s: {error}"
    # names the dead side: the router's error for the broken leg or, should the decode's answer
    # win the race after a prefill death, the decode's "lost connection to prefill rank ..."
    assert victim in error["message"], error
    _recovers(cluster, victim, stream)


def _recovers(cluster: KillCluster, victim: Role, stream: bool) -> str:
    """The survivor's pages come back; the router notices the death; once ``victim`` is
    restarted with the same command a request succeeds (its text returned) and nothing is left
    in flight anywhere."""
    survivor: Role = "decode" if victim == "prefill" else "prefill"
    cluster.wait_idle(survivor, RELEASED_WITHIN_S)
    cluster.wait(lambda: cluster.ready_status() == 503, 5.0, "router sees the dead worker")

    cluster.workers[victim].start()  # the same command on the same port
    cluster.wait_ready()
    text = _ok(_complete(cluster.router_url, "after the restart", stream))
    for role in ("prefill", "decode"):
        cluster.wait_idle(role, 5.0)
    cluster.wait_router_idle(5.0)
    return text


DECODE_STEP_S = 0.25  # MAX_TOKENS tokens stream for ~1.75 s


@pytest.mark.parametrize("decode_s_per_token", [DECODE_STEP_S])
@pytest.mark.parametrize("engine", ["sglang", "vllm-mooncake"])
@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_decode_killed_mid_stream(cluster: KillCluster, engine: str) -> None:
    """The client has tokens already when the decode dies: its stream ends at once with a final
    SSE error event (the router can no longer answer with a status), and what it got before is
    a prefix of the answer the restarted cluster gives."""
    _ok(_complete(cluster.router_url, "warm up " * 2, True))
    body = {
        "model": "sim-model",
        "prompt": "after the restart",
        "max_tokens": MAX_TOKENS,
        "stream": True,
    }
    received: list[str] = []
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT_S) as client,
        client.stream("POST", f"{cluster.router_url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200, response.read()
        killed_at = 0.0
        for line in response.iter_lines():
            received.append(line)
            if line.startswith("data:") and not killed_at:
                cluster.workers["decode"].kill()
                killed_at = time.monotonic()
        ended_after_s = time.monotonic() - killed_at
    outcome = Outcome(200, "text/event-stream", "\n".join(received).encode(), ended_after_s)
    error = _error_of(outcome)
    assert "decode" in error["message"], error
    assert ended_after_s < 2.0, f"the stream ended {ended_after_s:.2f}s after the kill"
    partial = "".join(c.get("text", "") for e in outcome.events()[:-1] for c in e["choices"])
    assert 0 < len(partial) < MAX_TOKENS, received

    full = _recovers(cluster, "decode", stream=True)
    assert full.startswith(partial), (partial, full)
