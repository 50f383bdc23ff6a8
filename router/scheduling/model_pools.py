"""Several models behind one router: each request goes to the pool of workers serving its model.

A worker serves the model names it declares (``--prefill URL ... model=NAME``, its registry
record) or, when it declares none, those its ``/v1/models`` lists (read by the health prober when
it joins or comes back). A worker that names none is a candidate for every model: a fleet where
no worker names a model routes as one pool, as before.

Each model gets its own ``RouteChooser`` (made on first use, with fresh policies: round-robin
cursors and cache-aware state per pool) over the workers serving it. The KV index, loads,
breakers and pair ledgers are per worker already, so a pool's requests only ever weigh its own
workers: a prefix cached by one model's prefill never attracts another model's request.

``--model-alias ALIAS=NAME`` maps a name clients send to a served one; the body goes to the
engines with the served name. A model no worker serves (and no worker without names could) is a
404 naming the models served. Bounds: choosers only for served names (at most
``MAX_MODELS_PER_WORKER`` per worker), dropped when their model is no longer served.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from router.errors import ModelNotFound
from router.scheduling.chooser import RouteChooser
from router.schemas import ParsedRequest
from router.upstream.base import UpstreamPool

__all__ = ["ModelPools"]


class ModelPools:
    """The chooser for each request's model; ``default``: the whole fleet's (no model named by
    any worker), ``new_chooser(model)``: a fresh one for ``model``'s pool."""

    def __init__(
        self,
        pool: UpstreamPool,
        default: RouteChooser,
        new_chooser: Callable[[str | None], RouteChooser],
        aliases: Mapping[str, str],
    ) -> None:
        self._pool = pool
        self.default = default
        self._new_chooser = new_chooser
        self.aliases = dict(aliases)
        self._choosers: dict[str, RouteChooser] = {}
        self._served: frozenset[str] = frozenset()

    def chooser_for(self, request: ParsedRequest) -> RouteChooser:
        """The chooser of the request's model (its alias resolved in the body); raises
        ModelNotFound when no worker serves it."""
        name = self.pool_of(request.body)
        if name is None:
            return self.default
        if self._pool.models is not self._served:
            self._prune(self._pool.models)
        chooser = self._choosers.get(name)
        if chooser is None:  # "": a name served by no one, routes among the unnamed workers
            chooser = self._choosers[name] = self._new_chooser(name)
        return chooser

    def pool_of(self, body: dict[str, Any]) -> str | None:
        """The pool of the model ``body`` names (its alias resolved in ``body``): None for the
        whole fleet (no model named, or no worker names one), the model's name, or "" (a name
        no worker serves: the workers that name none); raises ModelNotFound when no worker
        could serve it."""
        name = body.get("model")
        if not isinstance(name, str):
            return None
        target = self.aliases.get(name)
        if target is not None:
            body["model"] = name = target
        pool = self._pool
        if not pool.models:  # no worker names a model: one pool
            return None
        if name in pool.models:
            return name
        if not pool.wildcards:
            raise ModelNotFound(
                f"the model {name!r} does not exist here; served: {', '.join(self.served())}"
            )
        return ""

    @property
    def several(self) -> bool:
        """Whether the workers serve more than one model (or some name none): only then is a
        request's pool worth naming in its receipt and counting."""
        pool = self._pool
        return len(pool.models) > 1 or (bool(pool.models) and pool.wildcards)

    def served(self) -> list[str]:
        """The model names served, then the aliases, sorted."""
        return sorted(self._pool.models) + sorted(self.aliases)

    def _prune(self, served: frozenset[str]) -> None:
        self._served = served
        for name in [n for n in self._choosers if n and n not in served]:
            del self._choosers[name]
