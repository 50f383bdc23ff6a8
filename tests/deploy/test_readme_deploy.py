"""The deploy page's "Deploy on Kubernetes" sequences (``docs/deploy.md``) stay true: each
overlay it writes renders, and every name its commands use (namespace, secrets, deployments waited
on and scaled, the service port-forwarded, the model curled) is what the rendered manifests
contain.

Each ``cat > DIR/kustomization.yaml <<'EOF'`` block of the page is written to a temporary
directory with its ``../deploy/...`` resource made relative to there, and rendered by the real
``kubectl kustomize`` (what ``kubectl apply -k DIR`` sends). The page's commands run from the
repository root, so DIR is taken as a directory there.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from tests.deploy.rendered import REPO, Doc, find, pod_templates, render

DEPLOY_PAGE = REPO / "docs" / "deploy.md"
_HEREDOC = re.compile(r"cat > (\S+)/kustomization\.yaml <<'EOF'\n(.*?)\nEOF\n", re.S)
_BASH_BLOCK = re.compile(r"```bash\n(.*?)```", re.S)


@dataclass
class Sequence:
    directory: str  # the overlay directory the page writes
    kustomization: str  # its kustomization.yaml, as written
    commands: list[list[str]]  # the kubectl and curl commands of the same block


def _sequences() -> list[Sequence]:
    found = []
    for block in _BASH_BLOCK.findall(DEPLOY_PAGE.read_text()):
        match = _HEREDOC.search(block)
        if match is None:
            continue
        rest = block.replace(match.group(0), "")
        lines = [line for line in rest.replace("\\\n", " ").splitlines() if line.strip()]
        commands = [shlex.split(line, comments=True) for line in lines if not line.startswith("#")]
        found.append(Sequence(match.group(1), match.group(2), [c for c in commands if c]))
    return found


SEQUENCES = _sequences()


def test_the_deploy_page_has_a_vllm_and_an_sglang_sequence() -> None:
    overlays = {Path(yaml.safe_load(s.kustomization)["resources"][0]).name for s in SEQUENCES}
    assert {"vllm-mooncake", "sglang-mooncake"} <= overlays, overlays


def _render(sequence: Sequence, tmp_path: Path) -> list[Doc]:
    kustomization = yaml.safe_load(sequence.kustomization)
    workdir = tmp_path / sequence.directory
    workdir.mkdir(parents=True)
    # the page's directory sits at the repository root: re-anchor its relative resources
    kustomization["resources"] = [
        os.path.relpath(REPO / sequence.directory / r, workdir) for r in kustomization["resources"]
    ]
    (workdir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return render(workdir)


def _kubectl(sequence: Sequence, verb: str) -> list[list[str]]:
    """The page's ``kubectl [-n NS] VERB ...`` commands, with ``-n NS`` checked and removed."""
    out = []
    for command in sequence.commands:
        if command[:1] != ["kubectl"]:
            continue
        args = command[1:]
        if args[:1] == ["-n"]:
            assert args[1] == "pd-router", command
            args = args[2:]
        if args[:1] == [verb]:
            out.append(args[1:])
    return out


@pytest.mark.parametrize("sequence", SEQUENCES, ids=lambda s: s.directory)
def test_the_deploy_sequence_matches_what_it_deploys(sequence: Sequence, tmp_path: Path) -> None:
    docs = _render(sequence, tmp_path)
    wanted = yaml.safe_load(sequence.kustomization)

    # everything lands in the namespace the page creates and uses
    (created,) = _kubectl(sequence, "create")[:1]
    assert created == ["namespace", "pd-router"], created
    assert {d["metadata"].get("namespace", "pd-router") for d in docs} == {"pd-router"}

    # kubectl apply -k names the directory just written
    assert _kubectl(sequence, "apply") == [["-k", sequence.directory]]

    # the router runs the page's image
    (image,) = wanted["images"]
    (router,) = find(docs, "Deployment", "pd-router")
    (container,) = [
        c for c in router["spec"]["template"]["spec"]["containers"] if c["name"] == "router"
    ]
    assert container["image"] == f"{image['newName']}:{image['newTag']}"

    # the model: the ConfigMap every engine reads, and the model the page curls
    (model_literal,) = wanted["configMapGenerator"][0]["literals"]
    (config_map,) = [
        d for d in find(docs, "ConfigMap") if d["metadata"]["name"].startswith("pd-model")
    ]
    assert f"MODEL={config_map['data']['MODEL']}" == model_literal
    curls = [c for c in sequence.commands if c[:1] == ["curl"] and "-d" in c]
    assert curls, "the sequence ends with a completion through the router"
    for curl in curls:
        assert json.loads(curl[curl.index("-d") + 1])["model"] == config_map["data"]["MODEL"]

    # the secrets it creates are the ones the pods read (and no other secret is needed)
    created_secrets = {
        args[2] for args in _kubectl(sequence, "create") if args[:2] == ["secret", "generic"]
    }
    read_secrets = {
        env["valueFrom"]["secretKeyRef"]["name"]
        for template in pod_templates(docs)
        for c in template.spec.get("initContainers", []) + template.spec["containers"]
        for env in c.get("env", [])
        if "secretKeyRef" in env.get("valueFrom", {})
    }
    assert created_secrets == read_secrets

    # it waits for deployments that exist: every engine workload and the router
    (wait,) = _kubectl(sequence, "wait")
    waited = {a.removeprefix("deployment/") for a in wait if a.startswith("deployment/")}
    assert waited == {d["metadata"]["name"] for d in find(docs, "Deployment")}

    # it port-forwards the router's Service on the port it then curls
    (forward,) = _kubectl(sequence, "port-forward")
    assert forward[0] == "svc/pd-router"
    local, remote = forward[1].split(":")
    (service,) = find(docs, "Service", "pd-router")
    assert int(remote) in {p["port"] for p in service["spec"]["ports"]}
    assert all(f"localhost:{local}/" in " ".join(c) for c in curls)


def test_the_deploy_page_scales_workloads_that_exist(tmp_path: Path) -> None:
    """``kubectl -n pd-router scale KIND/NAME`` lines name workloads of the overlays."""
    text = DEPLOY_PAGE.read_text()
    scaled = re.findall(r"kubectl -n pd-router scale (\w+)/([\w-]+)", text)
    scaled += re.findall(r"`(deployment|leaderworkerset)/([\w-]+)`", text)
    assert scaled
    workloads = set()
    overlays = REPO / "deploy" / "k8s" / "overlays"
    for overlay in sorted(overlays.iterdir()):
        for doc in render(overlay):
            workloads.add((doc["kind"].lower(), doc["metadata"]["name"]))
    missing = {(kind, name) for kind, name in scaled if (kind, name) not in workloads}
    assert not missing, missing
