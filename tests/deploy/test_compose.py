"""deploy/compose: the simulated cluster (sim.yaml) and real vLLM engines on GPUs (vllm-gpu.yaml).

No Docker engine is needed: each file is interpolated as Compose does (``${VAR:-default}``),
validated against the vendored Compose specification schema, and its wiring checked: every
``depends_on`` names a service (with a healthcheck where it waits for health, and no cycle),
published ports are unique, bind-mounted files exist. The flags cannot drift from the code: every
service that runs our image has its command parsed by the real parsers (the router's
``router.server.cli.parse_args`` with the service's environment, ``pd-worker``'s ``parse_args``);
the
router's ``--prefill``/``--decode`` URLs, bootstrap namespaces, KV event endpoints and registry
name services that exist, listening on those ports, in the right role; the vLLM engines'
``--kv-transfer-config`` matches their role and the router's ``--engine``; the Prometheus config
scrapes services that exist and loads the repo's alert rules (checked with ``promtool``).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from router.server.cli import parse_args as parse_router_args
from router.settings import RouterSettings
from tests.deploy.test_dockerfile import exec_form, parse_dockerfile
from worker.__main__ import parse_args as parse_worker_args
from worker.kv_events import KVEventsConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_DIR = ROOT / "deploy" / "compose"
SCHEMA = Path(__file__).resolve().parent / "compose_schema" / "compose-spec.json"
OUR_DOCKERFILE = ROOT / "deploy" / "Dockerfile"
RULES = ROOT / "deploy" / "observability" / "prometheus-rules.yaml"
PROMTOOL = Path(os.environ.get("PDR_PROMTOOL_BINARY", "/usr/bin/promtool"))
SIM, GPU = "sim.yaml", "vllm-gpu.yaml"
COMPOSE_FILES = (SIM, GPU)
# the PD protocol each vLLM connector speaks, as the router's --engine names it
ENGINE_OF_CONNECTOR = {"MooncakeConnector": "vllm-mooncake", "NixlConnector": "vllm-nixl"}
ROLE_OF_KV_ROLE = {"kv_producer": "prefill", "kv_consumer": "decode"}
_DRAFTS = {
    "draft-04": jsonschema.Draft4Validator,
    "draft-06": jsonschema.Draft6Validator,
    "draft-07": jsonschema.Draft7Validator,
    "draft/2019-09": jsonschema.Draft201909Validator,
    "draft/2020-12": jsonschema.Draft202012Validator,
}


# --- Compose's reading of a file ---------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:\$|\{(\w+)(?:(:?-)([^}]*))?\}|(\w+))")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's variable substitution (``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-d}``,
    ``${VAR-d}``) on every string value; any other form fails the test."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value
    assert not re.search(r"\$\{\w+[:?+]*[?+]", value), f"unsupported substitution in {value!r}"

    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        name, op, default = match[1] or match[4], match[2], match[3]
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _VARIABLE.sub(substitute, value)


def load_raw(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((COMPOSE_DIR / name).read_text())
    assert isinstance(doc, dict)
    return doc


def load(name: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The file as Compose sees it: anchors merged, variables from ``env`` (else defaults)."""
    doc = interpolate(load_raw(name), env or {})
    assert isinstance(doc, dict)
    return doc


def as_list(value: Any) -> list[str]:
    """A ``command``/``entrypoint`` (list or shell string) as an argv list."""
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def dependencies(service: dict[str, Any]) -> dict[str, str]:
    """``depends_on`` as {service: condition}."""
    depends = service.get("depends_on", {})
    if isinstance(depends, list):
        return dict.fromkeys(depends, "service_started")
    return {name: spec.get("condition", "service_started") for name, spec in depends.items()}


def published_ports(service: dict[str, Any]) -> list[tuple[str, int]]:
    """(host port, container port) of each published port (short and long syntax)."""
    out = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            if port.get("published") is not None:
                out.append((str(port["published"]), int(port["target"])))
            continue
        parts = str(port).split("/")[0].rsplit(":", 2)
        if len(parts) >= 2:
            out.append((parts[-2], int(parts[-1])))
    return out


def flag_value(argv: list[str], flag: str) -> str:
    """The value after ``flag`` (or of ``flag=value``) in ``argv``."""
    for i, arg in enumerate(argv):
        if arg == flag:
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{flag} missing from {argv}")


