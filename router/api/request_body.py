"""A completion request's body, read within its bounds: its size (413) and the router's body
memory budget (429, ``router.pipeline.admission.BodyMemory``), whose share it holds until the
request ends; a large one is parsed in its turn (``parse_in_turn``).

A parse holds the GIL, in a worker thread as on the event loop (measured: 28 MB of
``logit_bias`` decoded in a thread stalled the loop 0.89 s, on it 0.90 s), so large bodies are
not sent to threads: they are parsed one at a time, each in a loop step of its own, so that
``/health`` and small requests wait for one such step at most (~50 ms for 28 MB with the lazy
decode of ``router.schemas``), never for every body that arrived at once.
"""

from __future__ import annotations

import asyncio

from router.errors import BodyTooLarge, InvalidRequest
from router.interrupt import ClientDisconnected
from router.pipeline.admission import BODY_MEMORY_FACTOR, BodyMemory
from router.schemas import (
    LAZY_BODY_BYTES,
    Endpoint,
    ParsedRequest,
    RequestLimits,
    check_body,
    parse_request,
)
from router.types import Receive

__all__ = ["BodyShare", "parse_in_turn", "read_body"]


class BodyShare:
    """One request's share of the body memory budget: ``take`` per body byte as they are known
    (raises Overloaded beyond the budget), ``release`` once when the request ended."""

    __slots__ = ("_memory", "held")

    def __init__(self, memory: BodyMemory) -> None:
        self._memory = memory
        self.held = 0

    def take(self, body_bytes: int) -> None:
        amount = body_bytes * BODY_MEMORY_FACTOR
        self._memory.take(amount, self.held)
        self.held += amount

    def release(self) -> None:
        self._memory.give_back(self.held)
        self.held = 0


async def read_body(
    receive: Receive, limit: int, content_length: int | None, share: BodyShare
) -> bytes | bytearray:
    """The whole body. A Content-Length over ``limit`` (413) or over the budget (429) is
    refused before a byte is read; a body without one is counted as it arrives."""
    if content_length is not None:
        if content_length > limit:
            raise BodyTooLarge(
                f"request body of {content_length} bytes exceeds the {limit}-byte limit"
            )
        share.take(content_length)
        if content_length > LAZY_BODY_BYTES:
            return await _read_into_one_buffer(receive, content_length)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnected
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the {limit}-byte limit")
        if content_length is None:
            share.take(len(chunk))
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if not body:
        raise InvalidRequest("request body is empty; expected a JSON object")
    return body


async def _read_into_one_buffer(receive: Receive, length: int) -> bytearray:
    """A large body of known length, each piece copied into one buffer as it comes: no pieces
    to join at the end (a join of 28 MB holds the loop ~20 ms and the memory twice)."""
    body = bytearray(length)
    size = 0
    with memoryview(body) as view:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnected
            chunk = message.get("body", b"")
            end = size + len(chunk)
            if end > length:  # the HTTP server holds a body to its Content-Length
                raise InvalidRequest("request body is longer than its Content-Length")
            view[size:end] = chunk
            size = end
            if not message.get("more_body", False):
                break
    if size < length:
        raise InvalidRequest("request body is shorter than its Content-Length")
    return body


async def parse_in_turn(
    turn: asyncio.Lock, endpoint: Endpoint, raw: bytes | bytearray, limits: RequestLimits
) -> ParsedRequest:
    """``parse_request`` for a body over ``LAZY_BODY_BYTES``: one at a time (``turn``), its
    whole-body checks and its decoding each in a loop step of their own (~20 ms each for
    28 MB), the loop's other work (a ``/health`` request) getting a turn between them."""
    async with turn:
        await asyncio.sleep(0)  # what became ready meanwhile goes first
        check_body(raw, limits.max_json_depth)
        await asyncio.sleep(0)
        request = parse_request(endpoint, raw, limits, checked=True)
        await asyncio.sleep(0)  # nor is the legs' encoding of this body part of this step
    return request
