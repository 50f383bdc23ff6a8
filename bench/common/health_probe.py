"""Times ``GET /health`` on a new connection, again and again: a process of its own, so that the
soak's own busy event loop (and its GIL) is not in the numbers.

    python -m bench.common.health_probe PORT [--every 0.05] [--timeout 2] [--max-seconds 120]

Prints one line per probe, flushed: the milliseconds from connecting to the end of the answer's
head, or ``failed`` (refused, reset, timed out, not 200); stops at SIGTERM or ``--max-seconds``.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Sequence

__all__ = ["FAILED", "health_ms", "main"]

FAILED = "failed"
_HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
_HEAD_END = b"\r\n\r\n"
_MAX_HEAD_BYTES = 16 * 1024


def health_ms(port: int, timeout_s: float) -> float | None:
    """Milliseconds for one ``GET /health`` on a new connection (to the end of the answer's head);
    None when it failed: refused, reset, timed out or not 200."""
    started = time.perf_counter()
    head = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(_HEALTH)
            while _HEAD_END not in head and len(head) < _MAX_HEAD_BYTES:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                head += chunk
    except OSError:
        return None
    if not head.startswith(b"HTTP/1.1 200") or _HEAD_END not in head:
        return None
    return (time.perf_counter() - started) * 1000


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="bench.common.health_probe")
    parser.add_argument("port", type=int)
    parser.add_argument("--every", type=float, default=0.05, help="seconds between probes")
    parser.add_argument("--timeout", type=float, default=2.0, help="per probe, seconds")
    parser.add_argument("--max-seconds", type=float, default=120.0)
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.max_seconds
    while time.monotonic() < deadline:
        latency = health_ms(args.port, args.timeout)
        print(FAILED if latency is None else f"{latency:.2f}", flush=True)
        time.sleep(args.every)


if __name__ == "__main__":
    main()
