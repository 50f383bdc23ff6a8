"""The soak's attacks on the router's memory and connections, from one attacking source.

Every attack connects from ``ATTACKER_HOSTS`` (127.0.0.2..4, other loopback addresses), so
that a per-source limit can tell it from the soak's own clients (127.0.0.1). Each is bounded in
bytes, connections and time, and says what the attacker got (its own 4xx/429/408 are expected):

* ``big_bodies``: ``count`` completions with a ``body_bytes`` JSON body (a ``logit_bias`` map of
  distinct token ids: each entry Python objects once parsed), sent at once, each paced in 1 MiB
  writes, with their ``Content-Length``. The router must read and parse a body to see that its
  ``n`` is beyond ``--max-n`` (400): the engines never pay for them (a simulated worker takes
  seconds of CPU per such body, which would measure the workers, not the router);
* ``trailer_flood``: chunked completions whose trailer section never ends (4 KB header lines up
  to ``max_bytes`` per connection, or ``duration_s``);
* ``conn_flood``: connections that send one ``GET /health`` and then stay idle (keep-alive),
  opened again soon when the router closes them (again after a while when refused), for
  ``duration_s``, spread over every attacking address: past the router's global cap with each
  address under its per-source cap (``--max-connections`` 512, half of it per source);
* ``slowloris``: request heads sent one header line per interval, never finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = [
    "ATTACKER_HOSTS",
    "AttackResult",
    "big_bodies",
    "conn_flood",
    "logit_bias_body",
    "slowloris",
    "trailer_flood",
]

ATTACKER_HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
_ROUTER_HOST = "127.0.0.1"
_CHUNK = 1 << 20
_ANSWER_GRACE_S = 5.0  # for an answer once the attacker stopped sending
_CONNECT_S = 5.0
_REFUSED = -1  # no connection, or reset before a status line
_NO_ANSWER = 0  # closed without a status line


@dataclass
class AttackResult:
    note: str
    measures: dict[str, float] = field(default_factory=dict)


async def _connect(
    port: int, source: str = ATTACKER_HOSTS[0]
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(
        asyncio.open_connection(_ROUTER_HOST, port, local_addr=(source, 0)), _CONNECT_S
    )


async def _status(reader: asyncio.StreamReader) -> int:
    """The status of the answer's status line; ``_NO_ANSWER`` at EOF."""
    line = await reader.readline()
    parts = line.split()
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else _NO_ANSWER


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


def _statuses(found: Sequence[int]) -> str:
    names = {_REFUSED: "refused/reset", _NO_ANSWER: "closed"}
    return ", ".join(f"{n}x {names.get(s, s)}" for s, n in sorted(Counter(found).items()))


_TOO_MANY = 1_000_000  # an ``n`` beyond any --max-n: refused once the body is parsed


def logit_bias_body(model: str, body_bytes: int) -> bytes:
    """A completion body of about ``body_bytes``: a ``logit_bias`` map, and an ``n`` the router
    refuses (400) once it parsed the body."""
    entries = body_bytes // 13  # '"1234567":-1,' is 13 bytes
    bias = b",".join(b'"%d":-1' % i for i in range(entries))
    head = b'{"model":"%s","prompt":"hi","max_tokens":1,' % model.encode()
    return head + b'"logit_bias":{%s},"n":%d}' % (bias, _TOO_MANY)


async def _send_body(port: int, body: bytes, pace_s: float, deadline_s: float) -> int:
    """POST ``body`` (1 MiB per write, ``pace_s`` apart; stopped once answered): the status."""
    try:
        reader, writer = await _connect(port)
    except (OSError, TimeoutError):
        return _REFUSED
    answer = asyncio.create_task(_status(reader))
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    try:
        writer.write(head)
        for offset in range(0, len(body), _CHUNK):
            if answer.done():
                break
            writer.write(body[offset : offset + _CHUNK])
            await writer.drain()
            await asyncio.sleep(pace_s)
        return await asyncio.wait_for(asyncio.shield(answer), deadline_s)
    except (OSError, TimeoutError, ValueError):
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            return answer.result()
        return _REFUSED
    finally:
        answer.cancel()
        await _close(writer)


async def big_bodies(
    port: int, body: bytes, count: int, pace_s: float, deadline_s: float
) -> AttackResult:
    found = await asyncio.gather(
        *(_send_body(port, body, pace_s, deadline_s) for _ in range(count))
    )
    note = f"{count} x {len(body) / 1e6:.0f} MB logit_bias bodies: {_statuses(found)}"
    return AttackResult(note, {"attacker_unanswered": sum(1 for s in found if s <= 0)})


_TRAILER_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)
_TRAILER_LINE = b"X-Trailer-Pad: " + b"a" * 4000 + b"\r\n"


