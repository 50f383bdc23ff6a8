"""``--discovery k8s``: the real Kubernetes client against the fake API server (list + watch as
the API server speaks them), driving a ``PodWatcher`` on a real ``RegistryService``; and one
real router process whose workers are fake engines announced as pods."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from registry.backends.memory import MemoryStore
from registry.models import WorkerRecord
from registry.service import RegistryService
from router.fleet.kube.client_config import KubeConfigError, cluster_access
from router.fleet.kube.pod_watch import PodWatcher, open_pod_watcher
from router.server.cli import parse_args
from router.settings import KubernetesDiscoverySettings
from testkit.fake_engine import FakeEngine
from testkit.fake_kube_api import FakeKubeApi, pod_dict
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers
from tests.router.pipeline.test_protocols import COMPLETION

NAMESPACE = "llm"
PREFILL = "app=llm,role=prefill"
DECODE = "app=llm,role in (decode)"
TOKEN = "fake-token"
Records = dict[str, WorkerRecord]  # by URL


def prefill_pod(name: str, ip: str, **kwargs: Any) -> dict[str, Any]:
    annotations = {
        "pd-router.io/http-port": "8100",
        "pd-router.io/bootstrap-port": "8998",
        "pd-router.io/kv-events-port": "5557",
        "pd-router.io/kv-events-replay-port": "5558",
        **kwargs.pop("annotations", {}),
    }
    labels = kwargs.pop("labels", {"app": "llm", "role": "prefill"})
    return pod_dict(
        name, namespace=NAMESPACE, labels=labels, annotations=annotations, pod_ip=ip, **kwargs
    )


def decode_pod(name: str, ip: str, port: int = 8200, **kwargs: Any) -> dict[str, Any]:
    labels = kwargs.pop("labels", {"app": "llm", "role": "decode"})
    namespace = kwargs.pop("namespace", NAMESPACE)
    ports = [("http", port)]
    return pod_dict(name, namespace=namespace, labels=labels, pod_ip=ip, ports=ports, **kwargs)


@dataclass
class Harness:
    kube: FakeKubeApi
    service: RegistryService
    watcher: PodWatcher

    async def records(self) -> Records:
        return {record.url: record for record in await self.service.list_workers()}

    async def wait_for(
        self, predicate: Callable[[Records], bool], what: str, timeout: float = 5.0
    ) -> Records:
        """Poll the registry every 10 ms until ``predicate`` holds (fail naming ``what``)."""
        deadline = time.monotonic() + timeout
        while not predicate(records := await self.records()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}: {records}")
            await asyncio.sleep(0.01)
        return records

    async def wait_kube(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 5.0
        while not predicate():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)


def settings_for(kubeconfig: Path, **overrides: Any) -> KubernetesDiscoverySettings:
    values: dict[str, Any] = {
        "kubeconfig": str(kubeconfig),
        "prefill_selector": PREFILL,
        "decode_selector": DECODE,
        "backoff_s": 0.05,
        "max_backoff_s": 0.2,
        "request_timeout_s": 5.0,
        "watch_timeout_s": 60,
        **overrides,
    }
    return KubernetesDiscoverySettings(**values)


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(token=TOKEN) as server:
        yield server


@contextlib.asynccontextmanager
async def watching(kube: FakeKubeApi, tmp_path: Path, **overrides: Any) -> AsyncIterator[Harness]:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
    store = MemoryStore()
    service = RegistryService(store)
    watcher = await open_pod_watcher(settings_for(kubeconfig, **overrides), service)
    task = asyncio.create_task(watcher.run())
    try:
        harness = Harness(kube, service, watcher)
        roles = sum(1 for s in (PREFILL, overrides.get("decode_selector", DECODE)) if s)
        await harness.wait_kube(lambda: kube.open_watches == roles, "a watch per role")
        yield harness
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await watcher.aclose()
        await store.close()


def draining(url: str) -> Callable[[Records], bool]:
    return lambda records: url in records and records[url].draining


def serving(url: str) -> Callable[[Records], bool]:
    return lambda records: url in records and not records[url].draining


P1, P2 = "http://10.0.0.1:8100", "http://10.0.0.2:8100"
D1, D2 = "http://10.0.1.1:8200", "http://10.0.1.2:8200"


async def test_ready_pods_become_workers_of_their_role(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))  # before the watcher starts: listed
    kube.put_pod(decode_pod("not-llm", "10.9.0.1", labels={"role": "decode"}))
    kube.put_pod(decode_pod("elsewhere", "10.9.0.2", namespace="default"))
    async with watching(kube, tmp_path) as harness:
        kube.put_pod(decode_pod("decode-0", "10.0.1.1"))  # arrives as a watch event
        records = await harness.wait_for(lambda r: P1 in r and D1 in r, "both workers")
        assert set(records) == {P1, D1}, "other labels and namespaces are not workers"
        prefill, decode = records[P1], records[D1]
        assert (prefill.role, prefill.source, prefill.bootstrap_port) == (
            "prefill",
            "kubernetes",
            8998,
        )
        assert (prefill.kv_events, prefill.kv_events_replay) == (
            "tcp://10.0.0.1:5557",
            "tcp://10.0.0.1:5558",
        )
        assert (decode.role, decode.source, decode.bootstrap_port) == ("decode", "kubernetes", None)
        assert harness.watcher.status.as_dict() == {
            "namespace": NAMESPACE,
            "ok": True,
            "error": None,
        }
    assert {(w.namespace, w.label_selector, w.allow_bookmarks) for w in kube.watches} == {
        (NAMESPACE, PREFILL, True),
        (NAMESPACE, DECODE, True),
    }
    assert len(kube.lists) == 2


async def test_a_pod_that_stops_being_ready_is_drained_and_comes_back(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    async with watching(kube, tmp_path) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        await harness.wait_for(serving(P1), "the prefill")
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1", ready=False))
        await harness.wait_for(draining(P1), "the not-Ready prefill draining")
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        await harness.wait_for(serving(P1), "the Ready-again prefill serving")
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1", deleting=True))
        await harness.wait_for(draining(P1), "the terminating prefill draining")


async def test_a_deleted_pod_is_drained(kube: FakeKubeApi, tmp_path: Path) -> None:
    async with watching(kube, tmp_path) as harness:
        kube.put_pod(decode_pod("decode-0", "10.0.1.1"))
        kube.put_pod(decode_pod("decode-1", "10.0.1.2"))
        await harness.wait_for(lambda r: serving(D1)(r) and serving(D2)(r), "two decodes")
        kube.delete_pod("decode-0", NAMESPACE)
        records = await harness.wait_for(draining(D1), "the deleted decode draining")
        assert not records[D2].draining


async def test_a_pod_that_stops_matching_its_selector_is_drained(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    async with watching(kube, tmp_path) as harness:
        kube.put_pod(decode_pod("decode-0", "10.0.1.1"))
        await harness.wait_for(serving(D1), "the decode")
        kube.put_pod(decode_pod("decode-0", "10.0.1.1", labels={"app": "llm", "role": "spare"}))
        await harness.wait_for(draining(D1), "the relabelled decode draining")


async def test_a_bad_annotation_is_logged_once_and_watching_goes_on(
    kube: FakeKubeApi, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="router.fleet.kube")
    bad = {"pd-router.io/bootstrap-port": "bootstrap"}
    async with watching(kube, tmp_path) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1", annotations=bad))
        kube.put_pod(
            prefill_pod(
                "prefill-0",
                "10.0.0.1",
                annotations=bad,
                labels={"app": "llm", "role": "prefill", "touched": "1"},
            )
        )
        kube.put_pod(prefill_pod("prefill-1", "10.0.0.2"))
        records = await harness.wait_for(serving(P2), "the good prefill")
        assert P1 not in records
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))  # fixed
        await harness.wait_for(serving(P1), "the fixed prefill")
    warnings = [r.getMessage() for r in caplog.records if "prefill-0" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "pd-router.io/bootstrap-port='bootstrap' is not a port number" in warnings[0]


async def test_a_list_is_read_page_by_page(kube: FakeKubeApi, tmp_path: Path) -> None:
    for n in range(5):
        kube.put_pod(decode_pod(f"decode-{n}", f"10.0.1.{n + 1}"))
    async with watching(kube, tmp_path, list_page_size=2) as harness:
        records = await harness.wait_for(lambda r: len(r) == 5, "five decodes")
        assert all(not r.draining for r in records.values())
    pages = [r for r in kube.lists if r.label_selector == DECODE]
    assert [(r.limit, r.continue_token is not None) for r in pages] == [
        (2, False),
        (2, True),
        (2, True),
    ]


async def test_a_bookmark_moves_the_resource_version_the_next_watch_starts_from(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    async with watching(kube, tmp_path, decode_selector=None) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        await harness.wait_for(serving(P1), "the prefill")
        seen_rv = kube.resource_version
        for n in range(3):  # other pods move the server's resourceVersion, unseen by this watch
            kube.put_pod(decode_pod(f"decode-{n}", f"10.0.1.{n + 1}"))
        bookmark_rv = kube.resource_version
        assert bookmark_rv > seen_rv
        kube.send_bookmark()
        kube.end_watches()
        await harness.wait_kube(lambda: len(kube.watches) == 2, "a second watch")
    assert [w.resource_version for w in kube.watches][-1] == str(bookmark_rv)
    assert len(kube.lists) == 1


async def test_an_ended_watch_resumes_from_its_resource_version_without_a_list(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    async with watching(kube, tmp_path, decode_selector=None) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        await harness.wait_for(serving(P1), "the prefill")
        rv = kube.resource_version
        kube.end_watches()
        await harness.wait_kube(lambda: len(kube.watches) == 2, "a second watch")
        kube.put_pod(prefill_pod("prefill-1", "10.0.0.2"))
        await harness.wait_for(serving(P2), "the prefill added after the re-watch")
    assert kube.watches[1].resource_version == str(rv)
    assert len(kube.lists) == 1


@pytest.mark.parametrize("as_http_status", [False, True], ids=["error-event", "http-410"])
async def test_an_expired_watch_lists_again_and_drains_pods_gone_meanwhile(
    kube: FakeKubeApi, tmp_path: Path, as_http_status: bool
) -> None:
    kube.expire_with_http_status = as_http_status
    async with watching(kube, tmp_path, decode_selector=None) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        kube.put_pod(prefill_pod("prefill-1", "10.0.0.2"))
        await harness.wait_for(lambda r: serving(P1)(r) and serving(P2)(r), "two prefills")
        kube.block_watches()  # the watch breaks; meanwhile one pod goes and history is lost
        kube.delete_pod("prefill-0", NAMESPACE)
        kube.compact()
        await harness.wait_kube(lambda: len(kube.watches) == 2, "a held re-watch")
        kube.unblock_watches()
        records = await harness.wait_for(draining(P1), "the pod deleted meanwhile draining")
        assert not records[P2].draining
        await harness.wait_kube(lambda: len(kube.watches) == 3, "a watch after the re-list")
    assert kube.expired_answers == 1
    assert len(kube.lists) == 2
    assert kube.watches[2].resource_version == str(kube.resource_version)


async def test_an_api_server_restart_is_survived_and_changes_meanwhile_picked_up(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    async with watching(kube, tmp_path, decode_selector=None) as harness:
        kube.put_pod(prefill_pod("prefill-0", "10.0.0.1"))
        await harness.wait_for(serving(P1), "the prefill")
        await asyncio.to_thread(kube.stop)
        status = harness.watcher.status
        refused = "prefill pods: Cannot connect to host"  # aiohttp's connection refused
        await harness.wait_kube(
            lambda: not status.ok and refused in (status.error or ""), "the outage in the status"
        )
        kube.delete_pod("prefill-0", NAMESPACE)
        kube.put_pod(prefill_pod("prefill-1", "10.0.0.2"))
        await asyncio.to_thread(kube.start)
        records = await harness.wait_for(
            lambda r: draining(P1)(r) and serving(P2)(r), "the changes made while down"
        )
        assert len(records) == 2
        await harness.wait_kube(lambda: status.ok and status.error is None, "status ok again")


async def test_the_namespace_comes_from_the_flag_or_the_kubeconfig_context(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace="team-a")
    assert (await cluster_access(settings_for(kubeconfig))).namespace == "team-a"
    flagged = settings_for(kubeconfig, namespace="team-b")
    assert (await cluster_access(flagged)).namespace == "team-b"
    plain = kube.write_kubeconfig(tmp_path / "plain")
    assert (await cluster_access(settings_for(plain))).namespace == "default"


async def test_a_missing_kubeconfig_or_cluster_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="kubeconfig .*/missing: no such file"):
        await cluster_access(settings_for(tmp_path / "missing"))
    in_pod = KubernetesDiscoverySettings(prefill_selector="a", decode_selector="b", in_cluster=True)
    with pytest.raises(KubeConfigError, match="in-cluster"):
        await cluster_access(in_pod)


# ---------------------------------------------------------------------------- end to end


def _ready(url: str) -> int:
    return httpx.get(url + "/ready", timeout=2).status_code


def test_a_router_process_routes_to_pods_and_follows_their_readiness(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    prefill = FakeEngine("prefill", "vllm-mooncake")
    decode = FakeEngine("decode", "vllm-mooncake")
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NAMESPACE)
    with run_servers(prefill.app, prefill.bootstrap_app, decode.app) as (p, b, d):
        annotations = {"pd-router.io/http-port": str(p), "pd-router.io/bootstrap-port": str(b)}
        prefill_ready = prefill_pod("prefill-0", "127.0.0.1", annotations=annotations)
        kube.put_pod(prefill_ready)
        kube.put_pod(decode_pod("decode-0", "127.0.0.1", port=d))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        argv = [
            *(sys.executable, "-m", "router", "--port", str(port), "--engine", "vllm-mooncake"),
            *("--discovery", "k8s", "--k8s-kubeconfig", str(kubeconfig)),
            *("--k8s-prefill-selector", PREFILL, "--k8s-decode-selector", DECODE),
            *("--health-interval", "0.2"),
        ]
        with http_process(argv, url, timeout=30) as process:
            wait_until(lambda: _ready(url) == 200, 10, "the router ready with the pods' engines")
            body = httpx.get(url + "/ready", timeout=2).json()
            assert body["kubernetes"] == {"namespace": NAMESPACE, "ok": True, "error": None}
            assert (
                httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
            )
            kube.put_pod(
                prefill_pod("prefill-0", "127.0.0.1", annotations=annotations, ready=False)
            )
            wait_until(lambda: _ready(url) == 503, 5, "no prefill once its pod is not Ready")
            kube.put_pod(prefill_ready)
            wait_until(lambda: _ready(url) == 200, 10, "ready again with the pod Ready")
            assert (
                httpx.post(url + "/v1/completions", json=COMPLETION, timeout=10).status_code == 200
            )
            process.terminate()
            output, _ = process.communicate(timeout=15)
    assert "Traceback" not in output, output
    assert "pod llm/prefill-0" in output


def test_discovery_k8s_needs_a_selector_per_role(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--discovery", "k8s", "--k8s-prefill-selector", PREFILL])
    assert exited.value.code == 2
    assert "argument --discovery: k8s needs a label selector per role: --k8s-decode-selector" in (
        capsys.readouterr().err
    )
    settings = parse_args(
        ["--discovery", "k8s", "--k8s-prefill-selector", PREFILL, "--k8s-decode-selector", DECODE]
    )
    assert (settings.discovery, settings.kubernetes.decode_selector) == ("k8s", DECODE)


def test_the_fake_api_server_streams_watches_as_the_api_server_does(kube: FakeKubeApi) -> None:
    kube.put_pod(decode_pod("decode-0", "10.0.1.1"))
    headers = {"authorization": f"Bearer {TOKEN}"}
    pods = f"{kube.url}/api/v1/namespaces/{NAMESPACE}/pods"
    listed = httpx.get(pods, headers=headers).json()
    assert listed["kind"] == "PodList" and "kind" not in listed["items"][0]
    old = listed["metadata"]["resourceVersion"]
    kube.put_pod(decode_pod("decode-1", "10.0.1.2"))
    query = {"watch": "true", "resourceVersion": old, "timeoutSeconds": "1"}
    with httpx.stream("GET", pods, params=query, headers=headers) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        first = json.loads(next(response.iter_lines()))  # replayed since ``old``
    assert (first["type"], first["object"]["kind"]) == ("ADDED", "Pod")
    assert first["object"]["metadata"]["name"] == "decode-1"
    kube.compact()
    with httpx.stream("GET", pods, params=query, headers=headers) as response:
        (error,) = [json.loads(line) for line in response.iter_lines()]
    assert response.status_code == 200 and error["type"] == "ERROR"
    assert error["object"] | {"message": ""} == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "",
        "reason": "Expired",
        "code": 410,
    }
    assert error["object"]["message"].startswith(f"too old resource version: {old} (")
    assert httpx.get(pods, params=query).status_code == 401
