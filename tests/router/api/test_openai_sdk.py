"""The unmodified openai SDK talks to the router as if it were one engine."""

from __future__ import annotations

import openai
import pytest

from testkit.fake_cluster import FakeClusterFactory


@pytest.mark.parametrize("engine", ["vllm-mooncake", "vllm-nixl", "sglang"])
def test_openai_sdk_chat_stream_and_completion(
    make_cluster: FakeClusterFactory, engine: str
) -> None:
    cluster = make_cluster(engine)
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="sk-test", max_retries=0)
    try:
        stream = client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [c.choices[0].delta.content for c in stream if c.choices]
        assert len("".join(p or "" for p in pieces).split()) == 4
        completion = client.completions.create(model="fake-model", prompt="hi", max_tokens=3)
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        assert [m.id for m in client.models.list()] == ["fake-model"]
    finally:
        client.close()
    assert cluster.prefills[0].records[0].headers["authorization"] == "Bearer sk-test"


def test_openai_sdk_raises_on_prefill_failure(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    cluster.prefills[0].config.fail_status = 500
    client = openai.OpenAI(base_url=cluster.router_url + "/v1", api_key="x", max_retries=0)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="fake-model", prompt="hi", max_tokens=3)
        assert info.value.status_code == 502
        assert "prefill worker" in str(info.value)
    finally:
        client.close()
