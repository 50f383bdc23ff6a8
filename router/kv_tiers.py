"""KV cache tiers: where a cached block lives at a rank, and what a block there is worth.

Engines with a tiered KV cache (SGLang HiCache, vLLM's offloading connector) report each block's
``medium`` in ``BlockStored`` / ``BlockRemoved`` (docs/concepts/protocols.md section 7.2): ``GPU``
(device
memory), ``CPU_PINNED`` (host memory; vLLM's offloading connector says ``CPU``) and ``DISK``
(storage). A block may be in several tiers at once (write-through copies it to host and disk
while it stays on the GPU). A block only on a lower tier is still a hit, but the engine must load
it back before the prefill can use it, so ``cache_aware`` credits it less than a device block:
``TierWeights``. ``EXTERNAL`` (SGLang's remote store) and unknown mediums have no tier here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from types import MappingProxyType

__all__ = [
    "DEFAULT_TIER_WEIGHTS",
    "Tier",
    "TierMatch",
    "TierWeights",
    "check_tier_weights",
    "parse_tier_weights",
    "tier_of_medium",
]


class Tier(IntEnum):
    """A KV cache tier; a lower value is a better (faster) tier."""

    GPU = 0
    HOST = 1
    DISK = 2

    @property
    def medium(self) -> str:
        """The tier's name in KV events, metrics and settings."""
        return _MEDIUM_OF[self]


_MEDIUM_OF = {Tier.GPU: "GPU", Tier.HOST: "CPU_PINNED", Tier.DISK: "DISK"}
_TIER_OF = {
    **{medium: tier for tier, medium in _MEDIUM_OF.items()},
    "CPU": Tier.HOST,  # vLLM's offloading connector
}

# The credit of a block found only on that tier, a GPU block being 1.0: the share of
# recomputing it that loading it back saves. Measured by bench/kv_tiers/main.py (pd-worker,
# 4096-token
# prefix, 200 us/token): host 0.82-1.00 (mean 0.93), disk 0.69-0.80 (mean 0.73) over four
# layerwise on/off runs; rounded down, as a tier's cost grows with load on its link and disk.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = MappingProxyType({"CPU_PINNED": 0.9, "DISK": 0.7})


def tier_of_medium(medium: str | None) -> Tier | None:
    """The tier of an event's ``medium`` (``None``: an engine that does not say, the GPU);
    ``None`` for a medium without a tier here (``EXTERNAL``, unknown)."""
    if medium is None:
        return Tier.GPU
    tier = _TIER_OF.get(medium)
    return tier if tier is not None else _TIER_OF.get(medium.upper())


def parse_tier_weights(text: str) -> dict[str, float]:
    """``TIER=WEIGHT[,TIER=WEIGHT...]`` (``--cache-tier-weights``) as a mapping; raises
    ValueError naming the bad item. Checking tiers and ranges is ``check_tier_weights``'s."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, sep, value = (part.strip() for part in item.partition("="))
        try:
            weight = float(value) if sep and name else None
        except ValueError:
            weight = None
        if weight is None:
            raise ValueError(f"expected TIER=WEIGHT (e.g. DISK=0.4), got {item.strip()!r}")
        if name in weights:
            raise ValueError(f"tier {name!r} is given twice")
        weights[name] = weight
    return weights


def check_tier_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """The weights of every lower tier by its medium name (``CPU`` read as ``CPU_PINNED``,
    names case-insensitive; a tier not given keeps its default). Raises ValueError for an
    unknown tier, a weight outside 0..1, a tier given twice, or a GPU weight other than 1."""
    checked = dict(DEFAULT_TIER_WEIGHTS)
    seen: set[Tier] = set()
    for name, weight in weights.items():
        tier = tier_of_medium(name)
        if tier is None:
            known = ", ".join([*_MEDIUM_OF.values(), "CPU"])
            raise ValueError(f"unknown KV cache tier {name!r}; known tiers: {known}")
        if tier in seen:
            raise ValueError(f"tier {tier.medium} is given twice ({name!r})")
        seen.add(tier)
        if not 0.0 <= weight <= 1.0:
            raise ValueError(f"the weight of tier {name!r} must be within 0..1, got {weight:g}")
        if tier is Tier.GPU:
            if weight != 1.0:
                raise ValueError("the GPU tier's weight is always 1.0")
            continue
        checked[tier.medium] = weight
    return checked


@dataclass(frozen=True, slots=True)
class TierWeights:
    """The credit of a matched block per tier, indexed by ``Tier`` (GPU: 1.0)."""

    by_tier: tuple[float, float, float] = (
        1.0,
        DEFAULT_TIER_WEIGHTS["CPU_PINNED"],
        DEFAULT_TIER_WEIGHTS["DISK"],
    )

    @classmethod
    def from_mapping(cls, weights: Mapping[str, float]) -> TierWeights:
        """From settings' ``tier_weights`` (medium name -> weight), checked."""
        checked = check_tier_weights(weights)
        return cls((1.0, checked[Tier.HOST.medium], checked[Tier.DISK.medium]))


@dataclass(frozen=True, slots=True)
class TierMatch:
    """A location's leading run of a prompt's blocks held in any tier, each block counted once,
    at the best tier holding it (predicted blocks count as GPU)."""

    by_tier: tuple[int, int, int]
    """Matched blocks per ``Tier``."""

    @property
    def blocks(self) -> int:
        """The run's length in blocks."""
        return sum(self.by_tier)

    def credited(self, weights: TierWeights) -> float:
        """The run's worth in GPU blocks: each block weighs its tier's weight."""
        return sum(n * w for n, w in zip(self.by_tier, weights.by_tier, strict=True))

    def as_dict(self) -> dict[str, int]:
        """Matched blocks per tier, by medium name."""
        return {tier.medium: self.by_tier[tier] for tier in Tier}
