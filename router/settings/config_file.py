"""``router --config FILE``: every setting from a YAML or TOML file, below the environment and
the flags (defaults < file < ``PDR_*`` < flags).

The file is the settings tree as ``router config show`` prints it: sections as mappings, the
workers as lists of mappings (``prefill: [{url: ..., bootstrap_port: 8998}]``). A key the tree
does not have is an error naming its path (and the nearest name there is): a typo never passes
silently. Bounded: at most ``MAX_CONFIG_BYTES``; YAML is read with the safe loader (no tags,
no objects), one document.
"""

from __future__ import annotations

import difflib
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

__all__ = ["MAX_CONFIG_BYTES", "ConfigFileError", "load_config_file", "merged", "unknown_keys"]

MAX_CONFIG_BYTES = 1024 * 1024
_YAML = (".yaml", ".yml")
_TOML = (".toml",)


class ConfigFileError(ValueError):
    """The file cannot be read, is not a settings tree, or has a key the settings do not."""


def load_config_file(path: Path, model: type[BaseModel]) -> dict[str, Any]:
    """The file's settings tree, its keys checked against ``model``'s."""
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
        return {}  # an empty file: every setting from the environment, the flags or its default
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level is not a mapping of settings")
    for key, near in unknown_keys(model, data):
        hint = f" (did you mean {near!r}?)" if near else ""
        raise ConfigFileError(f"{path}: unknown setting {key!r}{hint}")
    return data


def unknown_keys(
    model: type[BaseModel], data: Mapping[Any, Any], at: str = ""
) -> Iterator[tuple[str, str | None]]:
    """``(dotted path, nearest known path or None)`` of every key of ``data`` that ``model``
    (and the models of its fields, within lists too) does not have."""
    fields = model.model_fields
    for key, value in data.items():
        field = fields.get(key) if isinstance(key, str) else None
        path = f"{at}{key}"
        if field is None:
            near = difflib.get_close_matches(str(key), list(fields), n=1)
            yield path, f"{at}{near[0]}" if near else None
            continue
        inner = _model_in(field.annotation)
        if inner is None:
            continue
        if isinstance(value, dict):
            yield from unknown_keys(inner, value, f"{path}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, dict):
                    yield from unknown_keys(inner, item, f"{path}[{index}].")


def merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``over`` on top, mappings merged key by key (lists and values replaced)."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        both = isinstance(below, Mapping) and isinstance(value, Mapping)
        out[key] = merged(below, value) if both else value  # type: ignore[arg-type]
    return out


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The settings model a field holds: itself, in a list, or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            found = _model_in(arg)
            if found is not None:
                return found
    return None


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
