"""FastAPI dependencies of the cold routes: the lifespan-owned context."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from router.context import AppContext

__all__ = ["Context", "get_context"]


def get_context(request: Request) -> AppContext:
    """The one dependency that reads the lifespan-owned context."""
    ctx: AppContext = request.state.ctx
    return ctx


Context = Annotated[AppContext, Depends(get_context)]