def healthcheck_url(service: dict[str, Any]) -> str:
    test = " ".join(as_list(service["healthcheck"]["test"]))
    match = re.search(r"https?://[^\s'\"]+", test)
    assert match, f"no URL in the healthcheck {test!r}"
    return match[0]


# --- our image: which services run it, parsed by our own parsers -------------------------------


def runs_our_image(service: dict[str, Any]) -> bool:
    build = service.get("build")
    if not isinstance(build, dict):
        return False
    dockerfile = COMPOSE_DIR / str(build.get("context", ".")) / str(build["dockerfile"])
    return dockerfile.resolve() == OUR_DOCKERFILE


def image_entrypoint() -> list[str]:
    entrypoints = parse_dockerfile(OUR_DOCKERFILE.read_text()).final.all("ENTRYPOINT")
    return exec_form(entrypoints[-1].args)


@dataclass(frozen=True)
class RouterService:
    name: str
    settings: RouterSettings
    service: dict[str, Any]


@dataclass(frozen=True)
class WorkerService:
    name: str
    args: Any  # pd-worker's argparse namespace
    service: dict[str, Any]


@dataclass(frozen=True)
class Stack:
    doc: dict[str, Any]
    routers: list[RouterService]
    workers: dict[str, WorkerService]

    @property
    def services(self) -> dict[str, dict[str, Any]]:
        services: dict[str, dict[str, Any]] = self.doc["services"]
        return services


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Callable[[dict[str, str]], None]:
    """Sets exactly a service's ``PDR_*`` environment (the router reads its settings from it)."""

    def apply(environment: dict[str, str]) -> None:
        for name in [n for n in os.environ if n.startswith("PDR_")]:
            monkeypatch.delenv(name)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)

    return apply


def _environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def parse_stack(doc: dict[str, Any], set_env: Callable[[dict[str, str]], None]) -> Stack:
    """Every service running our image, its command parsed by the console script's parser."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    routers, workers = [], {}
    for name, service in doc["services"].items():
        if not runs_our_image(service):
            continue
        argv = as_list(service.get("entrypoint")) or image_entrypoint()
        argv += as_list(service.get("command"))
        script, args = argv[0], argv[1:]
        assert script in scripts, f"{name}: {script!r} is not a console script of the project"
        set_env(_environment(service))
        try:
            if script == "router":
                routers.append(RouterService(name, parse_router_args(args), service))
            elif script == "pd-worker":
                workers[name] = WorkerService(name, parse_worker_args(args), service)
            else:
                raise AssertionError(f"{name}: no parser known for {script!r}")
        except SystemExit as exc:
            raise AssertionError(f"{name}: {script} rejects its command {args}: {exc}") from exc
    assert routers, "no router service runs our image"
    return Stack(doc, routers, workers)


def _host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "://" in url else f"tcp://{url}")
    assert parts.hostname and parts.port, f"{url}: expected HOST:PORT"
    return parts.hostname, parts.port


def _listen_port(stack: Stack, name: str) -> int:
    """The HTTP port service ``name`` listens on: pd-worker's ``--port`` or an engine's."""
    if name in stack.workers:
        port: int = stack.workers[name].args.port
        return port
    return int(flag_value(as_list(stack.services[name].get("command")), "--port"))


def _role(stack: Stack, name: str) -> str:
    if name in stack.workers:
        role: str = stack.workers[name].args.role
        return role
    return ROLE_OF_KV_ROLE[kv_transfer_config(stack.services[name])["kv_role"]]


def kv_transfer_config(service: dict[str, Any]) -> dict[str, Any]:
    text = flag_value(as_list(service.get("command")), "--kv-transfer-config")
    config = json.loads(text)
    assert isinstance(config, dict)
    return config


def kv_events_ports(stack: Stack, name: str) -> tuple[int, int | None]:
    """(live, replay) ports of the service's ``--kv-events-config``."""
    argv = as_list(stack.services[name].get("command"))
    config = KVEventsConfig.from_json(flag_value(argv, "--kv-events-config"))
    assert config.enabled, f"{name}: KV events configured but not enabled"
    replay = None if config.replay_endpoint is None else _host_port(config.replay_endpoint)[1]
    return _host_port(config.endpoint)[1], replay


# --- the tests: both files ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose_schema() -> dict[str, Any]:
    schema = json.loads(SCHEMA.read_text())
    assert isinstance(schema, dict)
    return schema


