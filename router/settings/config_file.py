"""``router --config FILE``: every setting from a YAML or TOML file, below the environment and
the flags (defaults < file < ``PDR_*`` < flags).

The file is the settings tree as ``router config show`` prints it: sections as mappings, the
workers as lists of mappings (``prefill: [{url: ..., bootstrap_port: 8998}]``). A key the tree
does not have is an error naming its path (and the nearest name there is): a typo never passes
silently. Read by ``registry.config_file``: at most ``MAX_CONFIG_BYTES``, YAML with the safe
loader (no tags, no objects), one document.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from registry.config_file import (
    MAX_CONFIG_BYTES,
    ConfigFileError,
    read_config_file,
    unknown_setting,
)

__all__ = ["MAX_CONFIG_BYTES", "ConfigFileError", "load_config_file", "merged", "unknown_keys"]


def load_config_file(path: Path, model: type[BaseModel]) -> dict[str, Any]:
    """The file's settings tree (``registry.config_file`` reads it), its keys checked against
    ``model``'s."""
    data = read_config_file(path)
    for at, key, known in unknown_keys(model, data):
        raise unknown_setting(path, key, known, at)
    return data


def unknown_keys(
    model: type[BaseModel], data: Mapping[Any, Any], at: str = ""
) -> Iterator[tuple[str, str, list[str]]]:
    """``(path of its mapping, key, the keys known there)`` of every key of ``data`` that
    ``model`` (and the models of its fields, within lists too) does not have."""
    fields = model.model_fields
    for key, value in data.items():
        field = fields.get(key) if isinstance(key, str) else None
        path = f"{at}{key}"
        if field is None:
            yield at, str(key), list(fields)
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
