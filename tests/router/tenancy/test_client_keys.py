"""The API keys file (``router.tenancy.client_keys``): tenants and their keys, held hashed,
checked strictly (never quoting a key), reloaded without dropping the last good table."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from router.tenancy.client_keys import ClientKeys, KeyFileError, load_key_table

KEY_A = "sk-team-a-0123456789abcdef"
KEY_B = "sk-team-b-0123456789abcdef"


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_plain_and_hashed_keys_name_their_tenant_and_only_digests_are_kept(
    tmp_path: Path,
) -> None:
    digest = hashlib.sha256(KEY_B.encode()).hexdigest()
    path = _write(
        tmp_path / "keys.yaml",
        f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n    requests_per_minute: 60\n"
        f"  team-b:\n    keys: ['sha256:{digest}']\n",
    )
    table = load_key_table(path)
    assert table.tenant_for(KEY_A) == "team-a" and table.tenant_for(KEY_B) == "team-b"
    assert table.tenant_for(KEY_A + "x") is None and table.tenant_for("") is None
    assert table.specs["team-a"].requests_per_minute == 60
    assert KEY_A not in repr(table) and all(not spec.keys for spec in table.specs.values())


def test_toml_reads_the_same(tmp_path: Path) -> None:
    path = _write(tmp_path / "keys.toml", f'[tenants.team-a]\nkeys = ["{KEY_A}"]\n')
    assert load_key_table(path).tenant_for(KEY_A) == "team-a"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants:\n  a:\n    keys: [short]\n", "at least 16 characters"),
        ("tenants:\n  a:\n    keys: []\n", "keys"),
        (f"tenants:\n  a:\n    keys: [{KEY_A}]\n    rpm: 5\n", "rpm"),
        (f"tenants:\n  a:\n    keys: [{KEY_A}]\n    max_concurrent: 0\n", "max_concurrent"),
        (f"tenants:\n  a:\n    keys: [{KEY_A}]\n  b:\n    keys: [{KEY_A}]\n", "listed for a and b"),
        (f"tenants:\n  'a b':\n    keys: [{KEY_A}]\n", "tenant 'a b'"),
        (f"tenant:\n  a:\n    keys: [{KEY_A}]\n", "tenant"),
    ],
)
def test_a_bad_keys_file_is_an_error_naming_the_problem_never_a_key(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(KeyFileError) as caught:
        load_key_table(_write(tmp_path / "keys.yaml", text))
    assert message in str(caught.value)
    assert KEY_A not in str(caught.value) and "[short]" not in str(caught.value)


def test_a_reload_takes_the_new_keys_and_a_broken_file_keeps_the_last_good_ones(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path / "keys.yaml", f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n")
    keys = ClientKeys(path, interval_s=60)
    assert keys.tenant_for(KEY_B) is None
    _write(path, f"tenants:\n  team-a:\n    keys: [{KEY_A}, {KEY_B}]\n")
    assert keys.reload() and keys.tenant_for(KEY_B) == "team-a"
    _write(path, "tenants: [not, a, mapping]\n")
    assert not keys.reload()
    assert keys.tenant_for(KEY_A) == keys.tenant_for(KEY_B) == "team-a"
    assert (keys.reloads, keys.reload_errors) == (1, 1)


def test_a_tenant_may_name_its_default_priority_and_its_fairness_weight(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "keys.yaml",
        f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n    priority: -2\n    weight: 2.5\n"
        f"  team-b:\n    keys: [{KEY_B}]\n",
    )
    specs = load_key_table(path).specs
    assert (specs["team-a"].priority, specs["team-a"].weight) == (-2, 2.5)
    assert (specs["team-b"].priority, specs["team-b"].weight) == (None, 1.0)
    for bad in ("weight: 0", "weight: -1", "priority: high"):
        _write(path, f"tenants:\n  team-a:\n    keys: [{KEY_A}]\n    {bad}\n")
        with pytest.raises(KeyFileError, match="team-a"):
            load_key_table(path)
