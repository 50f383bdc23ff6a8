"""Launch and stop real SGLang 0.5.23 engines on this CPU machine, and pd-router in front of them.

The engines run from ``.venv-sglang`` (``scripts/setup-sglang.sh``) with
``tests/real_engines/sglang_stubs`` first on their ``PYTHONPATH`` (the ``sgl_kernel`` and
``torchvision`` stand-ins and the ``sitecustomize`` CPU-PD workarounds; see that directory and
``docs/real-engines.md`` section 4). Each engine runs in its own process group (SGLang forks a
scheduler and a detokenizer), logs to a file, and is killed as a group; the ``/dev/shm`` files
its processes leave behind are removed afterwards.

The router runs as ``.venv/bin/python -m router --engine sglang ...``, exactly as deployed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import httpx

from testkit.servers import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENV = REPO / ".venv-sglang"
ENGINE_PYTHON = ENGINE_VENV / "bin" / "python"
STUBS_DIR = Path(__file__).resolve().parent / "sglang_stubs"
MODEL_NAME = "m"
START_TIMEOUT_S = 240.0  # 19-30 s alone; three at once on 2 shared cores take longer
STOP_GRACE_S = 10.0
SHM_DIR = Path("/dev/shm")
# /dev/shm families an SGLang engine creates: load snapshots, its own pid-stamped segments,
# multi-tokenizer args, Python multiprocessing semaphores, torch's shared tensors.
SHM_PREFIXES = ("sglang_loads_", "sgl_shm_", "multi_tokenizer_args_", "sem.mp-", "psm_")

Role = Literal["prefill", "decode", "colocated"]


def engine_argv(model_dir: Path, role: Role, port: int, bootstrap_port: int | None) -> list[str]:
    """The launch command; PD flags only for prefill/decode (``colocated`` is the reference)."""
    argv = [
        str(ENGINE_PYTHON), "-m", "sglang.launch_server",
        "--model-path", str(model_dir), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native", "--dtype", "bfloat16",
        "--max-total-tokens", "4096", "--max-running-requests", "4", "--random-seed", "0",
        # without it every idle scheduler spins a core (PD latency 0.08 s -> up to 1.9 s here)
        "--sleep-on-idle",
        "--enable-metrics",
    ]  # fmt: skip
    if role != "colocated":
        assert bootstrap_port is not None
        argv += [
            "--disaggregation-mode", role,
            "--disaggregation-transfer-backend", "mooncake_tcp",
            "--disaggregation-bootstrap-port", str(bootstrap_port),
        ]  # fmt: skip
    if role == "decode":
        # the default retraction backup pool pins host memory with cudaHostRegister
        argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
    return argv


def engine_env(role: Role) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)  # the test process's path (the project) is not the engine's
    env.update(
        PYTHONPATH=str(STUBS_DIR),
        SGLANG_USE_CPU_ENGINE="1",  # --device cpu alone still imports vLLM's CUDA ops
        SGLANG_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    if role == "prefill":
        # the early send of radix-cache-hit prefixes records a torch.cuda.Event
        env["SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX"] = "0"
    return env


@dataclass
class Engine:
    """One SGLang server process group."""

    role: Role
    port: int
    bootstrap_port: int | None
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no log: {exc}>"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal_group(self, sig: signal.Signals) -> None:
        """Signal the whole process group (server, scheduler, detokenizer)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)

    def describe(self) -> str:
        state = "running" if self.alive() else f"exited {self.process.returncode}"
        return (
            f"--- SGLang {self.role} {self.url} ({state}), {self.log_path} ---\n{self.log_tail()}"
        )


def launch(model_dir: Path, role: Role, log_dir: Path) -> Engine:
    port = free_port()
    bootstrap_port = free_port() if role != "colocated" else None
    log_path = log_dir / f"sglang-{role}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            engine_argv(model_dir, role, port, bootstrap_port),
            env=engine_env(role),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killed as one
            cwd=log_dir,
        )
    return Engine(role, port, bootstrap_port, log_path, process)


