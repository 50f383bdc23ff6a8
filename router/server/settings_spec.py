"""The settings tree read as a list of settings, each with its flags (or why it has none), env
variable, default and help: what ``router.server.cli`` builds the flags from and
``router.server.settings_reference`` documents. Both read only this."""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal, TypedDict, Union, cast, get_args, get_origin

from pydantic import BaseModel
from pydantic.config import JsonDict
from pydantic.fields import FieldInfo

from router.scheduling.policies import POLICIES
from router.settings import RouterSettings
from router.settings.registry_flags import EXTERNAL

__all__ = ["EXTERNAL", "Section", "Setting", "sections", "undeclared"]

# the tables ``cli(choices_of=...)`` names
_CHOICES_OF: dict[str, Callable[[], tuple[str, ...]]] = {"policies": lambda: tuple(POLICIES)}

_TOP_DOC = "The engines' PD protocol and where the workers come from."

# a section declared in another package gets its description and its fields' flags from
# ``EXTERNAL`` (``router.settings.registry_flags``: the registry's)


class _Declared(TypedDict, total=False):
    """What :func:`router.settings.cli` and :func:`~router.settings.env_only` record."""

    flags: list[str]
    metavar: str | list[str]
    choices: list[str]
    choices_of: str
    repeat: bool
    nargs: str
    switch: bool
    adapter: str
    default: str
    help: str
    env_only: str


@dataclass(frozen=True)
class Setting:
    """One leaf of the settings tree."""

    path: tuple[str, ...]
    help: str
    default: str  # as shown
    structured: bool  # a list or mapping: the env variable takes JSON
    flags: tuple[str, ...] = ()
    env_only: str | None = None  # why it has no flag
    value_type: type[int] | type[float] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | tuple[str, ...] | None = None
    repeat: bool = False
    nargs: str | None = None
    switch: bool | None = None  # a flag without a value, setting this
    adapter: str | None = None

    @property
    def env(self) -> str:
        return "PDR_" + "__".join(self.path).upper()


@dataclass(frozen=True)
class Section:
    """The top level (``name`` None) or one nested section of the tree."""

    name: str | None
    doc: str
    settings: tuple[Setting, ...]
    errors_flag: str | None = None  # the flag the section's own validation errors name


def sections(root: type[BaseModel] = RouterSettings) -> list[Section]:
    """The top level's settings, then each section's, in declaration order."""
    top: list[Setting] = []
    nested: list[Section] = []
    for name, info in root.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            doc, external = EXTERNAL.get(model, (model.__doc__ or "", {}))
            fields = model.model_fields.items()
            found = tuple(_setting((name, key), f, external.get(key)) for key, f in fields)
            flags = _declared(info, None).get("flags")
            nested.append(Section(name, _oneline(doc), found, flags[0] if flags else None))
        else:
            top.append(_setting((name,), info, None))
    return [Section(None, _TOP_DOC, tuple(top)), *nested]


def undeclared(found: list[Section]) -> list[str]:
    """Settings without a flag, a reason to have none, or help: ``PDR_...`` names."""
    return [
        s.env
        for section in found
        for s in section.settings
        if not (s.flags or s.env_only) or not s.help
    ]


def _declared(info: FieldInfo, external: JsonDict | None) -> _Declared:
    extra = external if external is not None else info.json_schema_extra
    if not isinstance(extra, dict) or not isinstance(extra.get("cli"), dict):
        return {}
    return cast(_Declared, extra["cli"])


def _setting(path: tuple[str, ...], info: FieldInfo, external: JsonDict | None) -> Setting:
    declared = _declared(info, external)
    value_type, choices, structured = _kind(info.annotation)
    if "choices" in declared:
        choices = tuple(declared["choices"])
    elif "choices_of" in declared:
        choices = _CHOICES_OF[declared["choices_of"]]()
    metavar = declared.get("metavar")
    shown = declared.get("default")
    return Setting(
        path=path,
        help=_oneline(declared.get("help") or info.description or ""),
        default=_show(info.get_default(call_default_factory=True)) if shown is None else shown,
        structured=structured,
        flags=tuple(declared.get("flags", ())),
        env_only=declared.get("env_only"),
        value_type=value_type,
        choices=choices,
        metavar=tuple(metavar) if isinstance(metavar, list) else metavar,
        repeat=declared.get("repeat", False),
        nargs=declared.get("nargs"),
        switch=declared.get("switch"),
        adapter=declared.get("adapter"),
    )


def _kind(annotation: Any) -> tuple[type[int] | type[float] | None, tuple[str, ...] | None, bool]:
    """The flag's value type, its choices (a Literal or an enum), whether the value is
    structured: from the field's annotation, an optional ``X | None`` read as ``X``."""
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        annotation = inner[0] if len(inner) == 1 else annotation
    choices = None
    if get_origin(annotation) is Literal:
        choices = tuple(str(arg) for arg in get_args(annotation))
    elif isinstance(annotation, type) and issubclass(annotation, Enum):
        choices = tuple(str(member.value) for member in annotation)
    structured = get_origin(annotation) in (list, tuple, dict)
    value_type = annotation if annotation is int or annotation is float else None
    return value_type, choices, structured


def _show(value: object) -> str:
    """A default as the help and the reference show it."""
    if value is None or value in ([], (), {}):
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, dict):
        return ",".join(f"{key}={_show(item)}" for key, item in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(_show(item) for item in value)
    return str(value)


def _oneline(text: str) -> str:
    """Docstring text as one Markdown line."""
    return " ".join(text.split()).replace("``", "`")
