"""Worker selection policies and the name -> implementation table."""

from __future__ import annotations

from collections.abc import Callable

from router.kv_cache.index import KVBlockIndex
from router.kv_cache.prefix_tree import ApproxPrefixTree
from router.scheduling.policies.base import LoadPolicy, Policy, PrefillChoice, least_loaded_rank
from router.scheduling.policies.cache_aware import CacheAware
from router.scheduling.policies.least_load import LeastLoad
from router.scheduling.policies.power_of_two import PowerOfTwo
from router.scheduling.policies.round_robin import RoundRobin
from router.settings import CacheAwareSettings, PolicySettings

__all__ = [
    "CACHE_AWARE",
    "POLICIES",
    "CacheAware",
    "LoadPolicy",
    "Policy",
    "PrefillChoice",
    "build_policies",
    "build_policy",
    "least_loaded_rank",
]

CACHE_AWARE = CacheAware.name

POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
    # a prefill policy: with ``--policy cache_aware`` the decode side is least_load. The
    # router's context builds it over the shared index (``CacheAware(settings, index=...)``).
    CACHE_AWARE: CacheAware,
}


def build_policy(name: str) -> Policy:
    """A fresh policy instance; raises ValueError naming the valid choices."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory()


def build_policies(
    settings: PolicySettings,
    cache: CacheAwareSettings,
    index: KVBlockIndex,
    tree: ApproxPrefixTree,
    model: str | None = None,
) -> tuple[Policy, Policy]:
    """The (prefill, decode) policies, of ``model``'s pool (None: the whole fleet's).
    ``cache_aware`` works over the shared ``index`` (fed by the KV event feed) and ``tree``; as
    ``--policy`` (or a model's ``--model-policy``) it applies to the prefill side only, and the
    decode side is least_load (a decode's cache is not what makes a prefill fast)."""
    own = settings.model_policies.get(model) if model else None
    if own is not None:
        prefill_name, decode_name = own, "least_load" if own == CACHE_AWARE else own
    else:
        prefill_name = settings.prefill_policy or settings.policy
        decode_name = settings.decode_policy or (
            "least_load" if settings.policy == CACHE_AWARE else settings.policy
        )
    if prefill_name == CACHE_AWARE:
        prefill: Policy = CacheAware(cache, index=index, tree=tree)
    else:
        prefill = build_policy(prefill_name)
    return prefill, build_policy(decode_name)