def schema_validator(schema: dict[str, Any]) -> jsonschema.protocols.Validator:
    cls = next((v for d, v in _DRAFTS.items() if d in schema["$schema"]), None)
    assert cls is not None, f"unknown $schema {schema['$schema']!r}"
    cls.check_schema(schema)
    return cls(schema)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_file_follows_the_compose_specification(name: str, compose_schema: dict[str, Any]) -> None:
    errors = sorted(
        schema_validator(compose_schema).iter_errors(load(name)), key=lambda e: list(e.path)
    )
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_dependencies_exist_are_healthchecked_and_acyclic(name: str) -> None:
    services = load(name)["services"]
    for service_name, service in services.items():
        for target, condition in dependencies(service).items():
            assert target in services, f"{service_name} depends on unknown service {target!r}"
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{target} has no healthcheck"

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in path, f"depends_on cycle: {' -> '.join((*path, node))}"
        for target in dependencies(services[node]):
            visit(target, (*path, node))

    for service_name in services:
        visit(service_name, ())


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_every_service_has_a_healthcheck_and_a_restart_policy(name: str) -> None:
    for service_name, service in load(name)["services"].items():
        assert "test" in service.get("healthcheck", {}), f"{service_name}: no healthcheck"
        assert service.get("restart") in ("always", "unless-stopped", "on-failure"), service_name


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_published_ports_are_unique(name: str) -> None:
    published = [
        (host, service_name)
        for service_name, service in load(name)["services"].items()
        for host, _ in published_ports(service)
    ]
    hosts = [host for host, _ in published]
    assert published, "nothing is published to the host"
    assert len(hosts) == len(set(hosts)), f"a host port is published twice: {published}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_bind_mounts_and_build_contexts_exist(name: str) -> None:
    doc = load(name)
    for service_name, service in doc["services"].items():
        for volume in service.get("volumes", []):
            source = volume["source"] if isinstance(volume, dict) else volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (COMPOSE_DIR / source).exists(), f"{service_name}: no {source}"
            else:
                assert source in doc.get("volumes", {}), f"{service_name}: volume {source}?"
        build = service.get("build")
        if isinstance(build, dict):
            dockerfile = COMPOSE_DIR / build.get("context", ".") / build["dockerfile"]
            assert dockerfile.is_file(), f"{service_name}: no {dockerfile}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_images_are_pinned(name: str) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for service_name, service in load(name)["services"].items():
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{service_name}: {image} has no tag"
        assert re.fullmatch(r"v?\d+(\.\d+)+(-[\w.]+)?", tag), f"{service_name}: {image} unpinned"
        if runs_our_image(service):
            assert tag == version, f"{service_name}: {image}, the project is version {version}"


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_header_says_how_to_start_it_and_what_to_curl(name: str) -> None:
    header = (COMPOSE_DIR / name).read_text().split("\n\n", 1)[0]
    assert f"docker compose -f deploy/compose/{name} up" in header, header
    assert "curl localhost:" in header, header


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_our_image_commands_parse_and_name_the_right_services(
    name: str, clean_env: Callable[[dict[str, str]], None]
) -> None:
    stack = parse_stack(load(name), clean_env)
    for router in stack.routers:
        settings = router.settings
        assert settings.server.host == "0.0.0.0", f"{router.name} listens on loopback only"
        port = settings.server.port
        assert (str(port), port) in published_ports(router.service), "router port unpublished"
        assert _host_port(healthcheck_url(router.service))[1] == port, "healthcheck port"
        for role, specs in (("prefill", settings.prefill), ("decode", settings.decode)):
            assert specs, f"{router.name}: no {role} worker"
            for spec in specs:
                host, worker_port = _host_port(spec.url)
                assert host in stack.services, f"{router.name}: {spec.url} names no service"
                assert worker_port == _listen_port(stack, host), f"{spec.url}: wrong port"
                assert _role(stack, host) == role, f"{spec.url} is not a {role}"


# --- the simulated cluster ---------------------------------------------------------------------

SIM_ENVS = [{}, {"PD_ENGINE": "sglang"}, {"PD_ENGINE": "vllm-mooncake"}]


