"""Worker selection policies and the name -> implementation table."""

from __future__ import annotations

from collections.abc import Callable

from router.policies.base import Policy, least_loaded_rank
from router.policies.least_load import LeastLoad
from router.policies.power_of_two import PowerOfTwo
from router.policies.round_robin import RoundRobin

__all__ = ["POLICIES", "Policy", "build_policy", "least_loaded_rank"]

POLICIES: dict[str, Callable[[], Policy]] = {
    "round_robin": RoundRobin,
    "least_load": LeastLoad,
    "power_of_two": PowerOfTwo,
}


def build_policy(name: str) -> Policy:
    """A fresh policy instance; raises ValueError naming the valid choices."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    return factory()
