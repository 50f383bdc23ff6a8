"""Command line: flags compatible with vLLM's PD proxy and sglang-router, generated from the
settings tree (``router.server.settings_spec``); the flags given override the env."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml
from pydantic import ValidationError
from pydantic_settings import EnvSettingsSource

from registry.models import redact_url
from router.scheduling.policies import POLICIES
from router.server.settings_spec import Section, Setting, sections
from router.settings import RouterSettings
from router.settings.config_file import ConfigFileError, load_config_file, merged

__all__ = ["build_parser", "parse_args", "show_settings"]

_EPILOG = (
    "Every setting can also come from the environment: PDR_ and its path, sections joined by "
    "__ (PDR_SERVER__PORT=8001); lists and mappings as JSON; and from a file (--config). Flags "
    "override the environment, which overrides the file. `router config show [FLAGS]` prints "
    "the effective settings. The whole reference: docs/configuration.md."
)
_CONFIG_DEST = "config_file"
# the settings that hold URLs or HOST:PORT addresses, per section (each worker's: _WORKER_URLS)
_URLS = {
    "registry": ("url",),
    "auth": ("rate_limit_storage",),
    "tracing": ("otlp_endpoint",),
    "cache": ("render_url", "model_render_urls"),
    "replicas": ("listen", "peers", "peers_dns"),
}
_WORKER_URLS = ("url", "kv_events", "kv_events_replay")
_BARE_USERINFO = re.compile(r"^[^/?#]*@")  # HOST:PORT with a user:password@ (no scheme)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line naming the flag, as argparse phrases it, then exit 2."""
        self.exit(2, f"{self.prog}: error: {message}\n")


def _prefill_spec(parser: _Parser, values: list[str]) -> dict[str, Any]:
    """``URL [BOOTSTRAP_PORT|none|ns:NAME] [events=tcp://H:P] [replay=tcp://H:P]
    [model=NAME[,NAME]]``."""
    named = {"events": "kv_events", "replay": "kv_events_replay", "model": "models"}
    spec: dict[str, Any] = {"url": values[0]}
    positional = []
    for value in values[1:]:
        key, sep, rest = value.partition("=")
        if sep and key in named:
            spec[named[key]] = rest.split(",") if key == "model" else rest
        else:
            positional.append(value)
    if len(positional) > 1:
        parser.error(
            "argument --prefill: expected URL [BOOTSTRAP_PORT] [events=ENDPOINT] "
            f"[replay=ENDPOINT] [model=NAME], got {' '.join(values)}"
        )
    port = positional[0] if positional else "none"
    if port.startswith("ns:"):
        spec["bootstrap_namespace"] = port[3:]
    elif port.lower() != "none":
        if not port.isdigit():
            parser.error(
                f"argument --prefill: invalid bootstrap port {port!r} (an integer or 'none')"
            )
        spec["bootstrap_port"] = int(port)
    return spec


def _decode_spec(parser: _Parser, values: list[str]) -> dict[str, Any]:
    """``URL [model=NAME[,NAME]]``."""
    spec: dict[str, Any] = {"url": values[0]}
    for value in values[1:]:
        key, sep, rest = value.partition("=")
        if not (sep and key == "model"):
            parser.error(f"argument --decode: expected URL [model=NAME], got {' '.join(values)}")
        spec["models"] = rest.split(",")
    return spec


def _name_names(parser: _Parser, items: list[str]) -> dict[str, str]:
    """``NAME=VALUE`` pairs (``--model-alias ALIAS=NAME``, ``--model-tokenizer MODEL=DIR``)."""
    names: dict[str, str] = {}
    for item in items:
        name, _, value = item.partition("=")
        if not name or not value:
            parser.error(f"expected NAME=VALUE pairs (ALIAS=NAME, MODEL=DIR), got {item!r}")
        names[name] = value
    return names


def _model_policies(parser: _Parser, items: list[str]) -> dict[str, str]:
    """``MODEL=POLICY`` pairs, each a known policy."""
    policies: dict[str, str] = {}
    for item in items:
        model, _, policy = item.partition("=")
        if not model or policy not in POLICIES:
            parser.error(
                f"argument --model-policy: expected MODEL=POLICY (a policy of "
                f"{', '.join(POLICIES)}), got {item!r}"
            )
        policies[model] = policy
    return policies


def _namespace_ports(parser: _Parser, items: list[str]) -> dict[str, int]:
    ports: dict[str, int] = {}
    for item in items:
        name, _, port = item.partition("=")
        if not name or not port.isdigit():
            parser.error(f"argument --bootstrap-namespace: expected NAME=PORT, got {item!r}")
        ports[name] = int(port)
    return ports


# ``cli(adapter=...)``: what argparse collected -> the setting's value
_ADAPTERS: dict[str, Callable[[_Parser, Any], Any]] = {
    "prefill": lambda parser, groups: [_prefill_spec(parser, values) for values in groups],
    "decode": lambda parser, groups: [_decode_spec(parser, values) for values in groups],
    "urls": lambda _parser, urls: [{"url": url} for url in urls],
    "name_ports": _namespace_ports,
    "name_names": _name_names,
    "model_policies": _model_policies,
}


def _dest(setting: Setting) -> str:
    return setting.flags[0].lstrip("-").replace("-", "_")