@pytest.mark.parametrize("env", SIM_ENVS, ids=["defaults", "sglang", "vllm-mooncake"])
def test_sim_workers_advertise_their_service_name_and_speak_the_routers_protocol(
    env: dict[str, str], clean_env: Callable[[dict[str, str]], None]
) -> None:
    stack = parse_stack(load(SIM, env), clean_env)
    (router,) = stack.routers
    assert {"prefill", "decode"} <= {w.args.role for w in stack.workers.values()}
    for worker in stack.workers.values():
        # pd-worker binds and advertises --host: peers in other containers must reach it there
        assert worker.args.host == worker.name, f"{worker.name} advertises {worker.args.host}"
        assert worker.args.protocol == router.settings.engine.value, worker.name
        assert worker.args.engine == "mooncake", f"{worker.name}: KV must cross containers"
        url = healthcheck_url(worker.service)
        assert _host_port(url) == (worker.name, worker.args.port), f"{worker.name}: {url}"


def test_sim_prefill_registers_with_the_routers_bootstrap_namespace(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(SIM), clean_env)
    (router,) = stack.routers
    registry = router.settings.registry
    assert registry.advertise_host == router.name, "decoders must reach the router by name"
    subnets = [ipaddress.ip_network(c["subnet"]) for c in _subnets(stack.doc)]
    assert subnets, "the compose network has no fixed subnet for --bootstrap-allow"
    for subnet in subnets:
        assert any(
            subnet.version == allowed.version and subnet.subnet_of(allowed)  # type: ignore[arg-type]
            for allowed in registry.bootstrap_allow
        ), f"the router's bootstrap ports refuse the compose network {subnet}"
    for spec in router.settings.prefill:
        host, _ = _host_port(spec.url)
        assert spec.bootstrap_namespace, f"{spec.url}: no ns:NAME"
        namespace_port = registry.bootstrap_ports[spec.bootstrap_namespace]
        assert stack.workers[host].args.registry == f"{router.name}:{namespace_port}", host
        assert dependencies(stack.services[host]).get(router.name) == "service_healthy", (
            f"{host} registers with the router: it must start after it"
        )


def _subnets(doc: dict[str, Any]) -> list[dict[str, str]]:
    return [
        config
        for network in (doc.get("networks") or {}).values()
        for config in ((network or {}).get("ipam") or {}).get("config", [])
    ]


def test_sim_router_follows_the_prefills_kv_events(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(SIM), clean_env)
    (router,) = stack.routers
    for spec in router.settings.prefill:
        host, _ = _host_port(spec.url)
        assert spec.kv_events and spec.kv_events_replay, f"{spec.url}: no events= / replay="
        live, replay = kv_events_ports(stack, host)
        assert _host_port(spec.kv_events) == (host, live)
        assert _host_port(spec.kv_events_replay) == (host, replay)


def test_sim_router_uses_the_etcd_service_and_the_admin_token_from_the_environment(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(SIM, {"PDR_ADMIN_TOKEN": "s3cret"}), clean_env)
    (router,) = stack.routers
    registry = router.settings.registry
    url = urlsplit(registry.url)
    assert url.scheme == "etcd" and url.hostname in stack.services, registry.url
    etcd = as_list(stack.services[url.hostname].get("command"))
    listen = flag_value(etcd, "--listen-client-urls")
    assert url.port in {_host_port(u)[1] for u in listen.split(",")}, (registry.url, listen)
    token = registry.admin_token
    assert token is not None
    value = token.get_secret_value() if hasattr(token, "get_secret_value") else token
    assert value == "s3cret", "the admin token does not come from PDR_ADMIN_TOKEN"
    assert dependencies(router.service).get(url.hostname) == "service_healthy"