async def _trailers(port: int, body: bytes, max_bytes: int, until: float) -> tuple[int, int]:
    """One chunked request with an endless trailer section: (trailer bytes sent, status)."""
    try:
        reader, writer = await _connect(port)
    except (OSError, TimeoutError):
        return 0, _REFUSED
    answer = asyncio.create_task(_status(reader))
    block, sent = _TRAILER_LINE * 16, 0
    try:
        writer.write(_TRAILER_HEAD + b"%x\r\n%s\r\n0\r\n" % (len(body), body))
        while sent < max_bytes and time.monotonic() < until and not answer.done():
            writer.write(block)
            await writer.drain()
            sent += len(block)
        if not answer.done():
            writer.write(b"\r\n")
        return sent, await asyncio.wait_for(asyncio.shield(answer), _ANSWER_GRACE_S)
    except (OSError, TimeoutError, ValueError):
        if answer.done() and not answer.cancelled() and answer.exception() is None:
            return sent, answer.result()
        return sent, _REFUSED
    finally:
        answer.cancel()
        await _close(writer)


async def trailer_flood(
    port: int, body: bytes, connections: int, max_bytes: int, duration_s: float
) -> AttackResult:
    until = time.monotonic() + duration_s
    found = await asyncio.gather(
        *(_trailers(port, body, max_bytes, until) for _ in range(connections))
    )
    sent = sum(n for n, _ in found)
    note = (
        f"{connections} conns sent {sent / 2**20:.1f} MiB of trailers: "
        f"{_statuses([s for _, s in found])}"
    )
    return AttackResult(note, {"attacker_trailer_mib": round(sent / 2**20, 1)})


@dataclass
class _Held:
    opened: int = 0
    refused: int = 0  # no connection, or the router answered something else than 200
    closed: int = 0  # closed by the router while idle
    held: int = 0  # still open at the end


_KEEP_ALIVE = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


_REOPEN_S = 0.2  # before opening again a connection the router closed while idle
_RETRY_S = 1.0  # before trying again after a refusal


async def _idle_once(port: int, source: str, until: float, held: _Held) -> bool:
    """Open, ``GET /health``, stay idle until closed or ``until``: whether it was served."""
    try:
        reader, writer = await _connect(port, source)
    except (OSError, TimeoutError):
        held.refused += 1
        return False
    try:
        writer.write(_KEEP_ALIVE)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _CONNECT_S)
        if not head.startswith(b"HTTP/1.1 200"):
            held.refused += 1
            return False
        held.opened += 1
        if not await asyncio.wait_for(reader.read(1), max(until - time.monotonic(), 0.01)):
            held.closed += 1  # EOF (a 200 to /health has no body: more data ends it too)
        return True
    except TimeoutError:
        held.held += 1
        return True
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        held.refused += 1
        return False
    finally:
        await _close(writer)


async def _idle_connection(port: int, source: str, until: float, most: int, held: _Held) -> None:
    for _ in range(most):
        if time.monotonic() >= until:
            return
        served = await _idle_once(port, source, until, held)
        await asyncio.sleep(_REOPEN_S if served else _RETRY_S)


async def conn_flood(port: int, connections: int, duration_s: float) -> AttackResult:
    held, until = _Held(), time.monotonic() + duration_s
    reopen = max(int(duration_s / _REOPEN_S), 1)  # attempts per connection, at most
    await asyncio.gather(
        *(
            _idle_connection(port, ATTACKER_HOSTS[i % len(ATTACKER_HOSTS)], until, reopen, held)
            for i in range(connections)
        )
    )
    note = (
        f"{connections} idle keep-alive conns from {len(ATTACKER_HOSTS)} addresses: "
        f"{held.opened} opened, {held.held} held to the end, {held.closed} closed by the router, "
        f"{held.refused} refused"
    )
    measures: dict[str, float] = {"attacker_opened": held.opened, "attacker_held": held.held}
    return AttackResult(note, measures | {"attacker_refused": held.refused})


async def _slow_connection(port: int, duration_s: float, interval_s: float) -> float | None:
    """One slowloris connection: seconds until the router closed or answered it, None if it
    stayed open for ``duration_s``, ``_REFUSED`` if it could not connect."""
    try:
        reader, writer = await _connect(port)
    except (OSError, TimeoutError):
        return _REFUSED
    opened = time.monotonic()
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        while (left := duration_s - (time.monotonic() - opened)) > 0:
            await writer.drain()
            try:
                await asyncio.wait_for(reader.read(4096), min(interval_s, left))
            except TimeoutError:
                writer.write(b"X-Slow: a\r\n")
                continue
            return time.monotonic() - opened  # an answer (408?) or EOF: the router gave up
        return None
    except OSError:
        return time.monotonic() - opened
    finally:
        await _close(writer)


async def slowloris(
    port: int, connections: int, duration_s: float, interval_s: float
) -> AttackResult:
    closed = await asyncio.gather(
        *(_slow_connection(port, duration_s, interval_s) for _ in range(connections))
    )
    refused = sum(1 for c in closed if c == _REFUSED)
    ended = [c for c in closed if c is not None and c != _REFUSED]
    held = sum(1 for c in closed if c is None)
    when = f" (median after {statistics.median(ended):.1f} s)" if ended else ""
    note = f"{connections} conns: {len(ended)} closed by the router{when}, {held} held, "
    return AttackResult(note + f"{refused} refused")
