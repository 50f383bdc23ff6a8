"""PD protocol adapters and the engine name -> adapter table (pure rewrites).

May import: the top level only.
"""

from __future__ import annotations

from collections.abc import Callable

from router.adapters.base import LegPlan, PDAdapter
from router.adapters.sglang import SglangAdapter
from router.adapters.vllm_mooncake import VllmMooncakeAdapter
from router.adapters.vllm_nixl import VllmNixlAdapter
from router.settings import EngineProtocol

__all__ = [
    "ADAPTERS",
    "LegPlan",
    "PDAdapter",
    "SglangAdapter",
    "VllmMooncakeAdapter",
    "VllmNixlAdapter",
    "build_adapter",
]

ADAPTERS: dict[EngineProtocol, Callable[[], PDAdapter]] = {
    EngineProtocol.VLLM_MOONCAKE: VllmMooncakeAdapter,
    EngineProtocol.VLLM_NIXL: VllmNixlAdapter,
    EngineProtocol.SGLANG: SglangAdapter,
}


def build_adapter(engine: EngineProtocol) -> PDAdapter:
    return ADAPTERS[engine]()
