"""The router's OpenAPI schema describes what it serves and answers: the completion routes
(served by the raw handler), 400 (not FastAPI's 422) for invalid input, an empty ``/health``;
and a 405 says which methods are allowed. The standalone registry's schema documents its
``/store`` answers, and its 405s say which methods are allowed too."""

from __future__ import annotations

import json

import httpx

from registry.app import create_registry_app
from registry.settings import RegistrySettings
from testkit.fake_cluster import FakeClusterFactory
from testkit.servers import run_server

# registry path -> the methods a 405 there names (each method a route of its own)
PATCHED = {"/admin/workers": "GET, POST", "/store/keys/k": "DELETE, GET, PUT"}


def test_schema_documents_the_completion_routes_and_400s(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        schema = client.get("/openapi.json").json()
        invalid = client.post("/admin/workers", json={"role": "nope"})
    paths = schema["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = paths[path]["post"]["responses"]
        assert {"200", "400", "413", "502", "503", "504"} <= set(responses)
        assert "text/event-stream" in responses["200"]["content"]
    assert '"422"' not in json.dumps(schema)
    assert "400" in paths["/admin/workers"]["post"]["responses"]
    assert invalid.status_code == 400  # what the schema now says
    assert paths["/health"]["get"]["responses"]["200"]["content"] == {}


def test_a_405_names_the_allowed_methods(make_cluster: FakeClusterFactory) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        hot = client.get("/v1/completions")
        cold = client.delete("/health")
        health = client.get("/health")
        two_routes = client.patch("/admin/workers")  # GET and POST are routes of their own
    assert hot.status_code == 405 and hot.headers["allow"] == "POST"
    assert hot.json()["error"]["code"] == 405
    assert cold.status_code == 405 and cold.headers["allow"] == "GET"
    assert two_routes.status_code == 405 and two_routes.headers["allow"] == "GET, POST"
    assert two_routes.json()["error"]["code"] == 405
    assert health.status_code == 200 and health.content == b""


def test_schema_documents_content_types_bodies_and_admin_auth(
    make_cluster: FakeClusterFactory,
) -> None:
    cluster = make_cluster("sglang")
    with cluster.client() as client:
        paths = client.get("/openapi.json").json()["paths"]
        metrics = client.get("/metrics")
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert metrics.headers["content-type"].startswith("text/plain")
    assert list(paths["/status"]["get"]["responses"]["200"]["content"]) == ["text/html"]
    assert "503" in paths["/ready"]["get"]["responses"]
    completion = paths["/v1/completions"]["post"]
    body = completion["requestBody"]["content"]["application/json"]["schema"]
    assert body["required"] == ["model", "prompt"]
    assert "4XX" in completion["responses"]  # an engine's 4xx passes through
    for path, method in [("/admin/workers", "get"), ("/admin/explain", "post")]:
        responses = paths[path][method]["responses"]
        assert {"401", "403", "503"} <= set(responses), path
    assert {"400", "413"} <= set(paths["/admin/workers"]["post"]["responses"])
    assert "404" in paths["/admin/workers/{worker_id}"]["delete"]["responses"]


def test_registry_documents_its_store_answers_and_names_allowed_methods() -> None:
    settings = RegistrySettings(admin_token="s3cret")  # type: ignore[arg-type]
    token = {"authorization": "Bearer s3cret"}
    with run_server(create_registry_app(settings)) as port:
        url = f"http://127.0.0.1:{port}"
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        missing = httpx.get(url + "/store/keys/nope", headers=token)
        unauthorized = httpx.get(url + "/store/list")
        bad_ttl = httpx.put(url + "/store/keys/k?ttl=0", headers=token, content=b"v")
        patched = {path: httpx.patch(url + path, headers=token) for path in PATCHED}
    get_value = paths["/store/keys/{key}"]["get"]["responses"]
    assert list(get_value["200"]["content"]) == ["application/octet-stream"]
    assert "X-Store-Missing" in get_value["404"]["headers"]
    assert missing.status_code == 404 and missing.headers["x-store-missing"] == "1"
    for path, method in [("/store/keys/{key}", "put"), ("/store/list", "get")]:
        assert {"401", "403", "503", "422"} <= set(paths[path][method]["responses"]), path
    assert "detail" not in json.dumps(paths["/store/keys/{key}"]["put"]["responses"]["422"])
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == 401
    assert bad_ttl.status_code == 422 and bad_ttl.json()["error"]["code"] == 422
    assert {path: r.headers.get("allow") for path, r in patched.items()} == PATCHED
    assert {r.status_code for r in patched.values()} == {405}
