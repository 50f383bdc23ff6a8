"""SampleSplit: n > 1 served as n single-sequence parts and merged as one engine's answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from router.errors import UpstreamError
from router.pipeline.responder import Responder
from router.pipeline.sample_split import SampleSplit
from router.schemas import Endpoint, ParsedRequest
from router.types import Message

_LIMIT = 1 << 20  # bytes the parts may hold at once


class _Client:
    """Collects what the router would send to the client over ASGI."""

    def __init__(self) -> None:
        self.status = 0
        self.body = b""
        self.writes = 0

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
        else:
            self.body += message.get("body", b"")
            self.writes += 1


def _request(
    n: int, *, stream: bool, batch: int | None = None, usage: bool = False
) -> ParsedRequest:
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "n": n, "stream": stream}
    if usage:
        body["stream_options"] = {"include_usage": True}
    return ParsedRequest(Endpoint.COMPLETIONS, body, stream, batch, n)


def _split(request: ParsedRequest, client: _Client) -> SampleSplit:
    return SampleSplit(request, Responder(client.send, []), _LIMIT)


def _events(body: bytes) -> list[Any]:
    out: list[Any] = []
    for event in body.decode().split("\n\n"):
        if event.startswith("data: "):
            data = event[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def test_plain_answers_merge_into_n_choices_with_usage_summed() -> None:
    client = _Client()
    seen: list[dict[str, Any]] = []

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        seen.append(part.body)
        index = len(seen) - 1
        answer = {
            "id": "cmpl-1",
            "choices": [{"index": 0, "text": f"t{index}", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2 + index, "total_tokens": 7},
        }
        await asyncio.sleep(0.01 * (3 - index))  # finish out of order
        await sink.whole(200, b"application/json", json.dumps(answer).encode())

    await _split(_request(3, stream=False), client).run(serve)

    assert [body["n"] for body in seen] == [1, 1, 1]
    answer = json.loads(client.body)
    assert client.status == 200
    assert [(c["index"], c["text"]) for c in answer["choices"]] == [(0, "t0"), (1, "t1"), (2, "t2")]
    assert answer["usage"] == {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}


async def test_batched_prompts_keep_each_prompts_samples_together() -> None:
    client = _Client()
    parts = iter(range(2))

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        j = next(parts)
        choices = [{"index": i, "text": f"p{i}s{j}"} for i in range(2)]
        await sink.whole(200, b"application/json", json.dumps({"choices": choices}).encode())

    await SampleSplit(_request(2, stream=False, batch=2), Responder(client.send, []), _LIMIT).run(
        serve
    )

    texts = [(c["index"], c["text"]) for c in json.loads(client.body)["choices"]]
    assert texts == [(0, "p0s0"), (1, "p0s1"), (2, "p1s0"), (3, "p1s1")]


async def test_streams_interleave_reindexed_events_with_one_usage_and_one_done() -> None:
    client = _Client()
    turn = asyncio.Event()
    parts = iter(range(2))
    live = bytearray()

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        j = next(parts)
        await sink.start(200, b"text/event-stream", sse=True)
        for step in range(2):
            if j == 1 and step == 1:
                await turn.wait()  # part 1's second event only after part 0 ended
            event = {"choices": [{"index": 0, "text": f"{j}.{step}", "finish_reason": None}]}
            data = f"data: {json.dumps(event)}\n\n".encode()
            await sink.chunk(data[:7])  # an event split across chunks
            await sink.chunk(data[7:])
        usage = {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
        await sink.chunk(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await sink.finish(b"data: [DONE]\n\n")
        if j == 0:
            live.extend(client.body)
            turn.set()

    await SampleSplit(_request(2, stream=True, usage=True), Responder(client.send, []), _LIMIT).run(
        serve
    )

    events = _events(client.body)
    choices = [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events[:-2]]
    assert sorted(choices) == [(0, "0.0"), (0, "0.1"), (1, "1.0"), (1, "1.1")]
    assert b'"0.1"' in live, "events reach the client while another part is still running"
    assert events[-2]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert events[-1] == "[DONE]"
    assert client.body.count(b"[DONE]") == 1


async def test_an_error_answer_of_one_part_is_the_clients_answer() -> None:
    client = _Client()
    parts = iter(range(2))

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        if next(parts) == 1:
            await sink.whole(400, b"application/json", b'{"error": {"message": "bad"}}')
        else:
            await sink.whole(200, b"application/json", b'{"choices": [{"index": 0}]}')

    await _split(_request(2, stream=False), client).run(serve)

    assert client.status == 400
    assert json.loads(client.body)["error"]["message"] == "bad"


async def test_the_first_failing_part_cancels_the_others() -> None:
    client = _Client()
    cancelled = asyncio.Event()
    parts = iter(range(2))

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        if next(parts) == 0:
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(RuntimeError, match="boom"):
        await _split(_request(2, stream=True), client).run(serve)
    assert cancelled.is_set()
    assert client.body == b""


@pytest.mark.parametrize("stream", [False, True])
async def test_the_parts_answers_are_bounded_in_all(stream: bool) -> None:
    """Eight parts of 200 KiB each (whole answers, or one SSE event that never ends) pass the
    1 MiB limit together: the request fails with a 502 instead of buffering on."""
    client = _Client()
    chunk = b"data: " + b"x" * (200 * 1024) if stream else b"x" * (200 * 1024)
    kind = b"text/event-stream" if stream else b"application/json"

    async def serve(part: ParsedRequest, sink: Responder) -> None:
        await sink.start(200, kind, sse=stream)
        await sink.chunk(chunk)
        await asyncio.sleep(30)  # never ends by itself

    with pytest.raises(UpstreamError, match="exceed the router's 1048576-byte limit") as failed:
        await asyncio.wait_for(
            _split(_request(8, stream=stream), client).run(serve),
            10,
        )
    assert failed.value.status == 502
    assert client.body == b""
