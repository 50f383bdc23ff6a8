"""A fake Kubernetes API server for pods, speaking list and watch as the real API server does.

No API server runs on the test machines, so the tests drive the real client library
(``kubernetes_asyncio``) against this one, on 127.0.0.1 (uvicorn in a thread)::

    with FakeKubeApi() as kube:              # started; kube.url, kube.write_kubeconfig(path)
        kube.put_pod(pod_dict("p0", labels={"role": "prefill"}))   # ADDED, or MODIFIED
        kube.delete_pod("p0")                # DELETED (the final object, a new resourceVersion)
        kube.compact()                       # watches from an older resourceVersion get 410
        kube.end_watches()                   # open watches end, as at the server's timeout
        kube.block_watches(); kube.unblock_watches()   # end watches, hold new ones meanwhile
        kube.stop(); kube.start()            # an API server restart, same port, same objects

What it reproduces (the parts a watcher depends on):

- ``GET /api/v1/namespaces/{ns}/pods``: a ``PodList`` (``metadata.resourceVersion``; items
  without ``apiVersion``/``kind``, as the real server lists them), ``labelSelector`` with
  equality (``a=b``, ``a==b``, ``a!=b``), existence (``a``, ``!a``) and set (``a in (x,y)``,
  ``a notin (x)``) requirements, ``limit``/``continue`` paging over a consistent snapshot
  (``metadata.continue``, ``remainingItemCount``; 410 once the snapshot was compacted).
- ``...&watch=true`` (or ``1``): HTTP 200, ``Transfer-Encoding: chunked``, one JSON object a
  line ``{"type": "ADDED|MODIFIED|DELETED|BOOKMARK|ERROR", "object": {...}}``. With a
  ``resourceVersion``, the events after it are replayed first; without one (or ``0``), every
  matching pod as ADDED. Under a selector an object that stops matching arrives as DELETED (its
  previous content, the event's resourceVersion) and one that starts matching as ADDED, as the
  watch cache does. With ``allowWatchBookmarks=true``: BOOKMARK events (a Pod with only
  ``metadata.resourceVersion``, the server's current one) every ``bookmark_interval_s`` and on
  ``send_bookmark()``. ``timeoutSeconds`` ends the stream. A resourceVersion older than the
  compacted history: an ``ERROR`` event whose object is a ``Status`` (code 410, reason
  ``Expired``, message ``too old resource version: X (Y)``), then the stream ends; or, with
  ``expire_with_http_status``, the watch request itself answered 410 with that Status.
- Bearer-token authentication (401 Status) when ``token`` is given; 404 Status elsewhere.

What it does not: other resources and verbs, field selectors, ``resourceVersionMatch``,
``sendInitialEvents``, list ``resourceVersion`` semantics (a list always reads the latest
state), set-based ``gt``/``lt`` selectors, protobuf, TLS, server-side ``Ready`` computation
(the tests set pod status themselves) and graceful deletion (deletionTimestamp is set by the
test with ``put_pod``; ``delete_pod`` removes at once).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import itertools
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import parse_qs

from testkit.servers import make_server, serving

__all__ = [
    "FakeKubeApi",
    "ListRequest",
    "WatchRequest",
    "parse_selector",
    "pod_dict",
]

Pod = dict[str, Any]
Selector = Callable[[Mapping[str, str]], bool]
_MAX_SNAPSHOTS = 64
_CREATED = "2024-01-01T00:00:00Z"


# ---------------------------------------------------------------------------- pods, selectors


def pod_dict(
    name: str,
    *,
    namespace: str = "default",
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    pod_ip: str | None = "127.0.0.1",
    ready: bool = True,
    phase: str = "Running",
    ports: Iterable[tuple[str, int]] = (),
    deleting: bool = False,
) -> Pod:
    """A Pod as the API server returns it (without ``apiVersion``/``kind``, as list items are):
    one container with ``ports`` (name, containerPort), and a Ready condition."""
    status = "True" if ready else "False"
    conditions = [
        {"type": kind, "status": "True", "lastTransitionTime": _CREATED}
        for kind in ("PodScheduled", "Initialized")
    ] + [
        {"type": kind, "status": status, "lastTransitionTime": _CREATED}
        for kind in ("ContainersReady", "Ready")
    ]
    metadata: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "labels": dict(labels or {}),
        "annotations": dict(annotations or {}),
    }
    if deleting:
        metadata["deletionTimestamp"] = _CREATED
        metadata["deletionGracePeriodSeconds"] = 30
    container_ports = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    pod_status: dict[str, Any] = {"phase": phase, "conditions": conditions}
    if pod_ip is not None:
        pod_status |= {"podIP": pod_ip, "podIPs": [{"ip": pod_ip}]}
    return {
        "metadata": metadata,
        "spec": {"containers": [{"name": "engine", "image": "engine", "ports": container_ports}]},
        "status": pod_status,
    }


_SET_RE = re.compile(r"^([^\s!=(),]+)\s+(in|notin)\s+\(([^()]*)\)$")
_EQ_RE = re.compile(r"^([^\s!=(),]+)\s*(==|=|!=)\s*([^\s!=(),]*)$")
_EXISTS_RE = re.compile(r"^(!?)\s*([^\s!=(),]+)$")


def _requirement(text: str) -> Selector:
    if match := _SET_RE.match(text):
        key, op, values = match[1], match[2], {v.strip() for v in match[3].split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if match := _EQ_RE.match(text):
        key, op, value = match[1], match[2], match[3]
        if op == "!=":
            return lambda labels: labels.get(key) != value
        return lambda labels: labels.get(key) == value
    if match := _EXISTS_RE.match(text):
        negated, key = match[1] == "!", match[2]
        return lambda labels: (key in labels) != negated
    raise ValueError(f"unable to parse requirement: {text!r}")


def parse_selector(text: str) -> Selector:
    """A label selector as the API server reads it; raises ValueError (its 400)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    requirements = [_requirement(part.strip()) for part in parts if part.strip()]
    return lambda labels: all(requirement(labels) for requirement in requirements)


def _labels(pod: Pod) -> Mapping[str, str]:
    labels: Mapping[str, str] = pod["metadata"].get("labels") or {}
    return labels


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _line(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode() + b"\n"


def _as_event(kind: str, pod: Pod) -> dict[str, Any]:
    return {"type": kind, "object": {"kind": "Pod", "apiVersion": "v1", **pod}}


# ---------------------------------------------------------------------------- requests seen


@dataclass(frozen=True)
class ListRequest:
    namespace: str
    label_selector: str
    limit: int | None
    continue_token: str | None


@dataclass(frozen=True)
class WatchRequest:
    namespace: str
    label_selector: str
    resource_version: str | None
    allow_bookmarks: bool
    timeout_seconds: int | None


@dataclass(frozen=True)
class _Change:
    """One entry of the history: a pod's new state (``pod``) and its previous (``before``)."""

    rv: int
    kind: str  # ADDED, MODIFIED, DELETED
    pod: Pod
    before: Pod | None

    def seen_by(self, namespace: str, selector: Selector) -> dict[str, Any] | None:
        """The event a watch of ``namespace`` under ``selector`` gets, or None."""
        if self.pod["metadata"]["namespace"] != namespace:
            return None
        now = self.kind != "DELETED" and selector(_labels(self.pod))
        was = self.before is not None and selector(_labels(self.before))
        if self.kind == "DELETED":
            return _as_event("DELETED", self.pod) if selector(_labels(self.pod)) else None
        if now:
            return _as_event("MODIFIED" if was else "ADDED", self.pod)
        if was and self.before is not None:  # stopped matching: its old self, deleted
            gone = copy.deepcopy(self.before)
            gone["metadata"]["resourceVersion"] = str(self.rv)
            return _as_event("DELETED", gone)
        return None


@dataclass
class _Watcher:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_Change | str]  # a change, "bookmark" or "end"

    def push(self, item: _Change | str) -> None:
        with contextlib.suppress(RuntimeError):  # its loop is gone: the server stopped
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


