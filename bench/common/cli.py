"""Command-line pieces the benchmarks share: argument types, SIGTERM as an exception, the exit
status of a failed or interrupted run, the report printed and written as JSON."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from bench.common.process import BenchError

__all__ = [
    "exit_on_failure",
    "finish",
    "positive_ints",
    "run_in_log_dir",
    "sigterm_raises",
    "write_json",
]


def positive_ints(text: str) -> tuple[int, ...]:
    """An argparse ``type``: ``"1,32,128"`` -> ``(1, 32, 128)``, every value >= 1."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


@contextlib.contextmanager
def sigterm_raises(
    error: Callable[[int], BaseException] = lambda _signum: KeyboardInterrupt(),
) -> Iterator[None]:
    """SIGTERM raises ``error(signum)`` (default ``KeyboardInterrupt``) in the block, so every
    ``finally`` (child cleanup) runs; a no-op off the main thread, where handlers cannot be set."""

    def interrupt(signum: int, _frame: object) -> None:
        raise error(signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def exit_on_failure(prog: str, stopped: str = "every process was stopped") -> Iterator[None]:
    """A ``BenchError`` or an interrupt in the block exits with a one-line message (status 1):
    ``PROG: the error`` or ``PROG: interrupted (STOPPED)``."""
    try:
        yield
    except BenchError as exc:
        raise SystemExit(f"{prog}: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"{prog}: interrupted ({stopped})") from None


def write_json(report: object, path: Path) -> None:
    """``report`` (dataclasses, msgspec structs; anything else as ``str``) as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report, enc_hook=str)))


def finish(text: str, report: object, json_path: Path | None, failed: bool) -> None:
    """Print ``text``, write ``report`` to ``json_path`` (when given) and exit 1 when ``failed``."""
    print(text, flush=True)
    if json_path is not None:
        write_json(report, json_path)
    if failed:
        raise SystemExit(1)


def run_in_log_dir(
    execute: Callable[[Path], int], log_dir: Path | None, prefix: str, name: str
) -> int:
    """``execute(log_dir)``'s exit status, SIGTERM and Ctrl-C ending it cleanly (130); the
    processes' logs go to ``log_dir`` (a temporary one when None, removed after a clean run)
    and are kept, and named, after a failed one."""
    where = log_dir or Path(tempfile.mkdtemp(prefix=prefix))
    where.mkdir(parents=True, exist_ok=True)
    code = 130
    try:
        with sigterm_raises():
            code = execute(where)
    except KeyboardInterrupt:
        print(f"{name}: interrupted; all processes stopped", file=sys.stderr, flush=True)
    finally:
        if code != 0:
            print(f"{name}: process logs kept in {where}", file=sys.stderr, flush=True)
        elif log_dir is None:
            shutil.rmtree(where, ignore_errors=True)
    return code
