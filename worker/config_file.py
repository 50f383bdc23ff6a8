"""``pd-worker --config FILE``: its flags from a YAML or TOML file (parser defaults < file <
flags; pd-worker reads no environment variable for its settings).

The file is flat, one key per flag: the flag's name without its dashes, as its attribute
(``role: prefill``, ``page_size: 16``, ``hicache_host_pages: 256``; dashes may stand for the
underscores, ``page-size: 16``); the shape ``pd-worker config show`` prints. A value is what the
flag takes, checked by the flag's own type and choices: a number (or a string of one) for a
number flag, ``true``/``false`` for a switch (``fault_api``, ``hicache_layerwise``), a list for a
flag that takes several values; ``null`` leaves the default. A flag required on the command
line (``--role``) may come from the file instead. An unknown key (named with the nearest known
one), a value of the wrong type or a choice not offered is an error naming the key: exit 2, one
line on stderr. The file itself is read by ``registry.config_file`` (YAML or TOML, at most
1 MiB, the safe YAML loader).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from registry.config_file import ConfigFileError, read_config_file, unknown_setting
from registry.models import redact_url

__all__ = ["add_config_flag", "file_values", "parse_with_config", "show_config"]

_DEST = "config"
# flags whose value may carry a password (``user:password@`` in a URL): ``config show`` hides it
_URLS = ("registry", "hicache_mooncake_master", "hicache_mooncake_metadata")


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        dest=_DEST,
        metavar="FILE",
        help="every flag from a YAML or TOML file, keyed by its name with underscores "
        "(role: prefill, page_size: 16; the file `pd-worker config show` prints); the flags "
        "given override it; an unknown key is an error",
    )


def parse_with_config(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> argparse.Namespace:
    """``argv`` parsed over the defaults of its ``--config`` file, if it names one."""
    required = [action for action in parser._actions if action.required]
    for action in required:  # the file may give them: first only look for --config
        action.required = False
    path = getattr(parser.parse_args(argv), _DEST)
    values: dict[str, Any] = {}
    if path is not None:
        try:
            values = file_values(parser, Path(path))
        except ConfigFileError as exc:
            parser.exit(2, f"{parser.prog}: error: argument --config: {exc}\n")
        parser.set_defaults(**values)
    for action in required:
        action.required = action.dest not in values
    return parser.parse_args(argv)


def file_values(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """The file's values by flag attribute, each checked and converted as its flag would be
    (``null`` values left out: the default stands)."""
    actions = {action.dest: action for action in parser._actions if _settable(action)}
    values: dict[str, Any] = {}
    written: dict[str, str] = {}
    for key, value in read_config_file(path).items():
        dest = key.replace("-", "_") if isinstance(key, str) else str(key)
        action = actions.get(dest)
        if action is None:
            raise unknown_setting(path, dest, actions)
        if dest in written:
            twice = f"{written[dest]!r} and {key!r}"
            raise ConfigFileError(f"{path}: setting {dest} given twice, as {twice}")
        written[dest] = key
        if value is not None:
            values[dest] = _checked(path, dest, action, value)
    return values


def show_config(args: argparse.Namespace) -> str:
    """The effective configuration as YAML, in the shape ``--config`` reads; a password in a URL
    shown as ``***``."""
    tree = {key: value for key, value in vars(args).items() if key != _DEST}
    for key in _URLS:
        if isinstance(tree.get(key), str):
            tree[key] = redact_url(tree[key])
    return str(yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))


def _settable(action: argparse.Action) -> bool:
    """A flag the file may set: one that stores a value or a switch (not --help, not --config,
    not a counter or a constant)."""
    if not action.option_strings or action.dest in (_DEST, argparse.SUPPRESS):
        return False
    return action.nargs != 0 or _switch(action)


def _switch(action: argparse.Action) -> bool:
    """A true/false flag: ``store_true``, ``store_false``, ``BooleanOptionalAction``."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return True
    return action.nargs == 0 and isinstance(action.const, bool)


def _checked(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    if _switch(action):
        if not isinstance(value, bool):
            raise _bad(path, key, f"expected true or false, got {value!r}")
        return value
    if isinstance(action, argparse._AppendAction) or action.nargs not in (None, "?"):
        if not isinstance(value, list):
            raise _bad(path, key, f"expected a list, got {value!r}")
        return [_scalar(path, key, action, item) for item in value]
    return _scalar(path, key, action, value)


def _scalar(path: Path, key: str, action: argparse.Action, value: Any) -> Any:
    """``value`` through the flag's type (as its text, as on a command line) and choices."""
    convert = action.type if callable(action.type) else str
    name = getattr(convert, "__name__", repr(convert))
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise _bad(path, key, f"expected {'a string' if convert is str else name}, got {value!r}")
    try:
        out = convert(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        raise _bad(path, key, f"invalid {name} value: {value!r}") from None
    if action.choices is not None and out not in action.choices:
        offered = ", ".join(repr(choice) for choice in action.choices)
        raise _bad(path, key, f"invalid choice: {out!r} (choose from {offered})")
    return out


def _bad(path: Path, key: str, message: str) -> ConfigFileError:
    return ConfigFileError(f"{path}: setting {key}: {message}")
