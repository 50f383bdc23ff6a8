"""How a setting says how it is set: :func:`cli` (its flag) or :func:`env_only` (why none).

Also what every section shares: ``DOCUMENTED`` (a field's attribute docstring is its help),
``PositiveFloat``, and ``TUNING``, the reason of the settings left to the environment.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, JsonValue
from pydantic.config import JsonDict

__all__ = ["DOCUMENTED", "TUNING", "PositiveFloat", "cli", "env_only"]

PositiveFloat = Annotated[float, Field(gt=0)]
DOCUMENTED = ConfigDict(use_attribute_docstrings=True)


def cli(
    *flags: str,
    metavar: str | tuple[str, ...] | None = None,
    choices: tuple[str, ...] | None = None,
    choices_of: Literal["policies"] | None = None,
    repeat: bool = False,
    nargs: Literal["+"] | None = None,
    switch: bool | None = None,
    adapter: Literal["prefill", "decode", "urls", "name_ports", "name_names", "model_policies"]
    | None = None,
    default: str | None = None,
    help: str | None = None,
) -> JsonDict:
    """A setting's flag (``json_schema_extra``): ``flags`` are its option strings; a Literal or
    enum field's choices and an int/float field's type come from its annotation; ``choices_of``
    names a table of ``router.server`` (the policies); ``repeat``: given again, it adds to a
    list; ``switch``: the flag takes no value and sets this one; ``adapter``: a conversion of
    ``router.server.cli``; ``default``: the default as shown where it is computed; ``help``:
    for fields declared in another package. On a section field, ``flags[0]`` is the flag that
    the section's own validation errors name."""
    given: dict[str, JsonValue] = {
        "flags": list(flags),
        "metavar": list(metavar) if isinstance(metavar, tuple) else metavar,
        "choices": list(choices) if choices else None,
        "choices_of": choices_of,
        "repeat": repeat or None,
        "nargs": nargs,
        "switch": switch,
        "adapter": adapter,
        "default": default,
        "help": help,
    }
    return {"cli": {key: value for key, value in given.items() if value is not None}}


def env_only(reason: str, *, default: str | None = None, help: str | None = None) -> JsonDict:
    """A setting without a flag, and why; ``default`` and ``help`` as for :func:`cli`."""
    given: dict[str, JsonValue] = {"env_only": reason, "default": default, "help": help}
    return {"cli": {key: value for key, value in given.items() if value is not None}}


# why some settings have no flag: to keep the command line to what operators set
TUNING = env_only("rarely tuned")
