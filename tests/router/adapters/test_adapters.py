"""Each PD adapter's rewrite, field by field, against docs/concepts/protocols.md."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest

from router.adapters import SglangAdapter, VllmMooncakeAdapter, VllmNixlAdapter
from router.adapters.sglang import MAX_ROOM, aligned_room
from router.errors import InvalidRequest
from router.schemas import Endpoint, ParsedRequest, parse_request
from router.workers import Role, Worker


def _req(endpoint: Endpoint, **body: Any) -> ParsedRequest:
    return parse_request(endpoint, msgspec.json.encode({"model": "m", **body}))


def _prefill(url: str = "http://10.0.0.5:8100", port: int | None = 8998, dp: int = 1) -> Worker:
    worker = Worker(Role.PREFILL, url, port)
    worker.set_layout(dp, tuple(f"eng_dp{r}" for r in range(dp)))
    return worker


DECODE = Worker(Role.DECODE, "http://10.0.0.6:8200")


def test_mooncake_prefill_leg_is_one_token_non_streaming_with_transfer_id() -> None:
    adapter = VllmMooncakeAdapter(new_transfer_id=lambda: "xfer-1")
    request = _req(
        Endpoint.CHAT,
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=50,
        max_completion_tokens=50,
        min_tokens=3,
    )
    plan = adapter.plan(request, _prefill(dp=2), 1, DECODE)
    assert plan.prefill_headers == {"x-data-parallel-rank": "1"}
    p = plan.prefill_body
    assert p["stream"] is False and p["max_tokens"] == 1 and p["max_completion_tokens"] == 1
    assert "stream_options" not in p
    # vLLM answers 400 to min_tokens > max_tokens=1; min_tokens=1 masks stop tokens for the
    # prefill's one token, so vLLM keeps the KV for the decode
    assert p["min_tokens"] == 1
    assert plan.decode_body is not None and plan.decode_body["min_tokens"] == 3
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "xfer-1",
    }
    d = plan.decode_body
    assert d is not None
    assert d["stream"] is True and d["max_tokens"] == 50
    assert d["stream_options"] == {"include_usage": True}
    assert d["kv_transfer_params"] == {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_bootstrap_addr": "http://10.0.0.5:8998",
        "remote_engine_id": "eng_dp1",
        "transfer_id": "xfer-1",
    }
    assert "kv_transfer_params" not in request.body  # the client's body is not mutated


def test_mooncake_mints_a_fresh_transfer_id_per_attempt() -> None:
    adapter = VllmMooncakeAdapter()
    request = _req(Endpoint.COMPLETIONS, prompt="x")
    ids = {
        adapter.plan(request, _prefill(), 0, DECODE).prefill_body["kv_transfer_params"][
            "transfer_id"
        ]
        for _ in range(50)
    }
    assert len(ids) == 50


def test_mooncake_bootstrap_addr_brackets_ipv6() -> None:
    plan = VllmMooncakeAdapter().plan(
        _req(Endpoint.COMPLETIONS, prompt="x"), _prefill("http://[fd00::5]:8100"), 0, DECODE
    )
    assert plan.decode_body is not None
    assert (
        plan.decode_body["kv_transfer_params"]["remote_bootstrap_addr"] == "http://[fd00::5]:8998"
    )


@pytest.mark.parametrize("adapter", [VllmMooncakeAdapter(), VllmNixlAdapter()])
@pytest.mark.parametrize("body", [{"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}])
def test_vllm_protocols_reject_multi_sequence_requests(adapter: Any, body: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        adapter.check(_req(Endpoint.COMPLETIONS, **body))


def test_nixl_prefill_asks_one_min_token_and_decode_gets_params_verbatim() -> None:
    adapter = VllmNixlAdapter()
    request = _req(
        Endpoint.COMPLETIONS,
        prompt="x",
        stream=True,
        min_tokens=4,
        min_completion_tokens=2,
        max_tokens=9,
    )
    plan = adapter.plan(request, _prefill(), 0, DECODE)
    assert plan.decode_body is None
    p = plan.prefill_body
    assert p["min_tokens"] == 1 and "min_completion_tokens" not in p
    assert p["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    params = {"remote_block_ids": [[1]], "remote_engine_id": "e", "future_field": {"a": 1}}
    d = adapter.decode_after_prefill(request, {"kv_transfer_params": params})
    assert d["kv_transfer_params"] == params
    assert d["min_tokens"] == 4 and d["min_completion_tokens"] == 2 and d["max_tokens"] == 9
    assert d["stream"] is True


def test_nixl_prefill_answer_without_params_is_a_clear_error() -> None:
    with pytest.raises(InvalidRequest, match="kv_transfer_params"):
        VllmNixlAdapter().decode_after_prefill(_req(Endpoint.COMPLETIONS, prompt="x"), {"id": 1})


def test_sglang_same_body_to_both_with_bootstrap_fields() -> None:
    adapter = SglangAdapter(random.Random(1))
    request = _req(Endpoint.CHAT, messages=[{"role": "user", "content": "hi"}], stream=True)
    plan = adapter.plan(request, _prefill("http://10.0.0.5:30000", 8998), 0, DECODE)
    assert plan.prefill_body == plan.decode_body
    body = plan.prefill_body
    assert body["bootstrap_host"] == "10.0.0.5" and body["bootstrap_port"] == 8998
    assert 1 <= body["bootstrap_room"] <= MAX_ROOM
    assert body["stream"] is True


def test_sglang_null_port_and_ipv6_host() -> None:
    plan = SglangAdapter().plan(
        _req(Endpoint.COMPLETIONS, prompt="x"), _prefill("http://[::1]:30000", None), 0, DECODE
    )
    assert plan.prefill_body["bootstrap_host"] == "[::1]"
    assert plan.prefill_body["bootstrap_port"] is None


@pytest.mark.parametrize(
    ("endpoint", "body", "count"),
    [
        (Endpoint.COMPLETIONS, {"prompt": ["a", "b", "c"]}, 3),
        (Endpoint.COMPLETIONS, {"prompt": [[1, 2], [3]]}, 2),
        (Endpoint.COMPLETIONS, {"prompt": "a", "n": 4}, 4),
        (Endpoint.COMPLETIONS, {"prompt": ["a", "b"], "n": 2}, 4),
        (Endpoint.CHAT, {"messages": [{"role": "user", "content": "x"}], "n": 3}, 3),
    ],
)
def test_sglang_batches_and_n_get_one_room_each(
    endpoint: Endpoint, body: dict[str, Any], count: int
) -> None:
    plan = SglangAdapter().plan(_req(endpoint, **body), _prefill(), 0, DECODE)
    p = plan.prefill_body
    assert len(p["bootstrap_room"]) == count == len(set(p["bootstrap_room"]))
    assert p["bootstrap_host"] == ["10.0.0.5"] * count
    assert p["bootstrap_port"] == [8998] * count


def test_sglang_token_id_prompt_is_a_single_request() -> None:
    plan = SglangAdapter().plan(_req(Endpoint.COMPLETIONS, prompt=[1, 2, 3]), _prefill(), 0, DECODE)
    assert isinstance(plan.prefill_body["bootstrap_room"], int)


def test_sglang_dp_prefill_aligns_rooms_and_pins_ranks() -> None:
    adapter = SglangAdapter()
    prefill = _prefill(dp=4)
    for rank in range(4):
        plan = adapter.plan(_req(Endpoint.COMPLETIONS, prompt=["a", "b"]), prefill, rank, DECODE)
        assert plan.decode_body is not None
        assert all(room % 4 == rank for room in plan.prefill_body["bootstrap_room"])
        assert plan.prefill_body["routed_dp_rank"] == rank
        assert "disagg_prefill_dp_rank" not in plan.prefill_body
        assert plan.decode_body["disagg_prefill_dp_rank"] == rank
        assert "routed_dp_rank" not in plan.decode_body
        assert plan.decode_body["bootstrap_room"] == plan.prefill_body["bootstrap_room"]


class _EdgeRandom(random.Random):
    def __init__(self, values: list[int]) -> None:
        super().__init__()
        self._values = values

    def getrandbits(self, k: int) -> int:
        return self._values.pop(0)


def test_aligned_room_never_zero_never_above_max() -> None:
    assert aligned_room(_EdgeRandom([0, 5]), 1, 0) == 5  # 0 is "not ready" on decode: redraw
    assert aligned_room(_EdgeRandom([0]), 3, 2) == 2
    top = aligned_room(_EdgeRandom([MAX_ROOM]), 3, 2)
    assert top <= MAX_ROOM and top % 3 == 2
