"""Client API keys: who is calling, as a tenant name, from a keys file held hashed.

The file (YAML or TOML, read by ``registry.config_file``: at most 1 MiB, the safe YAML
loader) names the tenants and their keys::

    tenants:
      team-a:
        keys: ["sk-team-a-0123456789abcdef", "sha256:9f86d081884c7d65..."]
        priority: 0   # optional: its requests' default priority (lower is more urgent)
        min_priority: 0  # optional: the most urgent priority its requests may ask for
        weight: 2     # optional: its share of a saturated fleet against the others' (1)

A key is given in plain text (at least ``MIN_KEY_CHARS`` characters) or as ``sha256:`` and the
hex SHA-256 of the key, so the file need not hold a usable key at all. Only the digests are
kept; a presented key is hashed and looked up by its digest. Nothing compares a presented key
with a stored one character by character: the lookup compares SHA-256 digests, so its timing
could tell at most how many leading bytes of a digest matched, which (the hash being one-way)
says nothing about the characters of any key: the constant-time property a key comparison
needs. Keys are never logged, not even hashed. Tenant names are the
metric labels: ``TENANT_NAME`` characters, at most ``MAX_TENANTS`` of them.

``ClientKeys`` holds the current table and rereads the file on ``reload`` (SIGHUP) and when
its modification time or size changes (``watch``); a request being served keeps the table it
was authenticated with, a file that fails to load leaves the last good table in place.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from registry.config_file import ConfigFileError, read_config_file

__all__ = [
    "MAX_TENANTS",
    "MIN_KEY_CHARS",
    "ClientKeys",
    "KeyFileError",
    "KeyTable",
    "TenantSpec",
    "load_key_table",
]

logger = logging.getLogger(__name__)

MIN_KEY_CHARS = 16
MAX_TENANTS = 1000
MAX_KEYS = 10_000  # in the whole file
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


class KeyFileError(ValueError):
    """The keys file cannot be read or is not a valid tenants table."""


class TenantSpec(BaseModel):
    """One tenant: its keys, and (``router.tenancy`` limits) what it may use."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: tuple[str, ...] = Field(min_length=1)
    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_concurrent: int | None = Field(default=None, gt=0)
    # admission (router.pipeline.admission_queue): the priority of its requests that name none
    # (lower is more urgent; None: --default-priority) and its share of a saturated fleet
    priority: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    # the most urgent priority its requests may ask for (X-Priority, the body's ``priority``):
    # a lower one is raised to it, in the queue and in the body the engines get (None: any)
    min_priority: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    weight: float = Field(default=1.0, gt=0, le=1_000_000)

    @field_validator("keys")
    @classmethod
    def _check_keys(cls, keys: tuple[str, ...]) -> tuple[str, ...]:
        for key in keys:  # the message never quotes a key
            if not _DIGEST.fullmatch(key) and len(key) < MIN_KEY_CHARS:
                raise ValueError(
                    f"a key is at least {MIN_KEY_CHARS} characters, or sha256:<64 hex digits>"
                )
            if not key.isascii() or not key.isprintable() or " " in key:
                raise ValueError("a key is printable ASCII without spaces")
        return keys


class _TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenants: dict[str, TenantSpec] = Field(max_length=MAX_TENANTS)


def _digest(key: str) -> bytes:
    found = _DIGEST.fullmatch(key)
    if found is not None:
        return bytes.fromhex(found.group(1))
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class KeyTable:
    """The tenants (``specs``, keys left out) and the digest of every key -> its tenant."""

    tenant_of: dict[bytes, str]
    specs: dict[str, TenantSpec]

    def tenant_for(self, key: str) -> str | None:
        """The tenant whose key ``key`` is; None for an unknown key."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()
        return self.tenant_of.get(digest)


def load_key_table(path: Path) -> KeyTable:
    """The file's table; raises KeyFileError naming the problem (never a key)."""
    try:
        data: Any = read_config_file(path)
        parsed = _TenantsFile.model_validate(data)
    except ConfigFileError as exc:
        raise KeyFileError(str(exc)) from None
    except ValidationError as exc:
        problem = exc.errors(include_input=False)[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise KeyFileError(f"{path}: {where}: {problem['msg']}") from None
    tenant_of: dict[bytes, str] = {}
    for name, spec in parsed.tenants.items():
        if not TENANT_NAME.fullmatch(name):
            raise KeyFileError(f"{path}: tenant {name!r}: 1-64 of A-Z a-z 0-9 . _ -")
        for key in spec.keys:
            digest = _digest(key)
            if tenant_of.setdefault(digest, name) != name:
                raise KeyFileError(f"{path}: one key is listed for {tenant_of[digest]} and {name}")
    if len(tenant_of) > MAX_KEYS:
        raise KeyFileError(f"{path}: more than {MAX_KEYS} keys")
    specs = {name: spec.model_copy(update={"keys": ()}) for name, spec in parsed.tenants.items()}
    return KeyTable(tenant_of, specs)


class ClientKeys:
    """The current key table of ``path``, reloaded on demand and when the file changes."""

    def __init__(self, path: Path, interval_s: float) -> None:
        """Raises KeyFileError when the file cannot be loaded (the router does not start)."""
        self.path = path
        self._interval_s = interval_s
        self._stamp = self._file_stamp()
        self.table = load_key_table(path)
        self.reloads = 0
        self.reload_errors = 0
        # told of every new table (the limits follow the file)
        self.on_reload: Callable[[KeyTable], None] | None = None

    def tenant_for(self, key: str) -> str | None:
        return self.table.tenant_for(key)

    def reload(self) -> bool:
        """Reread the file; on failure keep the current table (and say why). True: reloaded."""
        self._stamp = self._file_stamp()
        try:
            table = load_key_table(self.path)
        except KeyFileError as exc:
            self.reload_errors += 1
            logger.error("API keys not reloaded, the last good ones stay: %s", exc)
            return False
        self.table = table
        self.reloads += 1
        if self.on_reload is not None:
            self.on_reload(table)
        logger.info("API keys reloaded from %s: %d tenants", self.path, len(table.specs))
        return True

    async def watch(self) -> None:
        """Reload whenever the file's modification time or size changes, until cancelled."""
        while True:
            await asyncio.sleep(self._interval_s)
            if self._file_stamp() != self._stamp:
                self.reload()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size