def _help(setting: Setting) -> str:
    text = setting.help + ("; repeat" if setting.repeat else "")
    if setting.switch is not None:
        where = f"env {setting.env}={str(setting.switch).lower()}"
    else:
        json = ", JSON" if setting.structured else ""
        where = f"default: {setting.default}; env {setting.env}{json}"
    return f"{text} ({where})".replace("%", "%%")


def _options(setting: Setting) -> dict[str, Any]:
    """``add_argument`` keywords: a flag the user did not give leaves no attribute (the env or
    the default decides)."""
    options: dict[str, Any] = {
        "dest": _dest(setting),
        "default": argparse.SUPPRESS,
        "help": _help(setting),
    }
    if setting.switch is not None:
        return {**options, "action": "store_true"}
    given = {
        "action": "append" if setting.repeat else None,
        "nargs": setting.nargs,
        "type": setting.value_type,
        "choices": setting.choices,
        "metavar": setting.metavar,
    }
    return {**options, **{key: value for key, value in given.items() if value is not None}}


def _build(found: list[Section]) -> _Parser:
    parser = _Parser(
        prog="router", description="OpenAI-compatible prefill/decode router", epilog=_EPILOG
    )
    parser.add_argument(
        "--config",
        dest=_CONFIG_DEST,
        metavar="FILE",
        default=argparse.SUPPRESS,
        help="every setting from a YAML or TOML file (the tree `router config show` prints); "
        "the environment and the flags override it; an unknown key is an error",
    )
    for section in found:
        group = parser.add_argument_group(section.name or "top level", section.doc)
        for setting in section.settings:
            if setting.flags:
                group.add_argument(*setting.flags, **_options(setting))
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The ``router`` command line, one flag per setting that has one."""
    return _build(sections())


def _overrides(parser: _Parser, args: argparse.Namespace, found: list[Section]) -> dict[str, Any]:
    """Only the flags the user gave, nested like the settings tree."""
    by_dest = {_dest(s): s for section in found for s in section.settings if s.flags}
    out: dict[str, Any] = {}
    for dest, value in vars(args).items():
        setting = by_dest[dest]
        if setting.switch is not None:
            value = setting.switch
        elif setting.adapter is not None:
            value = _ADAPTERS[setting.adapter](parser, value)
        *parents, name = setting.path
        node = out
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return out


def _flag_for(loc: Sequence[Any], found: list[Section]) -> str:
    """The flag that sets the setting at ``loc`` (a switch's is not its value): else its env."""
    flags = {
        s.path: s.flags[0]
        for section in found
        for s in section.settings
        if s.flags and s.switch is None
    }
    flags.update({(s.name,): s.errors_flag for s in found if s.name and s.errors_flag})
    for size in (2, 1):
        flag = flags.get(tuple(str(part) for part in loc[:size]))
        if flag:
            return flag
    return "PDR_" + "__".join(str(part) for part in loc).upper()


def parse_args(argv: Sequence[str] | None = None) -> RouterSettings:
    """Settings from a file (``--config``), overridden by the env (``PDR_*``), overridden by
    ``argv``; exits 2 with one line on error."""
    found = sections()
    parser = _build(found)
    args = parser.parse_args(argv)
    config = vars(args).pop(_CONFIG_DEST, None)
    flags = _overrides(parser, args, found)
    from_file: dict[str, Any] = {}
    try:
        if config is not None:
            from_file = load_config_file(Path(config), RouterSettings)
        env = EnvSettingsSource(RouterSettings)() if from_file else {}
        return RouterSettings(**merged(merged(from_file, env), flags))
    except ConfigFileError as exc:
        parser.error(f"argument --config: {exc}")
    except ValidationError as exc:
        first = exc.errors()[0]
        message = first["msg"].removeprefix("Value error, ")
        loc = first["loc"]
        if _given_at(from_file, loc) and not _given_at(merged(env, flags), loc):
            where = ".".join(str(part) for part in loc)
            parser.error(f"argument --config: {config}: setting {where}: {message}")
        parser.error(f"argument {_flag_for(loc, found)}: {message}")


def _given_at(tree: Any, loc: Sequence[Any]) -> bool:
    """Whether a settings tree (nested mappings and lists) has a value at ``loc``."""
    for part in loc:
        if isinstance(tree, list) and isinstance(part, int) and part < len(tree):
            tree = tree[part]
            continue
        if not isinstance(tree, dict) or part not in tree:
            return False
        tree = tree[part]
    return True


def show_settings(settings: RouterSettings) -> str:
    """The effective settings as YAML, in the shape ``--config`` reads; secrets shown as
    ``**********`` (and any ``user:password@`` of a URL or address as ``***@``)."""
    tree = settings.model_dump(mode="json")
    for worker in tree["prefill"] + tree["decode"]:
        for key in _WORKER_URLS:
            worker[key] = _redacted(worker[key])
    for section, keys in _URLS.items():
        for key in keys:
            tree[section][key] = _redacted(tree[section][key])
    return str(yaml.safe_dump(tree, sort_keys=False, allow_unicode=True))


def _redacted(value: Any) -> Any:
    """A URL or ``HOST:PORT`` (or a list or mapping of them; None stays) with any ``user:password@``
    shown as ``***@``."""
    if isinstance(value, list):
        return [_redacted(item) for item in value]
    if isinstance(value, dict):
        return {key: _redacted(item) for key, item in value.items()}
    if not isinstance(value, str):
        return value
    return redact_url(value) if "://" in value else _BARE_USERINFO.sub("***@", value)


if __name__ == "__main__":  # pragma: no cover
    print(parse_args(sys.argv[1:]))