def test_sim_prometheus_scrapes_the_services_with_the_repos_rules(tmp_path: Path) -> None:
    doc = load(SIM)
    services = doc["services"]
    prometheus = services["prometheus"]
    command = as_list(prometheus["command"])
    config_target = flag_value(command, "--config.file")
    # lay the mounted files out as the container sees them
    mounts = {}
    for volume in prometheus["volumes"]:
        source, target = volume.split(":")[:2]
        mounts[target] = (COMPOSE_DIR / source).resolve()
        destination = tmp_path / target.lstrip("/")
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(mounts[target], destination)
    assert RULES.resolve() in mounts.values(), "the repo's alert rules are not mounted"
    config = yaml.safe_load(mounts[config_target].read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    rules_text = RULES.read_text()
    for job in set(re.findall(r'job="([^"]+)"', rules_text)):
        assert job in jobs, f"the alert rules use job {job!r}, the scrape config has none"
    for job in jobs.values():
        for group in job["static_configs"]:
            for target in group["targets"]:
                host, _ = _host_port(target)
                assert host in services, f"{job['job_name']}: {target} names no service"
    if not os.access(PROMTOOL, os.X_OK):
        pytest.fail(f"promtool not found at {PROMTOOL}: install the Debian package prometheus")
    result = subprocess.run(
        [str(PROMTOOL), "check", "config", str(tmp_path / config_target.lstrip("/"))],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_sim_prometheus_targets_are_the_ports_the_services_listen_on(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(SIM), clean_env)
    (router,) = stack.routers
    listening = {router.name: router.settings.server.port}
    listening |= {name: _listen_port(stack, name) for name in stack.workers}
    config_mount = next(
        v.split(":")[0]
        for v in stack.services["prometheus"]["volumes"]
        if v.split(":")[1].endswith("prometheus.yml")
    )
    config = yaml.safe_load((COMPOSE_DIR / config_mount).read_text())
    scraped = {
        _host_port(target)
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert scraped == set(listening.items()), f"scraped {scraped}, listening {listening}"


# --- real vLLM engines on GPUs -----------------------------------------------------------------


def _vllm_services(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: service
        for name, service in doc["services"].items()
        if "vllm/vllm-openai" in service["image"]
    }


def test_gpu_kv_transfer_config_matches_the_role_and_the_routers_engine(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(GPU), clean_env)
    (router,) = stack.routers
    engines = _vllm_services(stack.doc)
    assert len(engines) >= 2, "expected a vLLM prefill and a vLLM decode"
    roles = (("prefill", router.settings.prefill), ("decode", router.settings.decode))
    routed = {_host_port(spec.url)[0]: role for role, specs in roles for spec in specs}
    assert set(routed) == set(engines), f"the router routes to {routed}, engines {set(engines)}"
    for name, service in engines.items():
        config = kv_transfer_config(service)
        connector = config["kv_connector"]
        assert ENGINE_OF_CONNECTOR.get(connector) == router.settings.engine.value, (
            f"{name}: {connector} does not speak the router's --engine "
            f"{router.settings.engine.value}"
        )
        assert ROLE_OF_KV_ROLE.get(config["kv_role"]) == routed[name], (
            f"{name}: kv_role {config['kv_role']} but the router uses it as {routed[name]}"
        )
        if connector == "MooncakeConnector":
            protocol = config["kv_connector_extra_config"]["mooncake_protocol"]
            assert protocol in ("tcp", "rdma"), f"{name}: mooncake_protocol {protocol!r}"


def test_gpu_router_reaches_the_bootstrap_server_and_kv_events(
    clean_env: Callable[[dict[str, str]], None],
) -> None:
    stack = parse_stack(load(GPU), clean_env)
    (router,) = stack.routers
    for spec in router.settings.prefill:
        host, _ = _host_port(spec.url)
        env = _environment(stack.services[host])
        assert spec.bootstrap_port == int(env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]), spec
        if spec.kv_events is not None:
            live, replay = kv_events_ports(stack, host)
            assert _host_port(spec.kv_events) == (host, live)
            assert spec.kv_events_replay is not None
            assert _host_port(spec.kv_events_replay) == (host, replay)
    for spec in router.settings.decode:
        host, _ = _host_port(spec.url)
        argv = as_list(stack.services[host].get("command"))
        assert "--enable-prompt-tokens-details" in argv, f"{host}: recompute detection needs it"


def test_gpu_engines_get_their_own_gpus_shared_memory_and_a_model_variable() -> None:
    raw = load_raw(GPU)
    doc = load(GPU)
    device_sets = []
    for name, service in _vllm_services(doc).items():
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        nvidia = [d for d in devices if d.get("driver") == "nvidia"]
        assert nvidia and all("gpu" in d["capabilities"] for d in nvidia), name
        ids = {i for d in nvidia for i in d.get("device_ids", [])}
        assert ids, f"{name}: no device_ids: it would take every GPU"
        device_sets.append(ids)
        assert service.get("ipc") == "host" or "shm_size" in service, f"{name}: no shared memory"
        model = as_list(raw["services"][name]["command"])[0]
        assert re.fullmatch(r"\$\{MODEL(:-[^}]+)?\}", model), f"{name}: model {model!r}"
    for i, ids in enumerate(device_sets):
        for other in device_sets[i + 1 :]:
            assert not ids & other, f"engines share GPUs {ids & other}"
    # a different choice of GPUs is honoured
    chosen = load(GPU, {"PREFILL_GPU": "2", "DECODE_GPU": "3"})
    picked = [
        s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for s in _vllm_services(chosen).values()
    ]
    assert sorted(map(tuple, picked)) == [("2",), ("3",)]
