"""Several load generators (``bench.load.loadgen``, one process each) that start their measured
phase together, so that their completed requests add up over one common window.

Each member (``python -m bench.load.loadgen_group``) first sends its warmup (its own bounded
run, not counted), prints ``warm`` and waits for a ``go`` line on stdin; then it runs the
closed loop with no further warmup and prints a ``Share``: its ``LoadResult`` and when its
measured phase began and ended (``time.monotonic()``, one clock for every process of the
machine). ``Group`` starts the members, waits until all are warm, lets the caller take its
measurements, says ``go`` to all at once and collects their shares.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import msgspec
import uvloop

from bench.common.process import LOOPBACK, REPO_ROOT, BenchError, set_parent_death_signal
from bench.load.loadgen import LoadResult, completion_body, run_load

__all__ = ["Group", "GroupSpec", "Share", "main", "split"]

MODEL = "fake-model"
WARM_MAX_S = 30.0  # the warmup run's own bound in time (it is bounded in requests too)
WARM_LINE, GO_LINE = b"warm\n", b"go\n"


class Share(msgspec.Struct, frozen=True):
    """One member's measured phase."""

    load: LoadResult
    started: float  # time.monotonic() when its measured phase began
    ended: float


@dataclass(frozen=True)
class GroupSpec:
    """The whole group's load: ``users`` closed-loop users and at most ``requests`` measured
    requests in ``duration`` seconds in all, over ``procs`` processes."""

    port: int
    users: int
    requests: int
    duration: float
    warmup: int  # uncounted requests per user, before the common start
    tokens: int
    stream: bool
    procs: int
    timeout: float = 30.0  # per request


def split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` near-equal positive integers (the first ones larger)."""
    if parts < 1 or total < parts:
        raise ValueError(f"cannot split {total} into {parts} positive parts")
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def member_argv(spec: GroupSpec, users: int, requests: int) -> list[str]:
    """The command of one member."""
    argv = [sys.executable, "-m", "bench.load.loadgen_group", "--port", str(spec.port)]
    argv += ["-c", str(users), "-n", str(requests), "-d", str(spec.duration)]
    argv += ["--warmup", str(spec.warmup), "--tokens", str(spec.tokens)]
    argv += ["--timeout", str(spec.timeout)]
    return argv if spec.stream else [*argv, "--no-stream"]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def _read(stream: IO[bytes], deadline: float, *, line: bool) -> bytes:
    """What a member wrote to its stdout until EOF (or its first line, when ``line``), or until
    the deadline."""
    fd, data = stream.fileno(), b""
    while not (line and data.endswith(b"\n")):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            break
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        data += chunk
    return data


class Group:
    """The members of one measurement, started at once (pinned to ``cpus`` when given), their
    stderr in ``log_dir``; killed on leaving the ``with`` block if still running."""

    def __init__(self, spec: GroupSpec, log_dir: Path, cpus: Collection[int] = ()) -> None:
        self.spec = spec
        users, requests = split(spec.users, spec.procs), split(spec.requests, spec.procs)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        for i in range(spec.procs):
            log = (log_dir / f"loadgen-{i}.log").open("wb")
            self._logs.append(log)
            proc = subprocess.Popen(
                member_argv(spec, users[i], requests[i]),
                cwd=REPO_ROOT,
                env=_env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
                preexec_fn=set_parent_death_signal,
            )
            self.procs.append(proc)
            if cpus:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(proc.pid, cpus)

    def wait_warm(self, timeout_s: float) -> None:
        """Until every member has sent its warmup; ``BenchError`` if one fails or is late."""
        deadline = time.monotonic() + timeout_s
        for i, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = _read(proc.stdout, deadline, line=True)
            if line != WARM_LINE:
                raise BenchError(f"loadgen {i}: no warmup within {timeout_s:g} s ({line!r})")

    def go(self) -> None:
        """Start every member's measured phase."""
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(GO_LINE)
            proc.stdin.close()

    def collect(self, timeout_s: float) -> list[Share]:
        """Every member's share; ``BenchError`` if one fails or runs past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        return [self._share(i, proc, deadline) for i, proc in enumerate(self.procs)]

    def _share(self, i: int, proc: subprocess.Popen[bytes], deadline: float) -> Share:
        assert proc.stdout is not None
        out = _read(proc.stdout, deadline, line=False)
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired as exc:
            raise BenchError(f"loadgen {i} did not finish in time") from exc
        if proc.returncode != 0:
            raise BenchError(f"loadgen {i} failed ({proc.returncode}): {self._log_tail(i)}")
        return msgspec.json.decode(out, type=Share)

    def _log_tail(self, i: int) -> str:
        with contextlib.suppress(OSError):
            return Path(self._logs[i].name).read_text(errors="replace")[-600:]
        return "(no log)"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for log in self._logs:
            log.close()


# ---------------------------------------------------------------------------------------------
# A member
# ---------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.load.loadgen_group",
        description="One load generator of a group: warm up, wait for 'go' on stdin, measure.",
    )
    parser.add_argument("--port", type=int, required=True, help="on 127.0.0.1")
    parser.add_argument("-c", "--concurrency", type=int, required=True)
    parser.add_argument("-n", "--requests", type=int, required=True)
    parser.add_argument("-d", "--duration", type=float, required=True)
    parser.add_argument("--warmup", type=int, default=2, help="uncounted requests per user")
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    parser.add_argument("--timeout", type=float, default=30.0, help="per request (s)")
    return parser.parse_args(argv)


def _load(args: argparse.Namespace, body: bytes, requests: int, duration: float) -> LoadResult:
    return uvloop.run(
        run_load(
            LOOPBACK,
            args.port,
            concurrency=args.concurrency,
            requests=requests,
            duration=duration,
            warmup=0,
            body=body,
            request_timeout=args.timeout,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    body = completion_body(model=MODEL, max_tokens=args.tokens, stream=args.stream)
    if args.warmup > 0:
        _load(args, body, args.concurrency * args.warmup, WARM_MAX_S)
    sys.stdout.buffer.write(WARM_LINE)
    sys.stdout.flush()
    if sys.stdin.buffer.readline() != GO_LINE:
        return 3  # the group was called off
    load = _load(args, body, args.requests, args.duration)
    ended = time.monotonic()
    share = Share(load, started=ended - load.wall_s, ended=ended)
    sys.stdout.buffer.write(msgspec.json.encode(share) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
