"""The store seam over HTTP, under ``/store``: what ``HttpStore`` (``http://`` store URLs) calls.

| route | answer |
|---|---|
| ``GET /store/keys/{key}`` | the raw value (``application/octet-stream``); 404 when missing |
| ``PUT /store/keys/{key}?ttl=S`` | the raw body becomes the value; 204 |
| ``POST /store/refresh/{key}`` | ``{"alive": bool}`` |
| ``DELETE /store/keys/{key}`` | ``{"deleted": bool}`` |
| ``GET /store/list?prefix=P`` | ``{key: base64 value}`` |
| ``GET /store/watch?prefix=P`` | a stream of JSON lines (``application/x-ndjson``), see below |

The watch stream: first ``{"kind": "ready"}``, sent once the store's ``watch()`` has returned (so
the watch covers what that store's contract says it covers from then on); then one line per
``WatchEvent``, ``{"kind": "put"|"delete", "key", "value" (base64 or null), "revision"}``; a
``{"kind": "keepalive"}`` line after every ``KEEPALIVE_S`` without one, so a client can tell a
dead server from a quiet one; and, when the store's watch raises ``RegistryUnavailable``, a last
``{"kind": "error", "message"}`` line. The stream ends when the store's watch ends (store closed).

A missing key's 404 carries ``X-Store-Missing: 1``, which tells it from a server without these
routes. ``RegistryUnavailable`` from any other call is a 503. A ``PUT`` body is read up to
``max_body_bytes`` (413 beyond). Auth is the mounting app's: the standalone registry mounts these
routes behind the admin API's, so the OpenAPI schema documents its 401 and 403 (``ADMIN_RESPONSES``)
with the 503, and a ``ttl`` not above 0 as the 422 error JSON the registry renders.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi.responses import StreamingResponse

from registry.admin import ADMIN_RESPONSES, DEFAULT_MAX_BODY_BYTES, read_bounded_body
from registry.backends.base import RegistryStore, WatchEvent
from registry.error_schema import error_doc
from registry.errors import RegistryUnavailable

__all__ = ["KEEPALIVE_S", "MISSING_HEADER", "store_routes"]

KEEPALIVE_S = 5.0
MISSING_HEADER = "X-Store-Missing"  # tells a missing key from a server without these routes

_Item = WatchEvent | RegistryUnavailable | None  # None: the store's watch ended

# what the OpenAPI schema says besides ADMIN_RESPONSES (auth, 503). A key holding a line break
# matches no route (starlette's ``path`` convertor is ``.*``): a 404 error JSON.
_Responses = dict[int | str, dict[str, Any]]
_INVALID_PARAMETER: _Responses = {422: error_doc("Invalid parameter")}
_NO_ROUTE: _Responses = {404: error_doc("No route for the key: it holds a line break")}
_BINARY = {"schema": {"type": "string", "format": "binary"}}
_GET_VALUE_RESPONSES: _Responses = {
    200: {"description": "The raw value", "content": {"application/octet-stream": _BINARY}},
    404: {
        "description": f"No such key ({MISSING_HEADER}: 1, no body); without that header, an "
        "error JSON: no route for the key (it holds a line break)",
        "headers": {MISSING_HEADER: {"schema": {"type": "string", "enum": ["1"]}}},
    },
}
_PUT_VALUE_RESPONSES: _Responses = {
    **_NO_ROUTE,
    422: error_doc("Invalid parameter (a ttl not above 0)"),
    413: error_doc("Body over the size limit"),
}
_PUT_VALUE_BODY = {"requestBody": {"content": {"application/octet-stream": _BINARY}}}
_WATCH_RESPONSES: _Responses = {
    200: {
        "description": "JSON lines: ready, then put/delete events, keepalives, a last error",
        "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
    }
}


@contextlib.contextmanager
def _unavailable_is_503() -> Iterator[None]:
    try:
        yield
    except RegistryUnavailable as exc:
        raise HTTPException(503, f"registry store unavailable: {exc}") from exc


def _line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def _event_line(event: WatchEvent) -> bytes:
    value = None if event.value is None else base64.b64encode(event.value).decode()
    return _line({"kind": event.kind, "key": event.key, "value": value, "revision": event.revision})


async def _pump(events: AsyncIterator[WatchEvent], queue: asyncio.Queue[_Item]) -> None:
    """Owns the store's watch: iterating it in one task lets the stream wait with a deadline."""
    try:
        async for event in events:
            queue.put_nowait(event)
    except RegistryUnavailable as exc:
        queue.put_nowait(exc)
    else:
        queue.put_nowait(None)


