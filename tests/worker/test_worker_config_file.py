"""``pd-worker --config FILE`` (YAML or TOML, flat, keyed by flag name) below the flags; an
unknown key, a wrong type or a choice not offered is one line naming the key; ``pd-worker config
show`` prints what ``--config`` reads back, passwords hidden; a real process runs from a file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from registry.config_file import MAX_CONFIG_BYTES
from testkit.servers import free_port, http_process
from worker.__main__ import main, parse_args
from worker.config_file import add_config_flag, parse_with_config

YAML = """\
role: prefill
registry: 127.0.0.1:9000
port: 8100
page-size: 32
hicache_write_policy: write_back
hicache_layerwise: false
fault_api: true
transfer_timeout: 12
hicache_host_bandwidth: 1e9
hash_seed: 42
namespace: null
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``pd-worker`` exits 2 with, on stderr."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    return captured.err


def test_the_file_sets_what_the_flags_leave(tmp_path: Path) -> None:
    config = write(tmp_path, "worker.yaml", YAML)
    args = parse_args(["--config", config])  # --role from the file alone
    assert (args.role, args.registry, args.port, args.page_size) == (
        "prefill",
        "127.0.0.1:9000",
        8100,
        32,
    )
    assert (args.hicache_write_policy, args.hicache_layerwise, args.fault_api) == (
        "write_back",
        False,
        True,
    )
    assert (args.transfer_timeout, args.hicache_host_bandwidth) == (12.0, 1e9)
    assert isinstance(args.transfer_timeout, float) and args.hash_seed == "42"
    assert args.namespace is None and args.layers == 8  # null and absent: the defaults
    flags = ["--role", "decode", "--port", "8200", "--hicache-layerwise", "--config", config]
    over = parse_args(flags)  # the flags over the file, wherever --config stands
    assert (over.role, over.port, over.hicache_layerwise, over.page_size) == (
        "decode",
        8200,
        True,
        32,
    )


def test_toml_reads_the_same(tmp_path: Path) -> None:
    toml = 'role = "both"\nport = 8100\nkv-drain-timeout = 5\nhicache_layerwise = false\n'
    args = parse_args(["--config", write(tmp_path, "worker.toml", toml)])
    assert (args.role, args.port, args.kv_drain_timeout, args.hicache_layerwise) == (
        "both",
        8100,
        5.0,
        False,
    )


def test_without_a_role_anywhere_the_flag_is_still_required(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "w.yaml", "port: 8100\nrole: null\n")
    assert parse_args(["--config", config, "--role", "both"]).port == 8100
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", config])
    assert exit_info.value.code == 2
    assert "the following arguments are required: --role" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("page_sise: 3\n", "unknown setting 'page_sise' (did you mean 'page_size'?)"),
        ("hicache-host-page: 3\n", "unknown setting 'hicache_host_page' (did you mean"),
        ("help: true\n", "unknown setting 'help'"),
        ("port: abc\n", "setting port: invalid int value: 'abc'"),
        ("port: 3.5\n", "setting port: invalid int value: 3.5"),
        ("port: [1]\n", "setting port: expected int, got [1]"),
        ("model: {a: 1}\n", "setting model: expected a string, got {'a': 1}"),
        ("fault_api: 1\n", "setting fault_api: expected true or false, got 1"),
        (
            "protocol: vllm\n",
            "setting protocol: invalid choice: 'vllm' (choose from 'sglang', 'vllm-mooncake')",
        ),
        ("page-size: 1\npage_size: 2\n", "setting page_size given twice"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_key(
    tmp_path: Path, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "worker.yaml", "role: both\n" + text)
    err = fails(["--config", config], capsys)
    assert err.startswith(f"pd-worker: error: argument --config: {config}: {said}"), err


def test_files_that_cannot_be_read_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    large = write(tmp_path, "large.yaml", "role: both\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10))
    assert f"larger than {MAX_CONFIG_BYTES} bytes" in fails(["--config", large], capsys)
    ini = write(tmp_path, "w.ini", "role: both\n")
    assert "a .yaml, .yml or .toml file" in fails(["--config", ini], capsys)
    listed = write(tmp_path, "list.yaml", "- role\n- both\n")
    assert "the top level is not a mapping of settings" in fails(["--config", listed], capsys)
    assert "No such file" in fails(["--config", str(tmp_path / "missing.yaml")], capsys)


def test_list_valued_flags_take_lists(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Generic: pd-worker has none today, but a flag of several values takes a list."""
    parser = argparse.ArgumentParser(prog="p")
    add_config_flag(parser)
    parser.add_argument("--sizes", type=int, nargs="+")
    parser.add_argument("--tag", action="append", choices=["a", "b"])
    config = write(tmp_path, "p.yaml", "sizes: [1, '2']\ntag: [a, b]\n")
    args = parse_with_config(parser, ["--config", config])
    assert (args.sizes, args.tag) == ([1, 2], ["a", "b"])
    assert parse_with_config(parser, ["--config", config, "--sizes", "7"]).sizes == [7]
    with pytest.raises(SystemExit):
        parse_with_config(parser, ["--config", write(tmp_path, "q.yaml", "tag: a\n")])
    assert "setting tag: expected a list, got 'a'" in capsys.readouterr().err


def test_config_show_prints_what_the_file_reads_back(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--config", write(tmp_path, "worker.yaml", YAML), "--port", "8300", "--dp", "2"]
    main(["config", "show", *argv])
    shown = capsys.readouterr().out
    assert "port: 8300\n" in shown and "page_size: 32\n" in shown
    assert "config" not in yaml.safe_load(shown)
    again = parse_args(["--config", write(tmp_path, "shown.yaml", shown)])
    effective = vars(parse_args(argv))
    del effective["config"]
    assert {k: v for k, v in vars(again).items() if k != "config"} == effective


def test_config_show_hides_a_password_in_a_url(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    main(["config", "show", "--role", "prefill", "--registry", "http://user:s3cret@r:9000"])
    shown = capsys.readouterr().out
    assert "s3cret" not in shown and "registry: http://***@r:9000\n" in shown


def test_a_worker_runs_from_a_file(tmp_path: Path) -> None:
    port = free_port()
    text = f"role: decode\nhost: 127.0.0.1\nport: {port}\nengine: loopback\npages: 64\n"
    argv = [sys.executable, "-m", "worker", "--config", write(tmp_path, "w.yaml", text)]
    url = f"http://127.0.0.1:{port}"
    with http_process(argv, url, path="/health", timeout=30):
        health = httpx.get(url + "/health", timeout=5).json()
        assert (health["role"], health["free_pages"]) == ("decode", 64)


def test_the_docs_example_is_a_valid_file(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "simulated-engine.md").read_text()
    section = page.split("### Config file", 1)[1]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    args = parse_args(["--config", write(tmp_path, "doc.yaml", example)])
    assert (args.role, args.protocol, args.dp, args.hicache_layerwise) == (
        "prefill",
        "vllm-mooncake",
        2,
        False,
    )