def _healthy(engine: Engine) -> bool:
    try:
        return httpx.get(engine.url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(engines: Sequence[Engine], timeout: float = START_TIMEOUT_S) -> None:
    """Poll every engine's ``/health`` (503 until SGLang's own warm-up request is done)."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if not engine.alive():
                raise RuntimeError(f"SGLang {engine.role} exited at start\n{engine.describe()}")
            if _healthy(engine):
                pending.remove(engine)
        if pending and time.monotonic() > deadline:
            tails = "\n".join(engine.describe() for engine in pending)
            raise TimeoutError(f"SGLang not healthy after {timeout}s\n{tails}")
        if pending:
            time.sleep(0.5)


def stop(engine: Engine) -> None:
    """SIGTERM the group, SIGKILL it if the server has not exited within STOP_GRACE_S."""
    if engine.alive():
        engine.signal_group(signal.SIGCONT)  # a SIGSTOPped group cannot act on SIGTERM
        engine.signal_group(signal.SIGTERM)
        try:
            engine.process.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    engine.signal_group(signal.SIGKILL)  # the scheduler/detokenizer children too
    with contextlib.suppress(subprocess.TimeoutExpired):
        engine.process.wait(timeout=STOP_GRACE_S)
    deadline = time.monotonic() + STOP_GRACE_S
    while _group_members(engine.process.pid) and time.monotonic() < deadline:
        time.sleep(0.1)  # until the children are gone too (their /dev/shm maps with them)


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group ``pgid``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == pgid:
                members.append(int(stat.parent.name))
    return members


def _shm_in_use() -> set[str]:
    """/dev/shm names any live process has open or mapped (another suite's engines included)."""
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    used.add(line.rsplit("/dev/shm/", 1)[1].split(" ")[0])
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        used.add(target.removeprefix("/dev/shm/").split(" ")[0])
    return used


def shm_snapshot() -> set[str]:
    return {path.name for path in SHM_DIR.iterdir()} if SHM_DIR.is_dir() else set()


def clean_shm(before: set[str]) -> list[str]:
    """Remove SGLang-family /dev/shm files that appeared since ``before`` and that no live
    process uses (killed engines skip their own unlinking); return the removed names."""
    removed = []
    in_use = _shm_in_use()
    for name in sorted(shm_snapshot() - before - in_use):
        if name.startswith(SHM_PREFIXES):
            with contextlib.suppress(OSError):
                (SHM_DIR / name).unlink()
                removed.append(name)
    return removed


@contextlib.contextmanager
def sglang_engines(
    model_dir: Path, roles: Sequence[Role], log_dir: Path, timeout: float = START_TIMEOUT_S
) -> Iterator[list[Engine]]:
    """Start the engines in parallel, yield them once all are healthy, stop them afterwards."""
    if not ENGINE_PYTHON.exists():
        raise RuntimeError(f"{ENGINE_PYTHON} missing: run scripts/setup-sglang.sh")
    log_dir.mkdir(parents=True, exist_ok=True)
    before = shm_snapshot()
    engines: list[Engine] = []
    try:
        for role in roles:
            engines.append(launch(model_dir, role, log_dir))
        wait_healthy(engines, timeout)
        yield engines
    finally:
        with ThreadPoolExecutor(max_workers=max(1, len(engines))) as pool:
            list(pool.map(stop, engines))
        clean_shm(before)


# --- metrics -------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> ``{name: sum over all label sets}`` plus ``{name{labels}: value}``."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            number = float(value)
            values[sample] = number
            name = sample.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + number if name != sample else number
    return values


def scrape(engine: Engine) -> dict[str, float]:
    response = httpx.get(engine.url + "/metrics", timeout=10)
    response.raise_for_status()
    return parse_metrics(response.text)


def labelled(metrics: Mapping[str, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include all of ``labels``."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(
        value
        for sample, value in metrics.items()
        if sample.startswith(name + "{") and all(w in sample for w in wanted)
    )


# What is 0 on an idle engine: running and waiting requests, and every PD queue.
LOAD_FIELDS = ("num_running_reqs", "num_waiting_reqs")
PD_QUEUE_FIELDS = (
    "prefill_bootstrap_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
)


def busy(engine: Engine) -> dict[str, float]:
    """The non-zero load counts of ``engine`` (empty when idle).

    From ``GET /v1/loads``, which asks the scheduler for a snapshot of its queues, not from the
    ``/metrics`` gauges: those are refreshed on SGLang's stats-log interval (every 40 decode
    steps, or when idle), so they can read 0 while a stream is running, or lag behind an abort.
    """
    response = httpx.get(engine.url + "/v1/loads", params={"include": "core,disagg"}, timeout=10)
    response.raise_for_status()
    counts: dict[str, float] = {}
    for load in response.json()["loads"]:
        rank = load.get("dp_rank", 0)
        pd_queues = load.get("disaggregation") or {}
        for name, value in [
            *((key, load.get(key)) for key in LOAD_FIELDS),
            *((key, pd_queues.get(key)) for key in PD_QUEUE_FIELDS),
        ]:
            if value:
                counts[f"{name}[{rank}]"] = float(value)
    return counts


def wait_idle(engines: Sequence[Engine], timeout: float, hold_s: float = 1.5) -> float:
    """Poll until no engine has a running, waiting or PD-queued request, and that stays so for
    ``hold_s`` (a ``/v1/loads`` snapshot can be ~0.5 s old); return the seconds until idle
    began. Fails naming the engines still busy and what they hold."""
    start = time.monotonic()
    deadline = start + timeout
    idle_since: float | None = None
    while True:
        now = time.monotonic()
        state = {engine.role: busy(engine) for engine in engines}
        if any(state.values()):
            idle_since = None
        else:
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= hold_s:
                return idle_since - start
        if now > deadline:
            raise AssertionError(f"engines not idle after {timeout}s: {state}")
        time.sleep(0.2)


# --- the router ----------------------------------------------------------------------------


@dataclass
class Router:
    port: int
    log_path: Path
    process: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def router_argv(prefill: Engine, decode: Engine, port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable, "-m", "router", "--engine", "sglang",
        "--prefill", prefill.url, str(prefill.bootstrap_port),
        "--decode", decode.url,
        "--port", str(port), "--log-level", "info",
        *extra,
    ]  # fmt: skip


@contextlib.contextmanager
def router_process(
    prefill: Engine,
    decode: Engine,
    log_dir: Path,
    extra: Sequence[str] = (),
    timeout: float = 30.0,
) -> Iterator[Router]:
    """Start the router; yield it once ``/ready`` says both engines are healthy."""
    port = free_port()
    argv = router_argv(prefill, decode, port, extra)
    log_path = log_dir / f"router-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
        )
    router = Router(port, log_path, process, argv)
    try:
        deadline = time.monotonic() + timeout
        while not _ready(router):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router not ready ({argv})\n{router.log_tail()}")
            time.sleep(0.1)
        yield router
    finally:
        stop_process(process)


def _ready(router: Router) -> bool:
    try:
        return httpx.get(router.url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def retry(what: str, attempts: int, call: Callable[[], bool], pause_s: float = 1.0) -> int:
    """Call until it returns True (bounded); return the attempts used."""
    for attempt in range(1, attempts + 1):
        if call():
            return attempt
        time.sleep(pause_s)
    raise AssertionError(f"{what}: no success in {attempts} attempts")
