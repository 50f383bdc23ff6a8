"""The registry's exception tree.

RegistryError
├── NotFound               a worker, rank, key or engine-API namespace does not exist
├── Conflict               a registration contradicts the registered one (vLLM engine id mismatch)
├── BadEngineApiRequest    an engine's bootstrap API call with missing or invalid fields (400)
├── TooManyNamespaces      a bootstrap API call would create a namespace beyond the cap (429)
├── RegistryUnavailable    the store cannot be reached (etcd down); callers keep their last view
└── ConfigurationError     a bad store URL, a missing optional dependency
"""

from __future__ import annotations

__all__ = [
    "BadEngineApiRequest",
    "ConfigurationError",
    "Conflict",
    "NotFound",
    "RegistryError",
    "RegistryUnavailable",
    "TooManyNamespaces",
]


class RegistryError(Exception):
    """Base of every error the registry package raises."""


class NotFound(RegistryError):
    pass


class Conflict(RegistryError):
    pass


class BadEngineApiRequest(RegistryError):
    """An engine's bootstrap API call with missing or invalid fields (answered 400)."""


class TooManyNamespaces(RegistryError):
    """A bootstrap API call would create one namespace more than the cap (answered 429)."""


class RegistryUnavailable(RegistryError):
    pass


class ConfigurationError(RegistryError):
    pass
