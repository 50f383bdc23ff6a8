"""Which decode errors each adapter blames on the prefill: the KV that did not arrive."""

from __future__ import annotations

import pytest

from router.adapters import PDAdapter, SglangAdapter, VllmMooncakeAdapter, VllmNixlAdapter


def _error(message: str) -> bytes:
    return b'{"error": {"message": "%s", "type": "InternalServerError", "code": 500}}' % (
        message.encode()
    )


@pytest.mark.parametrize(
    ("adapter", "message"),
    [
        # P -> D err_msg (protocols.md 3.4), pd-worker, the fake engine
        (VllmMooncakeAdapter(), "Timeout waiting for P side ready."),
        (VllmMooncakeAdapter(), "KV transfer failed: connection reset"),
        (VllmMooncakeAdapter(), "KV pull of xfer-1 timed out after 0.5s"),
        (VllmNixlAdapter(), "KV transfer failed: peer gone"),
        (VllmNixlAdapter(), "NIXL read of req-1 failed (404): unknown request"),
        # SGLang's prepare_abort texts (protocols.md 5.7), pd-worker, the fake engine
        (SglangAdapter(), "Lost connection with prefill instance, bootstrap_addr: 10.0.0.5:8998"),
        (SglangAdapter(), "Decode transfer failed for request rank=0 bootstrap_room=7"),
        (SglangAdapter(), "Decode handshake failed for request rank=0"),
        (SglangAdapter(), "bootstrap_room 7: KV transfer failed (500): gone"),
        (SglangAdapter(), "bootstrap_room 7: KV not received within 20s from http://p"),
    ],
)
def test_a_kv_that_did_not_arrive_is_the_prefills(adapter: PDAdapter, message: str) -> None:
    assert adapter.is_kv_failure(_error(message))
    assert adapter.is_kv_failure(b"data: " + _error(message) + b"\n\n")  # a stream's event


@pytest.mark.parametrize("adapter", [VllmMooncakeAdapter(), VllmNixlAdapter(), SglangAdapter()])
@pytest.mark.parametrize(
    "message",
    [
        "Internal server error",  # vLLM's bare 500: may be the decode's own fault
        "CUDA out of memory",
        "fake engine configured to fail with HTTP 500",
    ],
)
def test_other_decode_errors_are_not(adapter: PDAdapter, message: str) -> None:
    assert not adapter.is_kv_failure(_error(message))


def test_an_unknown_engine_id_is_a_stale_layout_not_a_kv_failure() -> None:
    body = _error("remote engine_id e1 not found from bootstrap server")
    adapter = VllmMooncakeAdapter()
    assert adapter.is_stale_layout(body) and not adapter.is_kv_failure(body)
