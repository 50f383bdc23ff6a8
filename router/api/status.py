"""The live status page: ``GET /status`` (HTML), ``GET /status/data`` (its JSON), ``GET /``.

The page is one self-contained file (``router/api/status_page.html``: inline CSS and JS, no external
assets, no build step, since the router runs in closed networks), read once at import. It polls
``/status/data`` (``router.api.status_view``) every two seconds and renders it.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from router.api.deps import Context
from router.api.status_view import status_snapshot

__all__ = ["router"]

router = APIRouter()

_PAGE = resources.files("router.api").joinpath("status_page.html").read_text(encoding="utf-8")
_NO_STORE = {"Cache-Control": "no-store"}


@router.get("/", include_in_schema=False)
async def root() -> RedirectResponse:
    """The router's front door leads to its status page."""
    return RedirectResponse("/status", status_code=307)


@router.get("/status", response_class=HTMLResponse)
async def status_page() -> HTMLResponse:
    """The status page (it fetches its data from ``/status/data``)."""
    return HTMLResponse(_PAGE, headers=_NO_STORE)


@router.get("/status/data")
async def status_data(ctx: Context) -> JSONResponse:
    """Workers, P<->D pairs, recent traffic, registry and KV event feeds, as JSON; with
    `--workers N`, each router process too (`processes`), and the traffic of them all."""
    snapshot = status_snapshot(ctx)
    siblings = ctx.telemetry.siblings
    if siblings is None:
        snapshot["processes"] = None
        return JSONResponse(snapshot, headers=_NO_STORE)
    processes = await siblings.processes()
    windows = [process.pop("traffic", None) for process in processes]
    snapshot["traffic"] = ctx.telemetry.traffic.merged(windows)
    snapshot["processes"] = processes
    return JSONResponse(snapshot, headers=_NO_STORE)