async def _watch_lines(
    store: RegistryStore, prefix: str, keepalive_s: float
) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    try:
        events = store.watch(prefix)
    except RegistryUnavailable as exc:
        yield _line({"kind": "error", "message": str(exc)})
        return
    pump = asyncio.create_task(_pump(events, queue), name="store-watch-pump")
    try:
        yield _line({"kind": "ready"})
        while True:
            try:
                async with asyncio.timeout(keepalive_s):
                    item = await queue.get()
            except TimeoutError:
                yield _line({"kind": "keepalive"})
                continue
            if item is None:
                return
            if isinstance(item, RegistryUnavailable):
                yield _line({"kind": "error", "message": str(item)})
                return
            yield _event_line(item)
    finally:
        pump.cancel()  # no await: the pump closes the store's watch in its own task


def store_routes(
    store_of: Callable[[Request], RegistryStore],
    *,
    keepalive_s: float = KEEPALIVE_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> APIRouter:
    """The ``/store`` routes over the store ``store_of`` reads from the mounting app's context."""
    router = APIRouter(prefix="/store", responses={**ADMIN_RESPONSES, **_INVALID_PARAMETER})

    def store(request: Request) -> RegistryStore:  # typed, so any callable (a lambda) will do
        return store_of(request)

    # Depends() as a default: this name is local, so a string annotation could not resolve it.
    store_dep = Depends(store)
    _value_routes(router, store_dep, max_body_bytes)
    _listing_routes(router, store_dep, keepalive_s)
    return router


def _value_routes(router: APIRouter, store_dep: Any, max_body_bytes: int) -> None:
    """Get, put, refresh and delete one key."""

    @router.get("/keys/{key:path}", response_class=Response, responses=_GET_VALUE_RESPONSES)
    async def get_value(key: str, store: RegistryStore = store_dep) -> Response:
        with _unavailable_is_503():
            value = await store.get(key)
        if value is None:
            return Response(status_code=404, headers={MISSING_HEADER: "1"})
        return Response(value, media_type="application/octet-stream")

    @router.put(
        "/keys/{key:path}",
        status_code=204,
        response_class=Response,
        responses=_PUT_VALUE_RESPONSES,
        openapi_extra=_PUT_VALUE_BODY,
    )
    async def put_value(
        key: str,
        request: Request,
        ttl: Annotated[float | None, Query(gt=0)] = None,
        store: RegistryStore = store_dep,
    ) -> Response:
        value = await read_bounded_body(request, max_body_bytes)
        with _unavailable_is_503():
            await store.put(key, value, ttl=ttl)
        return Response(status_code=204)

    @router.post("/refresh/{key:path}", responses=_NO_ROUTE)
    async def refresh(key: str, store: RegistryStore = store_dep) -> dict[str, bool]:
        with _unavailable_is_503():
            return {"alive": await store.refresh(key)}

    @router.delete("/keys/{key:path}", responses=_NO_ROUTE)
    async def delete(key: str, store: RegistryStore = store_dep) -> dict[str, bool]:
        with _unavailable_is_503():
            return {"deleted": await store.delete(key)}


def _listing_routes(router: APIRouter, store_dep: Any, keepalive_s: float) -> None:
    """List the keys under a prefix, and watch them change (NDJSON)."""

    @router.get("/list")
    async def list_values(prefix: str = "", store: RegistryStore = store_dep) -> dict[str, str]:
        with _unavailable_is_503():
            values = await store.list(prefix)
        return {key: base64.b64encode(value).decode() for key, value in values.items()}

    @router.get("/watch", response_class=Response, responses=_WATCH_RESPONSES)
    async def watch(prefix: str = "", store: RegistryStore = store_dep) -> Response:
        return StreamingResponse(
            _watch_lines(store, prefix, keepalive_s),
            media_type="application/x-ndjson",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )
