"""Command-line pieces the benchmarks share."""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

__all__ = ["positive_ints", "sigterm_raises"]


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
