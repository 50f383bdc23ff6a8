"""Schemathesis against the OpenAPI schemas served at /openapi.json: the router's client port, its
engine bootstrap listeners (the shared ``--bootstrap-port`` and one namespace's port) and the
standalone registry.

Each is a real uvicorn server on 127.0.0.1 (the router with fake engines behind it). Every
operation of a schema gets generated requests, valid ones and invalid ones, each checked for: no
5xx, a documented status code and content type, a body and headers matching the schema. Admin
operations are sent with the admin token and again without it (401, which the schema documents);
every path also gets a method its schema does not list (405 with an ``Allow`` naming the listed
ones). Bounded and deterministic: ``MAX_EXAMPLES`` per operation and mode (invalid cases only
where something can be invalid), a derandomized Hypothesis without a database or shrinking, and
a router bounding n x batch low so that no fuzzed request makes the fake engines stream for long
(~10 s for the module on a busy 2-core machine). The requests sent per schema, by status class,
are printed in pytest's terminal summary.

(schemathesis.pytest.from_fixture does not run under pytest 9, so the operations are driven here
with ``APIOperation.as_strategy``.)
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis
import pytest
import schemathesis
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import GenerationMode, checks
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from testkit.fake_cluster import fake_cluster_factory
from testkit.servers import free_port, run_server

ADMIN_TOKEN = "fuzz-admin-token"
MODEL = "fake-model"  # what the fake engines serve
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# examples per operation: valid ones, and invalid ones (slower to generate; mostly 400s)
MAX_EXAMPLES = {GenerationMode.POSITIVE: 10, GenerationMode.NEGATIVE: 5}
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]
FUZZ_SETTINGS = hypothesis.settings(
    derandomize=True,
    database=None,
    deadline=None,
    phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    suppress_health_check=list(hypothesis.HealthCheck),
)
# never fuzzed: a stream that stays open until the client leaves
NOT_FUZZED = {("GET", "/store/watch")}
SENT: collections.Counter[str] = collections.Counter()


class _CountsLine:
    """A plugin that writes the requests sent into pytest's terminal summary (a fixture's own
    output is captured, shown only when a test fails)."""

    def __init__(self, line: str) -> None:
        self.line = line

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        terminalreporter.write_line(self.line)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    line = "schemathesis requests sent: " + ", ".join(f"{k}={v}" for k, v in sorted(SENT.items()))
    pytestconfig.pluginmanager.register(_CountsLine(line), "fuzz-openapi-request-counts")


@pytest.fixture(scope="module")
def router_urls() -> Iterator[dict[str, str]]:
    """The router's client port, its shared bootstrap port and one namespace's port."""
    shared, own = free_port(), free_port()
    registry = {
        "admin_token": ADMIN_TOKEN,
        "bootstrap_port": shared,
        "bootstrap_ports": {"ns1": own},
        "bootstrap_connect_timeout_s": 0.2,  # registrations from fuzzed addresses are checked
    }
    # n x batch bounded low: the fakes stream every sample's tokens without yielding, and with
    # the default bound (1024 samples) one request blocks their loop, health probes included
    server = {"max_sequences": 8}
    with contextlib.ExitStack() as stack:
        cluster = fake_cluster_factory(stack)("sglang", registry=registry, server=server)
        yield {
            "router": cluster.router_url,
            "bootstrap": f"http://127.0.0.1:{shared}",
            "bootstrap ns1": f"http://127.0.0.1:{own}",
        }


@pytest.fixture(scope="module")
def registry_url() -> Iterator[str]:
    settings = RegistrySettings(admin_token=SecretStr(ADMIN_TOKEN))
    with run_server(create_registry_app(settings)) as port:
        yield f"http://127.0.0.1:{port}"


def _served_model(case: Any, mode: GenerationMode) -> bool:
    """Whether ``case`` is a valid completion whose model may be the one the fakes serve."""
    completion = case.path in ("/v1/completions", "/v1/chat/completions")
    return completion and mode is GenerationMode.POSITIVE and isinstance(case.body, dict)


def _needs_admin(path: str) -> bool:
    return path.startswith(("/admin", "/store"))


def _can_be_invalid(operation: Any) -> bool:
    """Whether a NEGATIVE case exists: a body, a query, header or cookie parameter, or a path
    parameter narrower than any string (Hypothesis takes seconds to give up on the others)."""
    if any(len(part) for part in (operation.body, operation.query, operation.headers)):
        return True
    if len(operation.cookies):
        return True
    return any(_narrower_than_any_string(p.definition) for p in operation.path_parameters)


def _narrower_than_any_string(parameter: dict[str, Any]) -> bool:
    schema = {k: v for k, v in parameter.get("schema", {}).items() if k not in ("title",)}
    return schema != {"type": "string"}


def _send(name: str, case: Any, headers: dict[str, str]) -> None:
    response = case.call(headers=headers, timeout=10)
    SENT[name] += 1
    SENT[f"{name} {response.status_code // 100}xx"] += 1
    case.validate_response(response, checks=CHECKS, headers=headers)


def _fuzz_operation(name: str, operation: Any, mode: GenerationMode) -> str | None:
    """Send ``operation``'s generated cases; the first failure's report, or None."""

    @hypothesis.settings(FUZZ_SETTINGS, max_examples=MAX_EXAMPLES[mode])
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode), data=st.data())
    def run(case: Any, data: st.DataObject) -> None:
        if _served_model(case, mode) and data.draw(st.booleans(), "the served model"):
            case.body["model"] = MODEL  # else the engines answer 404 (passed through)
        _send(name, case, AUTH)
        if _needs_admin(case.path):
            _send(name, case, {})

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # nothing to make invalid (no parameters, no body)
        assert mode is GenerationMode.NEGATIVE, operation.path
    except (Exception, FailureGroup) as exc:  # noqa: BLE001 - the test fails with them all
        return f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}"
    return None


def fuzz_schema(name: str, base_url: str) -> list[str]:
    """Every operation of the schema ``base_url`` serves, in both modes; the failures."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    failures = []
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), f"{name}: invalid schema: {result.err()}"
        operations.append(result.ok())
    assert operations, "the schema lists no operation"
    for operation in operations:
        if (operation.method.upper(), operation.path) in NOT_FUZZED:
            continue
        modes = [GenerationMode.POSITIVE]
        if _can_be_invalid(operation):
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            failure = _fuzz_operation(name, operation, mode)
            if failure is not None:
                failures.append(failure)
    return failures + _undocumented_methods(name, base_url, operations)