# ---------------------------------------------------------------------------- the server


class FakeKubeApi:
    """Pods in memory, served over HTTP; the control methods are thread-safe."""

    def __init__(
        self,
        *,
        token: str | None = None,
        bookmark_interval_s: float | None = None,
        expire_with_http_status: bool = False,
    ) -> None:
        self.token = token
        self.bookmark_interval_s = bookmark_interval_s
        self.expire_with_http_status = expire_with_http_status
        self.port = 0
        self._lock = threading.Lock()
        self._rv = 1
        self._oldest = 1  # watches from an older resourceVersion get 410
        self._pods: dict[tuple[str, str], Pod] = {}
        self._history: list[_Change] = []
        self._snapshots: dict[int, list[Pod]] = {}  # list snapshots by resourceVersion
        self._watchers: list[_Watcher] = []
        self._blocked = False
        self._closing = False  # stop() under way: requests get 503
        self._held: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._lists: list[ListRequest] = []
        self._watches: list[WatchRequest] = []
        self._expired = 0
        self._running: contextlib.ExitStack | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Serve on 127.0.0.1 (the same port as before after a ``stop()``)."""
        server = make_server(self, host="127.0.0.1", port=self.port, lifespan="off")
        self._closing = False
        stack = contextlib.ExitStack()
        self.port = stack.enter_context(serving([server], start_timeout=10.0))[0]
        self._running = stack

    def stop(self) -> None:
        """End every watch and stop serving: clients see the connection end, then 503 until
        the port refuses connections."""
        with self._lock:
            self._closing = True
        self.unblock_watches()
        self.end_watches()
        if self._running is not None:
            self._running.close()
            self._running = None

    def __enter__(self) -> FakeKubeApi:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, *, namespace: str | None = None) -> Path:
        """A kubeconfig whose current context points at this server (with its token)."""
        context: dict[str, Any] = {"cluster": "fake", "user": "fake"}
        if namespace is not None:
            context["namespace"] = namespace
        user = {} if self.token is None else {"token": self.token}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": context}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    # -- objects --------------------------------------------------------------------------------

    def put_pod(self, pod: Pod) -> Pod:
        """Create or replace a pod (ADDED / MODIFIED); returns it as stored (uid, rv)."""
        stored = copy.deepcopy(pod)
        meta = stored["metadata"]
        meta.setdefault("namespace", "default")
        with self._lock:
            before = self._pods.get((meta["namespace"], meta["name"]))
            meta["uid"] = (
                before["metadata"]["uid"] if before else meta.get("uid", str(uuid.uuid4()))
            )
            meta.setdefault("creationTimestamp", _CREATED)
            self._record("MODIFIED" if before else "ADDED", stored, before)
            self._pods[(meta["namespace"], meta["name"])] = stored
            return copy.deepcopy(stored)

    def delete_pod(self, name: str, namespace: str = "default") -> bool:
        """Remove a pod at once (DELETED with its final state); False if there was none."""
        with self._lock:
            before = self._pods.pop((namespace, name), None)
            if before is None:
                return False
            self._record("DELETED", copy.deepcopy(before), before)
            return True

    def _record(self, kind: str, pod: Pod, before: Pod | None) -> None:
        self._rv += 1
        pod["metadata"]["resourceVersion"] = str(self._rv)
        change = _Change(self._rv, kind, pod, before)
        self._history.append(change)
        for watcher in self._watchers:
            watcher.push(change)

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    # -- watch control --------------------------------------------------------------------------

    def compact(self) -> None:
        """Forget the history: watches from any older resourceVersion than now get 410."""
        with self._lock:
            self._oldest = self._rv
            self._history.clear()
            self._snapshots.clear()

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the server does at ``timeoutSeconds``."""
        with self._lock:
            for watcher in self._watchers:
                watcher.push("end")

    def send_bookmark(self) -> None:
        """A BOOKMARK now on every open watch that allows bookmarks."""
        with self._lock:
            for watcher in self._watchers:
                watcher.push("bookmark")

    def block_watches(self) -> None:
        """End the open watches and hold new watch requests until ``unblock_watches()``."""
        with self._lock:
            self._blocked = True
        self.end_watches()

    def unblock_watches(self) -> None:
        with self._lock:
            self._blocked = False
            held, self._held = self._held, []
        for loop, future in held:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    # -- what clients asked -------------------------------------------------------------------

    @property
    def lists(self) -> list[ListRequest]:
        with self._lock:
            return list(self._lists)

    @property
    def watches(self) -> list[WatchRequest]:
        with self._lock:
            return list(self._watches)

    @property
    def expired_answers(self) -> int:
        """410s given to watches (ERROR events or HTTP statuses)."""
        with self._lock:
            return self._expired

    @property
    def open_watches(self) -> int:
        with self._lock:
            return len(self._watchers)

    # -- HTTP -----------------------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        """The ASGI app (uvicorn takes a bound method for ASGI 2)."""
        if scope["type"] != "http":
            return
        if self._closing:
            message = "apiserver is shutting down"
            await _respond(send, 503, _status(503, "ServiceUnavailable", message))
            return
        headers = dict(scope["headers"])
        if self.token is not None and headers.get(b"authorization") != (
            b"Bearer " + self.token.encode()
        ):
            await _respond(send, 401, _status(401, "Unauthorized", "Unauthorized"))
            return
        match = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", scope["path"])
        if match is None or scope["method"] != "GET":
            await _respond(send, 404, _status(404, "NotFound", "the server could not find it"))
            return
        query = {k: v[-1] for k, v in parse_qs(scope["query_string"].decode()).items()}
        try:
            selector = parse_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            await _respond(send, 400, _status(400, "BadRequest", str(exc)))
            return
        if _flag(query.get("watch")):
            await self._watch(match[1], selector, query, receive, send)
        else:
            await self._list(match[1], selector, query, send)

    async def _list(
        self, namespace: str, selector: Selector, query: dict[str, str], send: Any
    ) -> None:
        limit = int(query["limit"]) if query.get("limit") else None
        token = query.get("continue") or None
        with self._lock:
            self._lists.append(ListRequest(namespace, query.get("labelSelector", ""), limit, token))
            page = self._page(namespace, selector, limit, token)
        if page is None:
            message = "The provided continue parameter is too old to display a consistent list"
            await _respond(send, 410, _status(410, "Expired", message))
            return
        await _respond(send, 200, page)

    def _page(
        self, namespace: str, selector: Selector, limit: int | None, token: str | None
    ) -> dict[str, Any] | None:
        """One page of a list (under the lock); None when its snapshot was compacted."""
        rv, after = (self._rv, "") if token is None else _decode_token(token)
        if token is None:
            self._snapshots[rv] = [copy.deepcopy(p) for _, p in sorted(self._pods.items())]
            for old in sorted(self._snapshots)[:-_MAX_SNAPSHOTS]:
                del self._snapshots[old]
        snapshot = self._snapshots.get(rv)
        if snapshot is None:
            return None
        matching = [
            p
            for p in snapshot
            if p["metadata"]["namespace"] == namespace
            and selector(_labels(p))
            and p["metadata"]["name"] > after
        ]
        items = matching[:limit] if limit else matching
        metadata: dict[str, Any] = {"resourceVersion": str(rv)}
        if len(items) < len(matching):
            metadata["continue"] = _encode_token(rv, items[-1]["metadata"]["name"])
            metadata["remainingItemCount"] = len(matching) - len(items)
        return {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}

    async def _watch(
        self,
        namespace: str,
        selector: Selector,
        query: dict[str, str],
        receive: Any,
        send: Any,
    ) -> None:
        since = query.get("resourceVersion") or None
        bookmarks = _flag(query.get("allowWatchBookmarks"))
        timeout = int(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        request = WatchRequest(namespace, query.get("labelSelector", ""), since, bookmarks, timeout)
        await self._pass_gate(request)
        watcher = _Watcher(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            first = self._start_watch(namespace, selector, since, watcher)
        if isinstance(first, dict):  # expired
            if self.expire_with_http_status:
                await _respond(send, 410, first)
            else:
                await _start_stream(send)
                await _chunk(send, _line({"type": "ERROR", "object": first}), more=False)
            return
        try:
            await _start_stream(send)
            for event in first:
                await _chunk(send, _line(event))
            await self._stream(watcher, namespace, selector, bookmarks, timeout, receive, send)
        finally:
            with self._lock:
                self._watchers.remove(watcher)

    async def _pass_gate(self, request: WatchRequest) -> None:
        with self._lock:
            self._watches.append(request)
            future: asyncio.Future[None] | None = None
            if self._blocked:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._held.append((loop, future))
        if future is not None:
            await future

    def _start_watch(
        self, namespace: str, selector: Selector, since: str | None, watcher: _Watcher
    ) -> list[dict[str, Any]] | dict[str, Any]:
        """The events to send first, registering ``watcher`` (under the lock); or the 410
        Status when ``since`` is older than the history."""
        if since in (None, "0"):
            pods = sorted(self._pods.items())
            first = [_as_event("ADDED", p) for (ns, _), p in pods if ns == namespace]
            first = [e for e in first if selector(_labels(e["object"]))]
        elif int(since) < self._oldest:
            self._expired += 1
            message = f"too old resource version: {since} ({self._oldest})"
            return _status(410, "Expired", message)
        else:
            changes = (c.seen_by(namespace, selector) for c in self._history if c.rv > int(since))
            first = [event for event in changes if event is not None]
        self._watchers.append(watcher)
        return first

    async def _stream(
        self,
        watcher: _Watcher,
        namespace: str,
        selector: Selector,
        bookmarks: bool,
        timeout: int | None,
        receive: Any,
        send: Any,
    ) -> None:
        disconnected = asyncio.create_task(_until_disconnect(receive, watcher))
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        try:
            for _ in itertools.count():
                wait = _wait_s(
                    loop.time(), deadline, self.bookmark_interval_s if bookmarks else None
                )
                try:
                    async with asyncio.timeout(wait):
                        item = await watcher.queue.get()
                except TimeoutError:
                    if deadline is not None and loop.time() >= deadline:
                        break
                    item = "bookmark"
                if item == "end":
                    break
                event = self._event_for(item, namespace, selector, bookmarks)
                if event is not None:
                    await _chunk(send, _line(event))
            await _chunk(send, b"", more=False)
        finally:
            disconnected.cancel()

    def _event_for(
        self, item: _Change | str, namespace: str, selector: Selector, bookmarks: bool
    ) -> dict[str, Any] | None:
        if isinstance(item, _Change):
            return item.seen_by(namespace, selector)
        if not bookmarks:
            return None
        rv = str(self.resource_version)
        return {
            "type": "BOOKMARK",
            "object": {"kind": "Pod", "apiVersion": "v1", "metadata": {"resourceVersion": rv}},
        }


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return value in ("1", "t", "T", "true", "TRUE", "True")


def _wait_s(now: float, deadline: float | None, bookmark_s: float | None) -> float | None:
    waits = [w for w in (None if deadline is None else deadline - now, bookmark_s) if w is not None]
    return max(0.0, min(waits)) if waits else None


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def _until_disconnect(receive: Any, watcher: _Watcher) -> None:
    for _ in itertools.count():
        message = await receive()
        if message["type"] == "http.disconnect":
            watcher.queue.put_nowait("end")
            return


def _encode_token(rv: int, after: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"rv": rv, "start": after}).encode()).decode()


def _decode_token(token: str) -> tuple[int, str]:
    data = json.loads(base64.urlsafe_b64decode(token.encode()))
    return int(data["rv"]), str(data["start"])


async def _respond(send: Any, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def _start_stream(send: Any) -> None:
    """200 without a length: uvicorn sends it chunked, as the API server streams a watch."""
    headers = [(b"content-type", b"application/json"), (b"transfer-encoding", b"chunked")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def _chunk(send: Any, data: bytes, *, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})
