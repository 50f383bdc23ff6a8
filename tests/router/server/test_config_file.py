"""``router --config FILE`` (YAML or TOML) below the environment and the flags; an unknown key or
a bad value is one line naming the file and the setting; ``router config show`` prints what
``--config`` reads back, secrets redacted."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from router.__main__ import main
from router.server.cli import parse_args
from router.settings import EngineProtocol
from router.settings.config_file import MAX_CONFIG_BYTES
from testkit.fake_engine import FakeConfig, FakeEngine
from testkit.polling import wait_until
from testkit.servers import free_port, http_process, run_servers
from tests.router.server.test_workers import joined

YAML = """\
engine: sglang
prefill:
  - url: http://127.0.0.1:8100
    bootstrap_port: 8998
decode:
  - url: http://127.0.0.1:8200
  - url: http://127.0.0.1:8201
server:
  port: 8123
  max_n: 7
policy:
  policy: cache_aware
registry:
  admin_token: file-admin-token-0123
"""


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``router`` exits 2 with."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


def test_the_file_sets_what_the_environment_and_the_flags_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = write(tmp_path, "router.yaml", YAML)
    monkeypatch.setenv("PDR_SERVER__MAX_N", "9")  # the environment over the file
    settings = parse_args(["--config", config, "--port", "9000"])  # the flags over both
    assert settings.engine is EngineProtocol.SGLANG
    assert [w.url for w in settings.decode] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert settings.prefill[0].bootstrap_port == 8998
    assert (settings.server.port, settings.server.max_n) == (9000, 9)
    assert settings.policy.policy == "cache_aware"
    assert settings.registry.admin_token is not None
    assert settings.registry.admin_token.get_secret_value() == "file-admin-token-0123"
    assert parse_args(["--config", config]).server.port == 8123
    # a flag's list replaces the file's
    assert [w.url for w in parse_args(["--config", config, "--decode", "http://d:1"]).decode] == [
        "http://d:1"
    ]


def test_toml_reads_the_same(tmp_path: Path) -> None:
    toml = """engine = "sglang"\n[server]\nport = 8123\n[[decode]]\nurl = "http://d:1"\n"""
    settings = parse_args(["--config", write(tmp_path, "router.toml", toml)])
    assert (settings.engine, settings.server.port) == (EngineProtocol.SGLANG, 8123)
    assert [w.url for w in settings.decode] == ["http://d:1"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("server:\n  prot: 1\n", "unknown setting 'server.prot' (did you mean 'server.port'?)"),
        ("engin: sglang\n", "unknown setting 'engin' (did you mean 'engine'?)"),
        ("decode:\n  - url: http://d:1\n    weigth: 2\n", "unknown setting 'decode[0].weigth'"),
        ("server:\n  port: -3\n", "setting server.port: Input should be greater than or equal"),
        ("- just\n- a list\n", "the top level is not a mapping of settings"),
        ("server: [\n", "not valid YAML"),
    ],
)
def test_a_bad_file_is_one_line_naming_the_setting(
    tmp_path: Path, text: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(tmp_path, "router.yaml", text)
    err = fails(["--config", config], capsys)
    assert f"argument --config: {config}: {said}" in err


def test_files_that_cannot_be_read_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    large = write(tmp_path, "large.yaml", "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert f"larger than {MAX_CONFIG_BYTES} bytes" in fails(["--config", large], capsys)
    ini = write(tmp_path, "x.ini", "")
    assert "a .yaml, .yml or .toml file" in fails(["--config", ini], capsys)
    assert "No such file" in fails(["--config", str(tmp_path / "missing.yaml")], capsys)


def test_config_show_prints_what_the_file_reads_back_with_secrets_redacted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDR_SERVER__MAX_N", "9")
    monkeypatch.setenv("PDR_REPLICAS__TOKEN", "replica-token-0123")  # not shown: read again
    argv = ["--config", write(tmp_path, "router.yaml", YAML), "--registry", "etcd://u:pw@e:2379"]
    secrets = ["--engine-api-key", "engine-key-0123", "--rate-limit-storage", "redis://:rp@r:6379"]
    urls = {  # each URL or address with a password, and how it is shown
        "--otlp-endpoint": ("http://o:Otel7@otel:4318", "http://***@otel:4318"),
        "--render-url": ("http://r:Render7@render:8000", "http://***@render:8000"),
        "--model-render-url": ("b=http://r:Model7@render-b:8000", "b=http://***@render-b:8000"),
        "--replica-listen": ("u:Listen7@127.0.0.1:5557", "***@127.0.0.1:5557"),
        "--replica-peer": ("tcp://u:Peer7@10.0.0.2:5557", "tcp://***@10.0.0.2:5557"),
        "--replica-peers-dns": ("u:Dns7@routers:5557", "***@routers:5557"),
    }
    given = [part for flag, (url, _) in urls.items() for part in (flag, url)]
    main(["config", "show", *argv, *secrets, *given])
    shown = capsys.readouterr().out
    assert "file-admin-token-0123" not in shown and "pw@" not in shown
    assert "admin_token: '**********'" in shown and "etcd://***@e:2379" in shown
    assert "engine-key-0123" not in shown and "rp@" not in shown
    assert "replica-token-0123" not in shown
    for password in ("Otel7", "Render7", "Model7", "Listen7", "Peer7", "Dns7"):
        assert password not in shown
    monkeypatch.delenv("PDR_SERVER__MAX_N")
    again = parse_args(["--config", write(tmp_path, "shown.yaml", shown)])
    redacted = [part for flag, (_, url) in urls.items() for part in (flag, url)]
    effective = parse_args([*argv[:2], *redacted])
    assert again.tracing == effective.tracing
    for section in ("server", "policy", "cache", "health", "admission", "replicas"):
        assert getattr(again, section) == getattr(effective, section).model_copy(
            update={"max_n": 9} if section == "server" else {}
        ), section
    assert again.prefill == effective.prefill and again.decode == effective.decode


def test_a_router_of_two_processes_runs_from_a_file(tmp_path: Path) -> None:
    """Each process of ``--workers 2`` reads the same file (the supervisor passes the flags on)."""
    prefill = FakeEngine("prefill", "sglang", config=FakeConfig(check_kv=False))
    decode = FakeEngine("decode", "sglang", config=FakeConfig(check_kv=False))
    with run_servers(prefill.app, decode.app) as (p_port, d_port):
        port = free_port()
        text = (
            f"engine: sglang\nprefill: [{{url: 'http://127.0.0.1:{p_port}'}}]\n"
            f"decode: [{{url: 'http://127.0.0.1:{d_port}'}}]\n"
            f"server: {{port: {port}, workers: '2'}}\nhealth: {{interval_s: 0.2}}\n"
        )
        argv = [sys.executable, "-m", "router", "--config", write(tmp_path, "r.yaml", text)]
        url = f"http://127.0.0.1:{port}"
        with http_process(argv, url, path="/ready", timeout=30):
            wait_until(lambda: joined(url) == 2, 20, "both processes on the port")
            body = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
            for _ in range(6):
                with httpx.Client(base_url=url, timeout=10) as client:  # a connection each
                    assert client.post("/v1/completions", json=body).status_code == 200


def test_the_documented_example_is_a_valid_file(tmp_path: Path) -> None:
    page = (Path(__file__).parents[3] / "docs" / "configuration.md").read_text()
    example = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    settings = parse_args(["--config", write(tmp_path, "example.yaml", example)])
    assert settings.server.workers == "auto" and settings.prefill[0].bootstrap_port == 8998
    # the model pools: each worker's models, a pool's own policy, an alias
    assert [w.models for w in settings.decode] == [("llama-8b",), ("qwen-7b",)]
    assert settings.policy.model_policies == {"llama-8b": "cache_aware"}
    assert settings.policy.model_aliases == {"llama": "llama-8b"}
