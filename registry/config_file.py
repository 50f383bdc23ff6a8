"""The product's config files (``router --config``, ``pd-worker --config``): one YAML or TOML
mapping, bounded, read safely. Here on the ground floor because the router and the worker both
read them and both may import ``registry`` (not each other); what the keys mean is theirs
(``router.settings.config_file``, ``worker.config_file``).

At most ``MAX_CONFIG_BYTES``; YAML with the safe loader (no tags, no objects), one document; an
empty file is an empty mapping.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

__all__ = ["MAX_CONFIG_BYTES", "ConfigFileError", "read_config_file", "unknown_setting"]

MAX_CONFIG_BYTES = 1024 * 1024
_YAML = (".yaml", ".yml")
_TOML = (".toml",)


class ConfigFileError(ValueError):
    """The file cannot be read, is not a mapping of settings, or has a key the settings do not."""


def read_config_file(path: Path) -> dict[Any, Any]:
    """The file's top-level mapping (``{}`` for an empty file), its keys not yet checked."""
    suffix = path.suffix.lower()
    if suffix not in _YAML + _TOML:
        raise ConfigFileError(f"{path}: a .yaml, .yml or .toml file, please")
    try:
        with path.open("rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(f"{path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigFileError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = tomllib.loads(raw.decode()) if suffix in _TOML else yaml.safe_load(raw)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        kind = suffix[1:].upper()
        raise ConfigFileError(f"{path}: not valid {kind}: {_first_line(exc)}") from None
    if data is None:
        return {}  # an empty file: every setting from elsewhere or its default
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level is not a mapping of settings")
    return data


def unknown_setting(path: Path, key: str, known: Iterable[str], at: str = "") -> ConfigFileError:
    """The error for ``at + key``, a key the settings at ``at`` (names ``known``) do not have,
    naming the nearest one there is."""
    near = difflib.get_close_matches(key, list(known), n=1)
    hint = f" (did you mean {at + near[0]!r}?)" if near else ""
    return ConfigFileError(f"{path}: unknown setting {at + key!r}{hint}")


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
