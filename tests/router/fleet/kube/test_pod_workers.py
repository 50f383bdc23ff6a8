"""The pod -> worker contract (annotations, readiness, IPv6), on pods deserialized by the client
library from the fake API server's pod JSON; and the fake server's label selectors."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient, V1Pod

from router.fleet.kube.pod_workers import PodSkipped, PodWorker, worker_from_pod
from testkit.fake_kube_api import parse_selector, pod_dict

MakePod = Callable[..., V1Pod]


@pytest.fixture(scope="module")
def v1_pod() -> Iterator[MakePod]:
    """``pod_dict(**kwargs)`` as the client library hands pods to the watcher."""
    loop = asyncio.new_event_loop()

    async def open_client() -> ApiClient:
        return ApiClient()

    api = loop.run_until_complete(open_client())

    def make(**kwargs: Any) -> V1Pod:
        data = pod_dict(kwargs.pop("name", "engine-0"), **kwargs)
        data["metadata"]["uid"] = "uid-0"
        response = SimpleNamespace(data=json.dumps(data))  # what deserialize reads
        pod: V1Pod = api.deserialize(response, "V1Pod")  # type: ignore[arg-type]
        return pod

    yield make
    loop.run_until_complete(api.close())
    loop.close()


PREFILL_ANNOTATIONS = {
    "pd-router.io/http-port": "8100",
    "pd-router.io/bootstrap-port": "8998",
    "pd-router.io/kv-events-port": "5557",
    "pd-router.io/kv-events-replay-port": "5558",
}


def test_a_ready_prefill_pod_is_a_worker_with_its_bootstrap_and_kv_event_endpoints(
    v1_pod: MakePod,
) -> None:
    pod = v1_pod(pod_ip="10.1.2.3", annotations=PREFILL_ANNOTATIONS)
    assert worker_from_pod(pod, "prefill") == PodWorker(
        "prefill",
        "http://10.1.2.3:8100",
        bootstrap_port=8998,
        kv_events="tcp://10.1.2.3:5557",
        kv_events_replay="tcp://10.1.2.3:5558",
    )


def test_ipv6_pod_addresses_are_bracketed(v1_pod: MakePod) -> None:
    worker = worker_from_pod(v1_pod(pod_ip="fd00::12", annotations=PREFILL_ANNOTATIONS), "prefill")
    assert worker is not None
    assert (worker.url, worker.kv_events) == ("http://[fd00::12]:8100", "tcp://[fd00::12]:5557")


def test_the_http_port_defaults_to_the_container_port_named_http(v1_pod: MakePod) -> None:
    ports = [("metrics", 9090), ("http", 8000), ("http", 8001)]
    pod = v1_pod(pod_ip="10.0.0.1", ports=ports)
    assert worker_from_pod(pod, "decode") == PodWorker("decode", "http://10.0.0.1:8000")
    annotated = v1_pod(pod_ip="10.0.0.1", ports=ports, annotations={"pd-router.io/http-port": "7"})
    assert worker_from_pod(annotated, "decode") == PodWorker("decode", "http://10.0.0.1:7")


def test_a_pod_without_an_http_port_is_skipped_naming_the_annotation(v1_pod: MakePod) -> None:
    with pytest.raises(PodSkipped, match="pd-router.io/http-port"):
        worker_from_pod(v1_pod(ports=[("metrics", 9090)]), "decode")


def test_sglang_bootstrap_annotation_is_accepted_and_ours_wins(v1_pod: MakePod) -> None:
    sglang = {"pd-router.io/http-port": "30000", "sglang.ai/bootstrap-port": "8998"}
    worker = worker_from_pod(v1_pod(annotations=sglang), "prefill")
    assert worker is not None and worker.bootstrap_port == 8998
    both = {**sglang, "pd-router.io/bootstrap-port": "9000"}
    worker = worker_from_pod(v1_pod(annotations=both), "prefill")
    assert worker is not None and worker.bootstrap_port == 9000
    worker = worker_from_pod(v1_pod(annotations={"pd-router.io/http-port": "1"}), "prefill")
    assert worker is not None and worker.bootstrap_port is None


def test_bootstrap_namespace_annotation(v1_pod: MakePod) -> None:
    annotations = {"pd-router.io/http-port": "1", "pd-router.io/bootstrap-namespace": "p-0.a_b"}
    worker = worker_from_pod(v1_pod(annotations=annotations), "prefill")
    assert worker is not None and worker.bootstrap_namespace == "p-0.a_b"
    bad = {**annotations, "pd-router.io/bootstrap-namespace": "has space"}
    with pytest.raises(PodSkipped, match="bootstrap-namespace"):
        worker_from_pod(v1_pod(annotations=bad), "prefill")


def test_a_decode_pod_ignores_prefill_only_annotations(v1_pod: MakePod) -> None:
    worker = worker_from_pod(v1_pod(pod_ip="10.0.0.9", annotations=PREFILL_ANNOTATIONS), "decode")
    assert worker == PodWorker("decode", "http://10.0.0.9:8100")


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        ({"ready": False}, "condition Ready is False"),
        ({"phase": "Pending"}, "phase Pending"),
        ({"phase": "Succeeded"}, "phase Succeeded"),
        ({"deleting": True}, "terminating"),
    ],
)
def test_readiness_rules(v1_pod: MakePod, pod: dict[str, Any], why: str) -> None:
    worker = worker_from_pod(v1_pod(ports=[("http", 80)], **pod), "decode")
    assert worker is not None and not worker.ready
    assert worker.not_ready is not None and why in worker.not_ready


def test_a_pod_without_a_ready_condition_is_not_ready(v1_pod: MakePod) -> None:
    pod = v1_pod(ports=[("http", 80)])
    pod.status.conditions = [c for c in pod.status.conditions if c.type != "Ready"]
    worker = worker_from_pod(pod, "decode")
    assert worker is not None and worker.not_ready == "no Ready condition"


def test_a_pod_without_an_ip_is_no_worker_yet(v1_pod: MakePod) -> None:
    assert (
        worker_from_pod(v1_pod(pod_ip=None, ports=[("http", 80)], phase="Pending"), "decode")
        is None
    )


@pytest.mark.parametrize("value", ["http", "0", "65536", "-1", "", " ", "80x", "\u0663", "1e3"])
@pytest.mark.parametrize(
    "key",
    [
        "pd-router.io/http-port",
        "pd-router.io/bootstrap-port",
        "sglang.ai/bootstrap-port",
        "pd-router.io/kv-events-port",
        "pd-router.io/kv-events-replay-port",
    ],
)
def test_a_bad_port_annotation_skips_the_pod_naming_it(
    v1_pod: MakePod, key: str, value: str
) -> None:
    annotations = {"pd-router.io/http-port": "8000", key: value}
    with pytest.raises(PodSkipped, match=key.replace(".", r"\.")):
        worker_from_pod(v1_pod(annotations=annotations), "prefill")


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        ("", [True, True, True, True]),
        ("role=prefill", [True, False, False, False]),
        ("role==prefill,app=llm", [True, False, False, False]),
        ("role!=prefill", [False, True, True, True]),
        ("role", [True, True, False, True]),
        ("!role", [False, False, True, False]),
        ("role in (prefill, decode)", [True, True, False, False]),
        ("role notin (prefill),app", [False, True, True, False]),
        ("app=llm,role in (decode,x),!gpu", [False, True, False, False]),
    ],
)
def test_the_fake_api_server_reads_label_selectors_as_kubernetes_does(
    selector: str, matches: list[bool]
) -> None:
    pods = [
        {"app": "llm", "role": "prefill"},
        {"app": "llm", "role": "decode"},
        {"app": "llm"},
        {"role": "other", "gpu": "a100"},
    ]
    assert [parse_selector(selector)(labels) for labels in pods] == matches


@pytest.mark.parametrize("selector", ["role in prefill", "a=b=c", "(x)", "a in (b"])
def test_the_fake_api_server_refuses_bad_selectors(selector: str) -> None:
    with pytest.raises(ValueError, match="unable to parse"):
        parse_selector(selector)


def test_a_pod_declares_its_models_by_annotation_or_label(v1_pod: MakePod) -> None:
    ports = [("http", 8000)]
    annotated = {"pd-router.io/models": "meta-llama/Llama-3.1-8B, small"}
    pod = v1_pod(pod_ip="10.0.0.1", ports=ports, annotations=annotated)
    worker = worker_from_pod(pod, "decode")
    assert worker is not None and worker.models == ("meta-llama/Llama-3.1-8B", "small")
    labelled = v1_pod(pod_ip="10.0.0.1", ports=ports, labels={"pd-router.io/model": "small"})
    worker = worker_from_pod(labelled, "decode")
    assert worker is not None and worker.models == ("small",)
    worker = worker_from_pod(v1_pod(pod_ip="10.0.0.1", ports=ports), "decode")
    assert worker is not None and worker.models == ()  # the router reads its /v1/models
