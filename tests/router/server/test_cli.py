"""CLI flags and env settings: compatible syntax, env < flags, one-line errors naming the flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from router.kv_tiers import DEFAULT_TIER_WEIGHTS
from router.server.cli import parse_args
from router.settings import EngineProtocol


def test_seed_proxy_and_sglang_router_syntax() -> None:
    s = parse_args(
        [
            "--prefill",
            "http://p1:8100",
            "8998",
            "--prefill",
            "http://p2:8100",
            "none",
            "--prefill",
            "http://p3:8100",
            "--decode",
            "http://d1:8200",
            "--decode",
            "http://d2:8200",
            "--engine",
            "sglang",
            "--policy",
            "least_load",
            "--decode-policy",
            "power_of_two",
            "--port",
            "8001",
            "--host",
            "0.0.0.0",
            "--log-level",
            "debug",
        ]
    )
    assert [(w.url, w.bootstrap_port) for w in s.prefill] == [
        ("http://p1:8100", 8998),
        ("http://p2:8100", None),
        ("http://p3:8100", None),
    ]
    assert [w.url for w in s.decode] == ["http://d1:8200", "http://d2:8200"]
    assert s.engine is EngineProtocol.SGLANG
    assert (s.policy.policy, s.policy.prefill_policy, s.policy.decode_policy) == (
        "least_load",
        None,
        "power_of_two",
    )
    assert (s.server.host, s.server.port, s.logging.level) == ("0.0.0.0", 8001, "debug")


def test_flags_override_env_and_env_fills_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDR_SERVER__PORT", "9100")
    monkeypatch.setenv("PDR_UPSTREAM__CONNECT_TIMEOUT_S", "1.5")
    monkeypatch.setenv("PDR_UPSTREAM__MAX_RETRIES", "4")
    monkeypatch.setenv("PDR_DECODE", '[{"url": "http://envd:1"}]')
    monkeypatch.setenv("PDR_ENGINE", "vllm-nixl")
    s = parse_args(["--port", "9200", "--max-retries", "1"])
    assert s.server.port == 9200
    assert s.upstream.max_retries == 1
    assert s.upstream.connect_timeout_s == 1.5  # nested env survives a nested flag
    assert [w.url for w in s.decode] == ["http://envd:1"]
    assert s.engine is EngineProtocol.VLLM_NIXL


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--port", "eighty"], "--port"),
        (["--port", "70000"], "--port"),
        (["--engine", "trt"], "--engine"),
        (["--policy", "random"], "--policy"),
        (["--prefill", "http://p:1", "x"], "--prefill"),
        (["--prefill", "http://p:1", "1", "2"], "--prefill"),
        (["--prefill", "ftp://p:1"], "--prefill"),
        (["--decode", "not a url"], "--decode"),
        (["--connect-timeout", "-1"], "--connect-timeout"),
        (["--log-level", "loud"], "--log-level"),
        (["--cache-tier-weights", "NVME=0.5"], "--cache-tier-weights"),
        (["--cache-tier-weights", "DISK=1.5"], "--cache-tier-weights"),
        (["--cache-tier-weights", "DISK"], "--cache-tier-weights"),
    ],
)
def test_bad_flag_exits_with_one_line_naming_it(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert flag in err


def test_cache_tier_weights_from_the_flag_or_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert parse_args([]).cache.tier_weights == dict(DEFAULT_TIER_WEIGHTS)
    given = parse_args(["--cache-tier-weights", "cpu=0.6, DISK=0"])  # CPU: vLLM's name for host
    assert given.cache.tier_weights == {"CPU_PINNED": 0.6, "DISK": 0.0}
    monkeypatch.setenv("PDR_CACHE__TIER_WEIGHTS", '{"DISK": 0.25}')  # a tier not given: default
    assert parse_args([]).cache.tier_weights == {**DEFAULT_TIER_WEIGHTS, "DISK": 0.25}


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("NVME=0.5", "unknown KV cache tier 'NVME'; known tiers: GPU, CPU_PINNED, DISK, CPU"),
        ("DISK=-0.1", "the weight of tier 'DISK' must be within 0..1, got -0.1"),
        ("DISK=0.4,disk=0.3", "tier DISK is given twice ('disk')"),
        ("CPU=0.4,CPU_PINNED=0.3", "tier CPU_PINNED is given twice ('CPU_PINNED')"),
        ("GPU=0.9", "the GPU tier's weight is always 1.0"),
        ("DISK:0.4", "expected TIER=WEIGHT (e.g. DISK=0.4), got 'DISK:0.4'"),
    ],
)
def test_bad_cache_tier_weights_stop_startup_with_a_clear_message(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--cache-tier-weights", value])
    assert capsys.readouterr().err == f"router: error: argument --cache-tier-weights: {message}\n"


def test_console_script_reports_bad_flag() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router", "--port", "x"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert result.stderr.strip() == "router: error: argument --port: invalid int value: 'x'"


def test_workers_declare_their_models_and_aliases_map_names() -> None:
    s = parse_args(
        [
            "--prefill", "http://p1:8100", "8998", "model=a,b", "events=tcp://p1:5557",
            "--decode", "http://d1:8200", "model=a",
            "--decode", "http://d2:8200",
            "--model-alias", "latest=a", "--model-alias", "old=b",
            "--model-policy", "a=cache_aware",
        ]
    )  # fmt: skip
    assert (s.prefill[0].models, s.prefill[0].bootstrap_port) == (("a", "b"), 8998)
    assert s.prefill[0].kv_events == "tcp://p1:5557"
    assert [w.models for w in s.decode] == [("a",), ()]
    assert s.policy.model_aliases == {"latest": "a", "old": "b"}
    assert s.policy.model_policies == {"a": "cache_aware"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decode", "http://d:8200", "8998"], "expected URL [model=NAME]"),
        (["--model-alias", "latest"], "expected NAME=VALUE pairs (ALIAS=NAME, MODEL=DIR)"),
        (["--model-tokenizer", "/models/b"], "got '/models/b'"),
        (["--model-policy", "a=fastest"], "expected MODEL=POLICY (a policy of round_robin"),
        (["--decode", "http://d:8200", "model="], "a model name is 1 to 256"),
    ],
)
def test_a_bad_model_declaration_is_one_line_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--prefill", "http://p:8100", *argv])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
