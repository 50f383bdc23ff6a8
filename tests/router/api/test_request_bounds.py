"""Request bounds (issue 11 items 1, 5, 9): sizes in sequences, X-Request-Id, JSON shape.

A request too large in ``n``, batch size or their product, a bad ``X-Request-Id``, invalid UTF-8
inside a JSON string or JSON nested too deep gets a 400 OpenAI error, fast, and reaches no engine.
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

import httpx
import msgspec
import pytest

from router.errors import InvalidRequest
from router.schemas import Endpoint, RequestLimits, json_depth_within, parse_request
from router.server.cli import parse_args
from router.settings import ServerSettings
from testkit.fake_cluster import FakeCluster, FakeClusterFactory
from tests.router.pipeline.test_protocols import CHAT, COMPLETION

SMALL = {"max_n": 4, "max_batch": 4, "max_sequences": 8}  # cheap to serve at the limit


def _post(
    cluster: FakeCluster, body: bytes | dict[str, Any], path: str = "/v1/completions", **kw: Any
) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **kw.pop("headers", {})}
    return httpx.post(cluster.router_url + path, content=content, headers=headers, timeout=10)


def _assert_400(response: httpx.Response, param: str | None, needle: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param
    assert needle in error["message"]


def _nothing_sent(cluster: FakeCluster) -> bool:
    engines = cluster.prefills + cluster.decodes
    return all(engine.records == [] for engine in engines)


def _nested(depth: int) -> bytes:
    """A completion body whose arrays/objects nest ``depth`` levels (the body is level 1)."""
    inner = b"[" * (depth - 1) + b"]" * (depth - 1)
    return b'{"model": "fake-model", "prompt": "x", "extra": ' + inner + b"}"


def test_huge_n_with_sglang_is_400_fast_and_reaches_no_engine(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    started = time.monotonic()
    response = _post(cluster, b'{"model":"m","prompt":"x","n":1000000000}')
    assert time.monotonic() - started < 1.0
    _assert_400(response, "n", "at most 128")
    assert _nothing_sent(cluster)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"n": 5}, "n", "'n' must be at most 4"),
        ({"prompt": ["a"] * 5}, "prompt", "at most 4 per request"),
        ({"prompt": [[1, 2]] * 5}, "prompt", "at most 4 per request"),
        ({"prompt": ["a", "b", "c"], "n": 3}, "n", "9 sequences; at most 8"),
    ],
)
def test_n_batch_and_their_product_over_the_limits_are_400(
    make_cluster: FakeClusterFactory, body: dict[str, Any], param: str, needle: str
) -> None:
    cluster = make_cluster("sglang", server=SMALL)
    _assert_400(_post(cluster, {**COMPLETION, **body}), param, needle)
    assert _nothing_sent(cluster)


def test_requests_at_the_limits_are_served(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", server=SMALL)
    response = _post(cluster, {**COMPLETION, "prompt": ["a", "b", "c", "d"], "n": 2})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 8
    response = _post(cluster, {**CHAT, "n": 4}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 4


def test_a_batch_at_the_default_limit_is_served(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    response = _post(cluster, {**COMPLETION, "prompt": [f"p{i}" for i in range(256)]})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 256
    _assert_400(_post(cluster, {**COMPLETION, "prompt": ["p"] * 257}), "prompt", "at most 256")


@pytest.mark.parametrize(
    "bad_id",
    [
        b"r" * (9 * 1024),  # beyond the engines' 8190-byte header limit
        b"r" * 257,
        "caf\u00e9".encode("latin-1"),  # not ASCII
        "id-\u2603".encode(),  # UTF-8 bytes
        b"two words",  # a space
        b"tab\there",
    ],
)
def test_bad_request_id_is_400_not_echoed_and_reaches_no_engine(
    make_cluster: FakeClusterFactory, bad_id: bytes
) -> None:
    cluster = make_cluster("sglang")
    response = _post(cluster, COMPLETION, headers={"x-request-id": bad_id})
    _assert_400(response, None, "X-Request-Id must be at most 256 printable ASCII")
    echoed = response.headers["x-request-id"].encode("latin-1")
    assert echoed != bad_id and len(echoed) == 32  # a generated id
    assert _nothing_sent(cluster)


def test_long_request_ids_leave_the_workers_healthy(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    for _ in range(5):
        response = _post(cluster, COMPLETION, headers={"x-request-id": "r" * 9 * 1024})
        assert response.status_code == 400
    ready = httpx.get(cluster.router_url + "/ready", timeout=5)
    assert ready.status_code == 200
    assert all(w["healthy"] for w in ready.json()["prefill"] + ready.json()["decode"])
    assert _post(cluster, COMPLETION).status_code == 200


def test_request_id_at_the_limit_is_forwarded_and_echoed(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang", server={"max_request_id_bytes": 16})
    good = "a-Z_0.9~!{}[]:;/"  # 16 printable ASCII bytes
    response = _post(cluster, COMPLETION, headers={"x-request-id": good})
    assert response.status_code == 200, response.text
    assert response.headers["x-request-id"] == good
    assert cluster.decodes[0].records[-1].headers["x-request-id"] == good
    response = _post(cluster, COMPLETION, headers={"x-request-id": good + "x"})
    _assert_400(response, None, "at most 16 printable ASCII")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bad", [b"\xff\xfe", b"\xc3", b"\xed\xa0\x80", b"ok \xe2\x82"])
def test_invalid_utf8_inside_a_json_string_is_400(
    make_cluster: FakeClusterFactory, path: str, bad: bytes
) -> None:
    cluster = make_cluster("sglang")
    body = b'{"model": "m", "prompt": "' + bad + b'", "messages": [{"role": "user"}]}'
    _assert_400(_post(cluster, body, path), None, "invalid UTF-8")
    assert _nothing_sent(cluster)


@pytest.mark.parametrize("depth", [65, 100, 999, 1000, 5000, 100_000])
def test_json_nested_too_deep_is_400(make_cluster: FakeClusterFactory, depth: int) -> None:
    cluster = make_cluster("sglang")
    _assert_400(_post(cluster, _nested(depth)), None, "deeper than 64 levels")
    assert _nothing_sent(cluster)


def test_chat_with_content_parts_and_nested_tool_schema_is_served(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(20):  # 20 nested object schemas: 40 levels below the tool's parameters
        schema = {"type": "object", "properties": {"x": schema}}
    content = [
        {"type": "text", "text": "look [at] {this}"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    body = {
        **CHAT,
        "messages": [{"role": "user", "content": content}] * 50,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
    }
    response = _post(cluster, body, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    assert _post(cluster, _nested(64)).status_code == 200


def _deep_list(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    return 0


@pytest.mark.parametrize(
    "value",
    [
        {"a": "x"},
        {"a": "[[[[{{{{" * 40},  # brackets inside strings do not count
        {"a": ['\\"[[[', '\\\\"', '"]]]]]]]]]]]]]]]]]]"'] * 30},  # escapes before quotes
        {"a": [[[[1]]]] * 100, "b": [{}] * 100},
        _deep_list(70, '\\"]'),  # 70 levels around an escaped quote and a bracket
        {"k[": {"k{": {"\\": [[[[[[[[[[]]]]]]]]]]}}, "e": [[[]]] * 60},
    ],
)
@pytest.mark.parametrize("limit", [1, 3, 12, 64, 65, 70])
def test_depth_scan_agrees_with_the_decoded_value(value: Any, limit: int) -> None:
    raw = msgspec.json.encode(value)
    assert json_depth_within(raw, limit) == (_reference_depth(value) <= limit)
    pretty = json.dumps(value, indent=1, ensure_ascii=False).encode()
    assert json_depth_within(pretty, limit) == (_reference_depth(value) <= limit)


def _random_value(rng: random.Random, depth: int) -> Any:
    """A JSON value up to ``depth`` levels deep, with strings full of brackets and escapes."""
    kind = rng.choice("sslda") if depth > 0 else "s"
    if kind == "s":
        return "".join(rng.choice('ab[]{}"\\\n') for _ in range(rng.randrange(6)))
    if kind == "l":
        return [_random_value(rng, depth - 1) for _ in range(rng.randrange(4))]
    if kind == "d":
        return {_random_value(rng, 0): _random_value(rng, depth - 1) for _ in range(3)}
    return rng.choice([1, -2.5, True, None])


def test_depth_scan_agrees_on_random_values() -> None:
    rng = random.Random(11)
    for _ in range(500):
        value = _random_value(rng, rng.randrange(1, 12))
        raw = msgspec.json.encode(value)
        depth = _reference_depth(value)
        for limit in {1, 2, 3, max(depth - 1, 1), depth or 1, depth + 1}:
            assert json_depth_within(raw, limit) == (depth <= limit), (raw, limit)


def test_parse_request_applies_the_limits_it_is_given() -> None:
    limits = RequestLimits(max_n=2, max_batch=3, max_sequences=4, max_json_depth=3)
    ok = msgspec.json.encode({"model": "m", "prompt": ["a", "b"], "n": 2, "x": [[]]})
    assert parse_request(Endpoint.COMPLETIONS, ok, limits).sample_count == 4
    for body, param in [
        ({"model": "m", "prompt": "a", "n": 3}, "n"),
        ({"model": "m", "prompt": ["a"] * 4}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 3, "n": 2}, "n"),
        ({"model": "m", "prompt": "a", "x": [[[]]]}, None),
    ]:
        with pytest.raises(InvalidRequest) as info:
            parse_request(Endpoint.COMPLETIONS, msgspec.json.encode(body), limits)
        assert info.value.param == param


def test_default_limits_are_the_settings_defaults() -> None:
    assert RequestLimits.from_settings(ServerSettings()) == RequestLimits()


def test_limit_flags_set_the_server_settings(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--max-n", "8", "--max-batch", "16", "--max-sequences", "32"]
    server = parse_args([*argv, "--max-request-id-bytes", "64"]).server
    assert (server.max_n, server.max_batch, server.max_sequences) == (8, 16, 32)
    assert server.max_request_id_bytes == 64
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--max-n", "0"])
    assert exit_info.value.code == 2
    assert "argument --max-n:" in capsys.readouterr().err