def _undocumented_methods(name: str, base_url: str, operations: list[Any]) -> list[str]:
    """Each path with a method its schema does not list: 405 naming the ones it does."""
    methods: dict[str, set[str]] = collections.defaultdict(set)
    for operation in operations:
        methods[operation.path].add(operation.method.upper())
    failures = []
    for path, allowed in methods.items():
        url = base_url + path.replace("{", "").replace("}", "")  # "{key}" -> "key"
        method = "PATCH" if "PATCH" not in allowed else "TRACE"
        response = httpx.request(method, url, headers=AUTH, timeout=10)
        SENT[name] += 1
        allow = {m.strip() for m in response.headers.get("allow", "").split(",")} - {"HEAD"}
        if response.status_code != 405 or allow != allowed:
            failures.append(
                f"{method} {path}: {response.status_code}, Allow {allow}; expected 405 and "
                f"Allow {sorted(allowed)}"
            )
    return failures


@pytest.mark.parametrize("listener", ["router", "bootstrap", "bootstrap ns1"])
def test_router_schemas_hold_under_fuzzing(router_urls: dict[str, str], listener: str) -> None:
    """The client port, and the engine bootstrap listeners (shared, one namespace's)."""
    failures = fuzz_schema(listener, router_urls[listener])
    assert not failures, "\n\n".join(failures)


def test_registry_schema_holds_under_fuzzing(registry_url: str) -> None:
    failures = fuzz_schema("registry", registry_url)
    assert not failures, "\n\n".join(failures)
