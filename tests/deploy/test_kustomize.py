"""deploy/k8s: every kustomization renders with the real kustomize (kubectl's), every object is
valid for Kubernetes 1.32 (strict) or its CRD, and the manifests cannot drift from the code.

Drift checks, per overlay: the router's args are parsed by the router's own parser
(``router.server.cli.parse_args``, with the container's ``PDR_*`` env), and its pod selectors are
applied
(with the API server's label-selector semantics) to the rendered pod templates, the labels a
LeaderWorkerSet's controller adds included. Each workload a selector picks must be an engine of
that role speaking the router's ``--engine`` protocol (vLLM's connector and ``kv_role``, SGLang's
``--disaggregation-mode``, pd-worker's ``--role``/``--protocol``), and the annotations the router
reads must equal what the engine is told (HTTP port, bootstrap port, KV event ports per DP rank),
all declared as container ports; ``router.fleet.kube.pod_workers.worker_from_pod`` (what the router
does
with a Ready pod) on a pod made from each template must give the engine's address. GPUs match the
parallelism flags, engine keep-alives outlast the router's pooled connections, one ConfigMap names
the model. Components render through an overlay of the base.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from ipaddress import ip_address, ip_network
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest
import uvicorn
import yaml
from kubernetes_asyncio.client import ApiClient, V1Pod

import registry.__main__ as registry_main
from router.fleet.kube.pod_workers import PodWorker, worker_from_pod
from router.server.cli import parse_args as parse_router_args
from router.settings import RouterSettings
from testkit.fake_kube_api import parse_selector
from tests.deploy.rendered import (
    K8S,
    OBSERVABILITY,
    POD_IP,
    Container,
    CrdSchemas,
    Doc,
    PodTemplate,
    find,
    flag,
    is_component,
    kustomization_dirs,
    pod_templates,
    references,
    render,
    render_with_components,
)
from worker.__main__ import parse_args as parse_worker_args

BASE = K8S / "base"
DIRS = kustomization_dirs()
OVERLAYS = [d for d in DIRS if d.parent == K8S / "overlays"]
WITH_ROUTER = [d for d in DIRS if d != OBSERVABILITY]
ROUTER = "Deployment/pd-router"
CONNECTOR_PROTOCOL = {"MooncakeConnector": "vllm-mooncake", "NixlConnector": "vllm-nixl"}
KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
UVICORN_KEEP_ALIVE_S = 5.0  # the engines' HTTP servers' default idle keep-alive


def _id(directory: Path) -> str:
    return str(directory.relative_to(K8S.parent))


def _in_base(component: Path) -> bool:
    listed = yaml.safe_load((BASE / "kustomization.yaml").read_text()).get("components", [])
    return any((BASE / c).resolve() == component for c in listed)


class Renders:
    """Each directory rendered once per session; a Component through an overlay of the base."""

    def __init__(self, workdir: Path) -> None:
        self._workdir = workdir
        self._docs: dict[Path, list[Doc]] = {}

    def __call__(self, directory: Path) -> list[Doc]:
        if directory not in self._docs:
            if is_component(directory) and _in_base(directory):
                self._docs[directory] = self(BASE)
            elif is_component(directory):
                overlay = self._workdir / directory.name
                self._docs[directory] = render_with_components(BASE, [directory], overlay)
            else:
                self._docs[directory] = render(directory)
        return self._docs[directory]


@pytest.fixture(scope="session")
def renders(tmp_path_factory: pytest.TempPathFactory) -> Renders:
    return Renders(tmp_path_factory.mktemp("kustomize"))


@pytest.fixture(scope="session")
def crds() -> CrdSchemas:
    return CrdSchemas.load()


def _template(docs: Sequence[Doc], workload: str) -> PodTemplate:
    return next(t for t in pod_templates(docs) if t.workload == workload)


def _router(docs: Sequence[Doc]) -> Container:
    return next(c for c in _template(docs, ROUTER).containers(docs) if c.name == "router")


@pytest.fixture
def router_settings(monkeypatch: pytest.MonkeyPatch) -> Callable[[Container], RouterSettings]:
    """The router's settings as its container gets them: the args through the router's parser,
    on top of the container's ``PDR_*`` environment (and nothing from this process's)."""

    def parse(router: Container) -> RouterSettings:
        for name in [n for n in os.environ if n.startswith("PDR_")]:
            monkeypatch.delenv(name)
        for name, value in router.env.items():
            monkeypatch.setenv(name, value)
        try:
            return parse_router_args(router.argv)
        except SystemExit as exc:
            pytest.fail(f"router args {router.argv} rejected (exit {exc.code}); see stderr")

    return parse


# ------------------------------------------------------------------------- render + schemas


@pytest.mark.parametrize("directory", DIRS, ids=_id)
def test_renders_distinct_objects(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    assert docs, f"{_id(directory)} renders nothing"
    keys = [(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), f"duplicate objects: {sorted(keys)}"


@pytest.mark.parametrize("directory", DIRS, ids=_id)
def test_every_object_validates(directory: Path, renders: Renders, crds: CrdSchemas) -> None:
    """Strict schemas: an unknown or misplaced field fails, as does a kind nobody defines."""
    failures = []
    for doc in renders(directory):
        try:
            crds.validate(doc)
        except Exception as exc:  # noqa: BLE001 - collect every object's failure, then fail
            path = "/".join(str(p) for p in getattr(exc, "absolute_path", []))
            message = getattr(exc, "message", None) or str(exc)
            failures.append(f"{doc['kind']}/{doc['metadata']['name']} {path}: {message}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("directory", DIRS, ids=_id)
def test_images_are_pinned(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    for template in pod_templates(docs):
        for container in template.all_containers(docs):
            image = container.spec["image"]
            name, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "")
            assert tag and tag != "latest", f"{template.workload}: image {image!r} not pinned"
            assert name


@pytest.mark.parametrize("directory", DIRS, ids=_id)
def test_references_resolve(directory: Path, renders: Renders) -> None:
    """ConfigMaps, service accounts, named probe ports and ``$(VAR)``s a pod uses exist: what
    would otherwise leave a pod in CreateContainerConfigError or run it with a literal $(X)."""
    docs = renders(directory)
    for template in pod_templates(docs):
        where = template.workload
        account = template.spec.get("serviceAccountName")
        assert account is None or find(docs, "ServiceAccount", account), f"{where}: {account}"
        for volume in template.spec.get("volumes", []):
            if "configMap" in volume:
                assert find(docs, "ConfigMap", volume["configMap"]["name"]), f"{where}: {volume}"
        for container in template.all_containers(docs):
            _check_container_references(docs, where, container)


def _check_container_references(docs: Sequence[Doc], where: str, container: Container) -> None:
    defined = set(container.pod.injected_env)
    for item in container.spec.get("env", []):
        for name in references(item.get("value", "")):
            assert name in defined, f"{where}: env {item['name']} uses $({name}) before it is set"
        ref = item.get("valueFrom", {}).get("configMapKeyRef")
        if ref and not ref.get("optional"):
            maps = find(docs, "ConfigMap", ref["name"])
            assert maps and ref["key"] in maps[0].get("data", {}), f"{where}: {ref} missing"
        defined.add(item["name"])
    for item in [*container.spec.get("command", []), *container.spec.get("args", [])]:
        for name in references(item):
            assert name in defined, f"{where}/{container.name}: $({name}) is never set"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        port = container.spec.get(probe, {}).get("httpGet", {}).get("port")
        if isinstance(port, str):
            assert port in container.ports(), f"{where}/{container.name}: {probe} port {port}"


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_services_and_budgets_select_pods(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    templates = pod_templates(docs)
    for kind in ("Service", "PodDisruptionBudget"):
        for doc in find(docs, kind):
            selector = doc["spec"]["selector"]
            labels = selector.get("matchLabels", selector) if kind != "Service" else selector
            picked = [t for t in templates if labels.items() <= t.labels.items()]
            assert picked, f"{kind}/{doc['metadata']['name']} selects no pod template"
            if kind == "Service":
                for port in doc["spec"]["ports"]:
                    target = port.get("targetPort", port["port"])
                    for template in picked:
                        containers = template.all_containers(docs)
                        names = {n for c in containers for n in c.ports()}
                        numbers = {n for c in containers for n in c.port_numbers()}
                        assert target in names | numbers, (
                            f"Service/{doc['metadata']['name']} port {target} not on "
                            f"{template.workload}"
                        )


# --------------------------------------------------------------------------------- router


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_router_command_line(
    directory: Path, renders: Renders, router_settings: Callable[[Container], RouterSettings]
) -> None:
    """The router's own parser accepts the args; k8s discovery with a selector per role; the
    pod outlives the router's graceful shutdown; the admin token comes from a Secret."""
    docs = renders(directory)
    router = _router(docs)
    settings = router_settings(router)
    assert settings.discovery == "k8s"
    assert settings.server.host == "0.0.0.0"
    assert settings.server.port == router.ports()["http"]
    pod = router.pod.spec
    hooks = router.spec.get("lifecycle", {})
    pre_stop = hooks.get("preStop", {}).get("sleep", {}).get("seconds", 0)
    grace = settings.server.graceful_shutdown_s + pre_stop
    assert pod["terminationGracePeriodSeconds"] > grace, "SIGKILL before the shutdown grace ends"
    token = next(e for e in router.spec["env"] if e["name"] == "PDR_REGISTRY__ADMIN_TOKEN")
    assert "secretKeyRef" in token["valueFrom"], "the admin token must come from a Secret"


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_router_pod_is_hardened_and_probed(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    router = _router(docs)
    pod, spec = router.pod.spec, router.spec
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    context = spec["securityContext"]
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]], "a read-only root needs a writable /tmp"
    assert spec["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert spec["livenessProbe"]["httpGet"]["path"] == "/health"
    assert spec["startupProbe"]["httpGet"]["path"] == "/health"
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= spec["resources"][kind].keys()


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_router_is_available_and_spread(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    template = _template(docs, ROUTER)
    assert find(docs, "Deployment", "pd-router")[0]["spec"]["replicas"] >= 2
    budgets = [
        b
        for b in find(docs, "PodDisruptionBudget")
        if b["spec"]["selector"]["matchLabels"].items() <= template.labels.items()
    ]
    assert [b["spec"].get("minAvailable") for b in budgets] == [1]
    spread = template.spec["topologySpreadConstraints"]
    assert "kubernetes.io/hostname" in {s["topologyKey"] for s in spread}
    for constraint in spread:
        assert constraint["labelSelector"]["matchLabels"].items() <= template.labels.items()
    anti = template.spec["affinity"]["podAntiAffinity"]
    terms = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_router_replicas_find_and_follow_each_other(
    directory: Path, renders: Renders, router_settings: Callable[[Container], RouterSettings]
) -> None:
    """Each replica publishes on its pod IP and finds the others through a headless Service
    that lists every router pod, ready or not, on that port; the token comes from a Secret."""
    docs = renders(directory)
    router = _router(docs)
    replicas = router_settings(router).replicas
    port = router.ports()["replica-sync"]
    assert replicas.listen == f"{POD_IP}:{port}"  # its own address: left out of the peers
    assert replicas.peers_dns is not None
    name, _, dns_port = replicas.peers_dns.rpartition(":")
    (service,) = find(docs, "Service", name)
    spec = service["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is True
    assert spec["selector"].items() <= _template(docs, ROUTER).labels.items()
    assert [(p["port"], p["targetPort"]) for p in spec["ports"]] == [
        (int(dns_port), "replica-sync")
    ]
    token = next(e for e in router.spec["env"] if e["name"] == "PDR_REPLICAS__TOKEN")
    assert "secretKeyRef" in token["valueFrom"], "the replicas' token must come from a Secret"
    assert replicas.id == "pod-0"  # the pod's name: unique among the replicas


@pytest.mark.parametrize("directory", WITH_ROUTER, ids=_id)
def test_router_may_watch_pods(directory: Path, renders: Renders) -> None:
    """The router's service account is bound to a Role granting pods get, list and watch."""
    docs = renders(directory)
    template = _template(docs, ROUTER)
    account, namespace = template.spec["serviceAccountName"], template.namespace
    granted: set[str] = set()
    for binding in find(docs, "RoleBinding"):
        subject = {"kind": "ServiceAccount", "name": account, "namespace": namespace}
        if subject not in binding["subjects"] or binding["roleRef"]["kind"] != "Role":
            continue
        for role in find(docs, "Role", binding["roleRef"]["name"]):
            for rule in role["rules"]:
                if "" in rule["apiGroups"] and "pods" in rule["resources"]:
                    granted |= set(rule["verbs"])
    assert {"get", "list", "watch"} <= granted
    assert template.spec.get("automountServiceAccountToken", True) is True


# -------------------------------------------------------------------------------- engines


@dataclass
class Engine:
    """The engine a container runs (vLLM, SGLang or pd-worker), read from its command line."""

    container: Container
    kind: str
    docs: Sequence[Doc]

    @property
    def argv(self) -> list[str]:
        return self.container.argv

    def arg(self, *names: str, default: str | None = None) -> str | None:
        value = flag(self.argv, *names)
        return default if value is None else value

    def int_arg(self, *names: str, default: int) -> int:
        return int(self.arg(*names, default=str(default)) or default)

    def json_arg(self, name: str) -> dict[str, Any]:
        text = self.arg(name)
        return {} if text is None else dict(json.loads(text))

    def role(self) -> str | None:
        if self.kind == "vllm":
            return KV_ROLE.get(self.json_arg("--kv-transfer-config").get("kv_role", ""))
        if self.kind == "sglang":
            return self.arg("--disaggregation-mode")
        return self.arg("--role")

    def protocol(self) -> str | None:
        if self.kind == "vllm":
            connector = self.json_arg("--kv-transfer-config").get("kv_connector", "")
            return CONNECTOR_PROTOCOL.get(connector)
        if self.kind == "sglang":
            return "sglang"
        return self.arg("--protocol", default="sglang")

    def http_port(self) -> int:
        defaults = {"vllm": 8000, "sglang": 30000, "pd-worker": 30000}
        return self.int_arg("--port", default=defaults[self.kind])

    def bootstrap_port(self) -> int | None:
        """Where decoders and the router find this prefill's bootstrap server (None: none)."""
        if self.role() != "prefill" or self.protocol() == "vllm-nixl":
            return None
        if self.kind == "vllm":
            return int(self.container.env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", 8998))
        if self.kind == "sglang":
            return self.int_arg("--disaggregation-bootstrap-port", default=8998)
        return self._sidecar_registry_port()

    def _sidecar_registry_port(self) -> int | None:
        """pd-worker registers with --registry: a ``registry serve`` next to it in the pod."""
        target = urlsplit("//" + (self.arg("--registry") or ""))
        if target.hostname not in ("127.0.0.1", "localhost"):
            return None
        for other in self.container.pod.containers(self.docs):
            if other.argv[:2] == ["registry", "serve"]:
                port = int(flag(other.argv, "--port") or 8998)
                return port if port == target.port else None
        return None

    def kv_event_ports(self) -> tuple[int, int | None] | None:
        config = self.json_arg("--kv-events-config")
        enabled = config.get("publisher") == "zmq" and config.get("enable_kv_cache_events", True)
        if not enabled:
            return None
        replay = config.get("replay_endpoint")
        return _tcp_port(config["endpoint"]), None if replay is None else _tcp_port(replay)

    def parallel(self) -> tuple[int, int, int]:
        """(tensor, data, pipeline) parallel sizes."""
        if self.kind == "vllm":
            return (
                self.int_arg("--tensor-parallel-size", "-tp", default=1),
                self.int_arg("--data-parallel-size", "-dp", default=1),
                self.int_arg("--pipeline-parallel-size", "-pp", default=1),
            )
        if self.kind == "sglang":
            return (
                self.int_arg("--tp-size", "--tp", default=1),
                self.int_arg("--dp-size", "--dp", default=1),
                self.int_arg("--pp-size", "--pp", default=1),
            )
        return 1, self.int_arg("--dp", default=1), 1

    def nodes(self) -> int:
        return self.int_arg("--nnodes", default=1) if self.kind == "sglang" else 1

    def keep_alive_s(self) -> float:
        name = {"vllm": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "sglang": "SGLANG_TIMEOUT_KEEP_ALIVE"}
        value = self.container.env.get(name.get(self.kind, ""))
        return UVICORN_KEEP_ALIVE_S if value is None else float(value)

    def model(self) -> str | None:
        if self.kind == "vllm":
            return self.argv[2] if self.argv[:2] == ["vllm", "serve"] else self.arg("--model")
        return self.arg("--model-path") if self.kind == "sglang" else self.arg("--model")


def _tcp_port(endpoint: str) -> int:
    port = urlsplit(endpoint).port
    assert port is not None, f"{endpoint!r}: no port"
    return port


def _engine(container: Container, docs: Sequence[Doc]) -> Engine | None:
    argv = container.argv
    if argv[:2] == ["vllm", "serve"] or "vllm.entrypoints.openai.api_server" in argv:
        kind = "vllm"
    elif "sglang.launch_server" in argv:
        kind = "sglang"
    elif argv[:1] == ["pd-worker"]:
        kind = "pd-worker"
    else:
        return None
    return Engine(container, kind, docs)


def _engines(docs: Sequence[Doc], template: PodTemplate) -> list[Engine]:
    return [e for c in template.containers(docs) if (e := _engine(c, docs)) is not None]


@dataclass
class Cluster:
    """An overlay's router settings and the engines each of its selectors picks."""

    settings: RouterSettings
    docs: list[Doc]
    picked: dict[str, list[PodTemplate]]

    def engines(self, role: str) -> Iterator[Engine]:
        for template in self.picked[role]:
            engines = _engines(self.docs, template)
            assert len(engines) == 1, f"{template.workload}: {len(engines)} engine containers"
            yield engines[0]


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    renders: Renders,
    router_settings: Callable[[Container], RouterSettings],
) -> Cluster:
    docs = renders(request.param)
    settings = router_settings(_router(docs))
    selectors = {
        "prefill": settings.kubernetes.prefill_selector,
        "decode": settings.kubernetes.decode_selector,
    }
    picked = {}
    for role, text in selectors.items():
        assert text, f"no {role} selector"
        matches = parse_selector(text)
        picked[role] = [t for t in pod_templates(docs) if matches(t.labels)]
    return Cluster(settings, docs, picked)


overlay_clusters = pytest.mark.parametrize("cluster", OVERLAYS, ids=_id, indirect=True)


@overlay_clusters
def test_selectors_pick_engines_of_their_role(cluster: Cluster) -> None:
    """Each selector picks at least one workload, no workload is picked twice, and each one
    picked runs an engine of that role (LWS: leaders only, never the worker pods)."""
    prefills, decodes = cluster.picked["prefill"], cluster.picked["decode"]
    assert prefills and decodes, f"picked: {cluster.picked}"
    both = {t.workload for t in prefills} & {t.workload for t in decodes}
    assert not both, f"picked by both selectors: {both}"
    for role in ("prefill", "decode"):
        for template, engine in zip(cluster.picked[role], cluster.engines(role), strict=True):
            assert engine.role() == role, f"{template.workload} runs a {engine.role()} engine"
            assert "[worker]" not in template.workload, f"{template.workload} serves no HTTP"


@overlay_clusters
def test_engines_speak_the_routers_protocol(cluster: Cluster) -> None:
    """MooncakeConnector <-> vllm-mooncake, NixlConnector <-> vllm-nixl, SGLang <-> sglang."""
    protocol = cluster.settings.engine.value
    for role in ("prefill", "decode"):
        for engine in cluster.engines(role):
            assert engine.protocol() == protocol, f"{engine.container.pod.workload}: {role}"


@overlay_clusters
def test_annotations_match_engine_ports(cluster: Cluster) -> None:
    """What the router reads from a pod is what the engine is told, and every port is declared:
    HTTP (annotation and the port named http), bootstrap, KV events and replay per DP rank."""
    for role in ("prefill", "decode"):
        for engine in cluster.engines(role):
            template, where = engine.container.pod, engine.container.pod.workload
            annotations = template.annotations
            declared = {p for c in template.containers(cluster.docs) for p in c.port_numbers()}
            http = engine.http_port()
            assert engine.container.ports().get("http") == http, f"{where}: port 'http'"
            assert annotations.get("pd-router.io/http-port", str(http)) == str(http), where
            if role == "decode":
                continue
            bootstrap = engine.bootstrap_port()
            if cluster.settings.engine.value != "vllm-nixl":
                assert bootstrap is not None, f"{where}: no bootstrap server"
                assert annotations.get("pd-router.io/bootstrap-port") == str(bootstrap), where
                assert bootstrap in declared, f"{where}: bootstrap port {bootstrap} not declared"
            events = engine.kv_event_ports()
            if events is None:
                assert "pd-router.io/kv-events-port" not in annotations, where
                continue
            live, replay = events
            assert annotations.get("pd-router.io/kv-events-port") == str(live), where
            assert annotations.get("pd-router.io/kv-events-replay-port") == str(replay), where
            for rank in range(engine.parallel()[1]):  # DP rank r publishes on port + r
                assert live + rank in declared, f"{where}: KV events of DP rank {rank}"
                assert replay is None or replay + rank in declared, f"{where}: replay {rank}"


@pytest.fixture(scope="module")
def make_v1_pod() -> Iterator[Callable[[dict[str, Any]], V1Pod]]:
    """A pod dict as the client library hands it to the router's watcher (its deserializer;
    the client itself needs an event loop to exist)."""
    loop = asyncio.new_event_loop()

    async def open_client() -> ApiClient:
        return ApiClient()

    api = loop.run_until_complete(open_client())

    def make(data: dict[str, Any]) -> V1Pod:
        response = SimpleNamespace(data=json.dumps(data))
        pod: V1Pod = api.deserialize(response, "V1Pod")  # type: ignore[arg-type]
        return pod

    yield make
    loop.run_until_complete(api.close())
    loop.close()


def _ready_pod(template: PodTemplate) -> dict[str, Any]:
    name = template.workload.split("/")[1].split("[")[0] + "-0"
    return {
        "metadata": {
            "name": name,
            "namespace": template.namespace,
            "labels": dict(template.labels),
            "annotations": dict(template.annotations),
        },
        "spec": template.spec,
        "status": {
            "phase": "Running",
            "podIP": POD_IP,
            "podIPs": [{"ip": POD_IP}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }


@overlay_clusters
def test_router_sees_each_pod_as_its_engine(
    cluster: Cluster, make_v1_pod: Callable[[dict[str, Any]], V1Pod]
) -> None:
    """``worker_from_pod`` on a Ready pod of each template: the engine's URL, bootstrap port
    and KV event endpoints, at the pod's IP."""
    for role in ("prefill", "decode"):
        for engine in cluster.engines(role):
            template = engine.container.pod
            worker = worker_from_pod(make_v1_pod(_ready_pod(template)), role)
            expected = PodWorker(role, f"http://{POD_IP}:{engine.http_port()}")
            events = engine.kv_event_ports() if role == "prefill" else None
            if role == "prefill":
                expected = PodWorker(
                    "prefill",
                    expected.url,
                    bootstrap_port=engine.bootstrap_port(),
                    kv_events=None if events is None else f"tcp://{POD_IP}:{events[0]}",
                    kv_events_replay=(
                        None
                        if events is None or events[1] is None
                        else f"tcp://{POD_IP}:{events[1]}"
                    ),
                )
            assert worker == expected, template.workload


def _all_engines(docs: Sequence[Doc]) -> list[Engine]:
    return [e for t in pod_templates(docs) for e in _engines(docs, t)]


@pytest.mark.parametrize("directory", OVERLAYS, ids=_id)
def test_gpus_match_parallelism(directory: Path, renders: Renders) -> None:
    """GPUs per pod x nodes == TP x DP x PP; a multi-node engine's --nnodes/--node-rank are its
    LeaderWorkerSet group's; the simulated engines ask for no GPU."""
    docs = renders(directory)
    for engine in _all_engines(docs):
        where = engine.container.pod.workload
        gpus = engine.container.resource_limit("nvidia.com/gpu")
        tp, dp, pp = engine.parallel()
        if engine.kind == "pd-worker":
            assert gpus == 0, where
            continue
        assert gpus * engine.nodes() == tp * dp * pp, f"{where}: {gpus} GPUs, TP{tp} DP{dp} PP{pp}"
        injected = engine.container.pod.injected_env
        if injected:
            assert engine.nodes() == int(injected["LWS_GROUP_SIZE"]), where
            assert engine.arg("--node-rank") == injected["LWS_WORKER_INDEX"], where


@overlay_clusters
def test_engines_keep_connections_longer_than_the_router(cluster: Cluster) -> None:
    """The router reuses a pooled connection only while the engine still keeps it open."""
    for role in ("prefill", "decode"):
        for engine in cluster.engines(role):
            assert engine.keep_alive_s() > cluster.settings.upstream.keepalive_s, (
                engine.container.pod.workload
            )


@pytest.mark.parametrize("directory", OVERLAYS, ids=_id)
def test_one_configmap_names_the_model(directory: Path, renders: Renders) -> None:
    docs = renders(directory)
    models = set()
    for engine in _all_engines(docs):
        model_env = next(e for e in engine.container.spec["env"] if e["name"] == "MODEL")
        assert model_env["valueFrom"]["configMapKeyRef"]["key"] == "MODEL"
        assert engine.model() == engine.container.env["MODEL"], engine.container.pod.workload
        models.add((model_env["valueFrom"]["configMapKeyRef"]["name"], engine.model()))
    assert len(models) == 1, f"engines disagree on the model: {models}"


@pytest.mark.parametrize("directory", OVERLAYS, ids=_id)
def test_gpu_engines_have_rdma_shm_and_slow_start(directory: Path, renders: Renders) -> None:
    """Real engines: Mooncake over RDMA (the NIC resource, IPC_LOCK to pin memory), /dev/shm in
    memory, readiness on /health and a startup probe that allows a long model load; NIXL knows
    its pod IP."""
    docs = renders(directory)
    for engine in [e for e in _all_engines(docs) if e.kind != "pd-worker"]:
        spec, where = engine.container.spec, engine.container.pod.workload
        limits = spec["resources"]["limits"]
        assert any(k.startswith("rdma/") for k in limits), f"{where}: no RDMA resource"
        assert "IPC_LOCK" in spec["securityContext"]["capabilities"]["add"], where
        extra = engine.json_arg("--kv-transfer-config").get("kv_connector_extra_config", {})
        if engine.protocol() == "vllm-mooncake":
            assert extra.get("mooncake_protocol") == "rdma", where
        if engine.protocol() == "vllm-nixl":
            assert engine.container.env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == POD_IP, where
            assert int(engine.container.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]) in (
                engine.container.port_numbers()
            ), where
        mounts = {m["mountPath"]: m["name"] for m in spec["volumeMounts"]}
        volumes = {v["name"]: v for v in engine.container.pod.spec["volumes"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory", where
        if engine.container.ports().get("http") is None:
            continue  # an LWS worker pod: no HTTP server
        assert spec["readinessProbe"]["httpGet"]["path"] == "/health", where
        startup = spec["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, where


# ----------------------------------------------------------------------------- simulation


def test_sim_workers_and_bootstrap_sidecar_parse(
    renders: Renders, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulated pods run pd-worker and ``registry serve`` with flags their own parsers
    accept; the sidecar lets the prefill (loopback) and the other pods (the pod IP) in."""
    docs = renders(K8S / "overlays" / "sim")
    served: list[Any] = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: served.append(kwargs))
    workers = 0
    for template in pod_templates(docs):
        for container in template.containers(docs):
            if container.argv[:1] == ["pd-worker"]:
                args = parse_worker_args(container.argv[1:])
                assert args.host == POD_IP, "pd-worker must bind and advertise its pod IP"
                workers += 1
            elif container.argv[:2] == ["registry", "serve"]:
                registry_main.main(container.argv[1:])
                prefix = "--bootstrap-allow="
                given = [a.removeprefix(prefix) for a in container.argv if a.startswith(prefix)]
                allowed = [ip_network(network) for network in given]
                assert any(ip_address("127.0.0.1") in n for n in allowed), "the prefill: loopback"
                assert any(ip_address(POD_IP) in n for n in allowed), "decoders, the router"
    assert workers == 2
    assert served and served[0]["port"] == 8998


# -------------------------------------------------------------------------- observability


def test_monitoring_objects_match_the_files_and_the_rules(renders: Renders) -> None:
    """The dashboard and rules ConfigMaps carry the files unchanged (dashboard labelled for the
    Grafana sidecar); the ServiceMonitor scrapes the router Service's port under job pd-router
    and the PodMonitor the engines' under pd-engines: the jobs the alert rules query."""
    docs = renders(BASE)
    dashboard = find(docs, "ConfigMap", "pd-router-grafana-dashboard")[0]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    text = (OBSERVABILITY / "grafana-dashboard.json").read_text()
    assert dashboard["data"]["grafana-dashboard.json"] == text
    rules = find(docs, "ConfigMap", "pd-router-prometheus-rules")[0]
    rules_text = (OBSERVABILITY / "prometheus-rules.yaml").read_text()
    assert rules["data"]["prometheus-rules.yaml"] == rules_text
    service = find(docs, "Service", "pd-router")[0]
    monitor = find(docs, "ServiceMonitor", "pd-router")[0]["spec"]
    labels = service["metadata"]["labels"]
    assert monitor["selector"]["matchLabels"].items() <= labels.items()
    service_ports = {p["name"] for p in service["spec"]["ports"]}
    assert {e["port"] for e in monitor["endpoints"]} <= service_ports
    jobs = {labels[monitor["jobLabel"]]}
    engines = find(docs, "PodMonitor", "pd-router-engines")[0]["spec"]
    for endpoint in engines["podMetricsEndpoints"]:
        assert endpoint["port"] == "http"
        jobs |= {r["replacement"] for r in endpoint["relabelings"] if r["targetLabel"] == "job"}
    queried = {word.split('"')[1] for word in rules_text.split("job=")[1:] if word.startswith('"')}
    assert queried and queried <= jobs, f"rules query jobs {queried}, monitors make {jobs}"
    picks = engines["selector"]["matchExpressions"][0]
    assert picks["key"] == "pd-router.io/role" and {"prefill", "decode"} <= set(picks["values"])


def test_no_prometheus_operator_component_drops_only_the_monitors(renders: Renders) -> None:
    docs = renders(K8S / "components" / "no-prometheus-operator")
    assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert find(docs, "ConfigMap", "pd-router-grafana-dashboard")
    assert find(docs, "Deployment", "pd-router")


# ------------------------------------------------------------------------------------- etcd


ETCD_RENDERS = [
    K8S / "components" / "etcd",
    K8S / "components" / "etcd-three-members",
    K8S / "overlays" / "sim",
]


@pytest.mark.parametrize("directory", ETCD_RENDERS, ids=_id)
def test_router_registry_is_the_etcd_cluster(
    directory: Path, renders: Renders, router_settings: Callable[[Container], RouterSettings]
) -> None:
    """The router's --registry names the etcd client Service; the initial cluster lists exactly
    the StatefulSet's members at their peer addresses; only routers (and members) get in."""
    docs = renders(directory)
    url = urlsplit(router_settings(_router(docs)).registry.url)
    assert url.scheme == "etcd"
    service = find(docs, "Service", url.hostname)[0]
    assert url.port in {p["port"] for p in service["spec"]["ports"]}
    etcd = find(docs, "StatefulSet", "pd-router-etcd")[0]
    template = _template(docs, "StatefulSet/pd-router-etcd")
    assert service["spec"]["selector"].items() <= template.labels.items()
    container = template.containers(docs)[0]
    members = dict(m.split("=", 1) for m in container.env["ETCD_INITIAL_CLUSTER"].split(","))
    name, peers = etcd["metadata"]["name"], etcd["spec"]["serviceName"]
    replicas = etcd["spec"]["replicas"]
    assert members == {f"{name}-{i}": f"http://{name}-{i}.{peers}:2380" for i in range(replicas)}
    advertised = flag(container.argv, "--initial-advertise-peer-urls")
    assert advertised == f"http://pod-0.{peers}:2380"  # $(POD_NAME) = the member's name
    assert find(docs, "Service", peers)[0]["spec"]["clusterIP"] == "None"
    policy = find(docs, "NetworkPolicy", "pd-router-etcd")[0]["spec"]
    router_labels = _template(docs, ROUTER).labels
    admitted = [
        rule
        for rule in policy["ingress"]
        for peer in rule["from"]
        if peer["podSelector"]["matchLabels"].items() <= router_labels.items()
    ]
    assert admitted and {p["port"] for p in admitted[0]["ports"]} == {url.port}
