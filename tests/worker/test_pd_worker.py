"""pd-worker end to end: KV really moves prefill -> decode through the router (SGLang protocol).

A standalone registry is the prefill's bootstrap API (plain ``/route``, its port is the prefill's
bootstrap port in the router); prefill and decode share one ``LoopbackNetwork`` in this process.
Disaggregated output must equal the co-located (``--role both``) output.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from router.app import create_app as create_router
from testkit.fake_cluster import settings_for
from testkit.polling import wait_until
from testkit.servers import run_server
from transfer.engine.base import TransferEngine
from transfer.engine.fake import LoopbackNetwork
from worker.app import SimWorker, WorkerConfig, create_app
from worker.kv import PoolShape

SHAPE = PoolShape(layers=2, page_size=16, bytes_per_token=64, pages=1024)


def _prompts() -> list[str]:
    rng = random.Random(7)
    lengths = [
        1,
        2,
        15,
        16,
        17,
        31,
        32,
        33,
        100,
        255,
        256,
        257,
        500,
        1000,
        1500,
        2047,
        2048,
        2500,
        3000,
        4000,
    ]
    return ["".join(rng.choice("abcdefghij klmnop") for _ in range(n)) for n in lengths]


def _loopback(network: LoopbackNetwork) -> Any:
    async def factory() -> TransferEngine:
        return network.engine()

    return factory


@contextlib.contextmanager
def pd_cluster() -> Iterator[tuple[str, SimWorker, SimWorker, str]]:
    network = LoopbackNetwork()
    with contextlib.ExitStack() as stack:
        boot = stack.enter_context(run_server(create_registry_app(RegistrySettings())))
        prefill = SimWorker(
            WorkerConfig(
                "prefill", shape=SHAPE, registry=f"127.0.0.1:{boot}", transfer_timeout_s=5.0
            ),
            _loopback(network),
        )
        decode = SimWorker(
            WorkerConfig("decode", shape=SHAPE, transfer_timeout_s=5.0), _loopback(network)
        )
        both = SimWorker(WorkerConfig("both", shape=SHAPE), None)
        p_port = stack.enter_context(run_server(create_app(prefill)))
        d_port = stack.enter_context(run_server(create_app(decode)))
        b_port = stack.enter_context(run_server(create_app(both)))
        settings = settings_for(
            "sglang", [(f"http://127.0.0.1:{p_port}", boot)], [f"http://127.0.0.1:{d_port}"]
        )
        router = f"http://127.0.0.1:{stack.enter_context(run_server(create_router(settings)))}"
        wait_until(lambda: httpx.get(f"{router}/ready").status_code == 200, 10.0, "router ready")
        yield router, prefill, decode, f"http://127.0.0.1:{b_port}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[str, SimWorker, SimWorker, str]]:
    with pd_cluster() as c:
        yield c


def _complete(url: str, prompt: str, **extra: Any) -> dict[str, Any]:
    response = httpx.post(
        f"{url}/v1/completions",
        timeout=20.0,
        json={"model": "sim-model", "prompt": prompt, "max_tokens": 12, **extra},
    )
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def test_disaggregated_equals_colocated(cluster: tuple[str, SimWorker, SimWorker, str]) -> None:
    router, prefill, decode, both = cluster
    for prompt in _prompts():
        pd = _complete(router, prompt)
        ref = _complete(both, prompt)
        assert pd["choices"][0]["text"] == ref["choices"][0]["text"], len(prompt)
        usage = pd["usage"]
        assert usage["prompt_tokens"] == len(prompt)
        pages = -(-len(prompt) // SHAPE.page_size)
        kv = pages * SHAPE.page_size * SHAPE.bytes_per_token * SHAPE.layers
        assert usage["kv_bytes_received"] == kv
    assert prefill.pool.free_pages == decode.pool.free_pages == SHAPE.pages
    assert prefill.sender is not None and prefill.sender.open_rooms == 0


def test_outputs_differ_between_prompts(cluster: tuple[str, SimWorker, SimWorker, str]) -> None:
    router, *_ = cluster
    texts = {_complete(router, p)["choices"][0]["text"] for p in ("alpha", "alphb", "alph")}
    assert len(texts) == 3


def test_streaming_chat_through_the_router(cluster: tuple[str, SimWorker, SimWorker, str]) -> None:
    router, _, _, both = cluster
    body = {
        "model": "sim-model",
        "max_tokens": 8,
        "stream": True,
        "messages": [{"role": "user", "content": "hello there"}],
    }
    text = ""
    with httpx.stream("POST", f"{router}/v1/chat/completions", json=body, timeout=20) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                import json

                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content", "")
    ref = httpx.post(f"{both}/v1/chat/completions", json={**body, "stream": False}).json()
    assert text == ref["choices"][0]["message"]["content"]


def test_too_long_prompt_is_400(cluster: tuple[str, SimWorker, SimWorker, str]) -> None:
    router, prefill, decode, _ = cluster
    response = httpx.post(
        f"{router}/v1/completions", timeout=20, json={"model": "sim-model", "prompt": "x" * 9000}
    )
    assert response.status_code == 400
    wait_until(lambda: decode.pool.free_pages == SHAPE.pages, 10.0, "decode pages released")
