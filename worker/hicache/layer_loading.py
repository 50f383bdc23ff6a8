"""Layer-by-layer loading of KV pages into the device pool, and the forward pass that uses it.

After SGLang's ``LayerDoneCounter``: a load of cached pages into L1 proceeds one layer at a time
(layer ``i``'s K and V slices of every page), and the forward pass over the uncached tokens
computes layer ``i`` as soon as layer ``i`` of the load is in, so loading and computing overlap.

``LayerLoad`` is one load's progress: the loader ``mark``s each layer (in order) once its slices
are in L1, ``await wait(i)`` returns when layer ``i`` is. ``run_layers`` drives one: layer ``i``
lands at ``start + (i + 1) * (end - start) / layers`` (the link's reservation, see
``worker.hicache.costs``), copied by ``copy_layer(i)`` at that moment. ``simulate_forward`` is the
simulated forward pass: ``compute_s`` split evenly over the layers, layer ``i`` waiting for layer
``i`` of the load (``layerwise``), or the whole load first (not ``layerwise``); without a load it
is the plain single sleep the worker has always done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from worker.hicache.costs import sleep_until

__all__ = ["LayerLoad", "run_layers", "simulate_forward"]


class LayerLoad:
    """Which layers of one load are in L1 (``layers`` of them, landing in order)."""

    def __init__(self, layers: int) -> None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.layers = layers
        self._done = [asyncio.Event() for _ in range(layers)]
        self._error: BaseException | None = None

    @property
    def complete(self) -> bool:
        return self._done[-1].is_set() and self._error is None

    def mark(self, layer: int) -> None:
        """Layer ``layer`` (and every layer before it) is in L1."""
        for event in self._done[: layer + 1]:
            event.set()

    def fail(self, error: BaseException) -> None:
        """The load ended without its layers: every waiter gets ``error``."""
        self._error = error
        for event in self._done:
            event.set()

    async def wait(self, layer: int) -> None:
        """Return once layer ``layer`` is in L1; raise the error the load failed with."""
        await self._done[min(layer, self.layers - 1)].wait()
        if self._error is not None:
            raise self._error


async def run_layers(
    load: LayerLoad, start: float, end: float, copy_layer: Callable[[int], None]
) -> None:
    """Land ``load``'s layers evenly over ``[start, end]`` (monotonic), each copied by
    ``copy_layer`` when it lands. A failure or cancellation fails the load's waiters."""
    step = (end - start) / load.layers
    try:
        for layer in range(load.layers):
            await sleep_until(start + step * (layer + 1))
            copy_layer(layer)
            load.mark(layer)
    except BaseException as exc:
        load.fail(exc if isinstance(exc, Exception) else RuntimeError("the load was cancelled"))
        raise


async def simulate_forward(
    compute_s: float, layers: int, load: LayerLoad | None = None, layerwise: bool = True
) -> None:
    """The simulated forward pass of ``compute_s`` seconds over ``layers`` layers, overlapping
    ``load`` layer by layer when ``layerwise`` (module docstring)."""
    if load is None:
        if compute_s:
            await asyncio.sleep(compute_s)
        return
    if not layerwise:
        await load.wait(layers - 1)
        if compute_s:
            await asyncio.sleep(compute_s)
        return
    per_layer = compute_s / layers
    for layer in range(layers):
        await load.wait(layer)
        if per_layer:
            await asyncio.sleep(per_layer)
