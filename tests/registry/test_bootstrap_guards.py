"""The bootstrap listeners' building blocks (registry/engine_api): source allow-list matching,
rank address parsing and host comparison. The listeners themselves are tested end to end in
tests/router/server/test_bootstrap_security.py."""

from __future__ import annotations

import pytest

from registry.engine_api.rank_checks import RegistrationRefused, parse_tcp_address, same_host
from registry.engine_api.source_allow import Network, source_allowed
from registry.settings import DEFAULT_BOOTSTRAP_ALLOW, RegistrySettings

PRIVATE = RegistrySettings.model_validate({"bootstrap_allow": ["10.0.0.0/8"]}).bootstrap_allow


@pytest.mark.parametrize(
    ("host", "networks", "allowed"),
    [
        ("127.0.0.1", DEFAULT_BOOTSTRAP_ALLOW, True),
        ("127.9.9.9", DEFAULT_BOOTSTRAP_ALLOW, True),
        ("::1", DEFAULT_BOOTSTRAP_ALLOW, True),
        ("::ffff:127.0.0.1", DEFAULT_BOOTSTRAP_ALLOW, True),  # dual-stack socket
        ("10.1.2.3", DEFAULT_BOOTSTRAP_ALLOW, False),
        ("10.1.2.3", PRIVATE, True),
        ("127.0.0.1", PRIVATE, False),
        ("fe80::1%eth0", DEFAULT_BOOTSTRAP_ALLOW, False),
        ("not-an-address", DEFAULT_BOOTSTRAP_ALLOW, False),
        (None, DEFAULT_BOOTSTRAP_ALLOW, False),  # a unix socket: no peer address
    ],
)
def test_source_allow_list(host: str | None, networks: tuple[Network, ...], allowed: bool) -> None:
    assert source_allowed(host, networks) is allowed


@pytest.mark.parametrize(
    ("addr", "parsed"),
    [
        ("tcp://10.0.0.1:5000", ("10.0.0.1", 5000)),
        ("tcp://[::1]:5000", ("::1", 5000)),
        ("tcp://node-3.cluster:7", ("node-3.cluster", 7)),
    ],
)
def test_vllm_rank_addresses(addr: str, parsed: tuple[str, int]) -> None:
    assert parse_tcp_address(addr) == parsed


@pytest.mark.parametrize(
    "addr", ["10.0.0.1:5000", "http://10.0.0.1:5000", "tcp://10.0.0.1", "tcp://[::1:5", "tcp://h:x"]
)
def test_invalid_vllm_rank_addresses_are_400(addr: str) -> None:
    with pytest.raises(RegistrationRefused) as refused:
        parse_tcp_address(addr)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    ("a", "b", "same"),
    [
        ("127.0.0.1", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.5", True),  # loopback aliases
        ("localhost", "127.0.0.1", True),
        ("[::1]", "127.0.0.1", True),  # both this machine
        ("127.0.0.1", "192.0.2.1", False),  # TEST-NET-1: not this machine
        ("192.0.2.1", "192.0.2.2", False),
        ("192.0.2.1", "192.0.2.1", True),
    ],
)
async def test_same_host(a: str, b: str, same: bool) -> None:
    assert await same_host(a, b) is same
