"""``pd-cluster`` wiring: KV event ports per prefill and DP rank, policies, tokenizer, extra
router flags, all in the command lines it starts (which the router and the worker accept)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from router.server.cli import parse_args as router_settings
from worker.__main__ import build
from worker.__main__ import parse_args as worker_args
from worker.cluster import _Layout, _parse, _prefill_args, _router_args, main


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_every_prefill_gets_free_kv_event_ports_per_dp_rank(tmp_path: Path) -> None:
    args = _parse(
        [
            "--prefill", "2", "--dp", "2", "--engine", "vllm-mooncake", "--port", "18000",
            "--policy", "least_load", "--decode-policy", "round_robin",
            "--tokenizer", str(tmp_path),
            "--router-arg=--load-interval", "--router-arg=0.5",
            "--", "--pages", "256",
        ]
    )  # fmt: skip
    layout = _Layout(args)
    events = [pair for pair in layout.events if pair is not None]
    assert len(events) == 2
    ports = [p + r for pair in events for p in pair for r in (0, 1)]
    ports += layout.prefills + layout.namespaces + layout.decodes
    assert len(set(ports)) == len(ports) and 18000 not in ports and all(map(_free, ports))

    router = _router_args(args, layout, args.port)
    (live, replay), url = events[1], f"http://127.0.0.1:{layout.prefills[1]}"
    i = router.index(url)
    assert router[i + 1 :][:3] == [
        "ns:p1",
        f"events=tcp://127.0.0.1:{live}",
        f"replay=tcp://127.0.0.1:{replay}",
    ]
    assert router[-2:] == ["--load-interval", "0.5"]
    settings = router_settings(router[1:])  # the router accepts it all
    assert settings.prefill[1].kv_events == f"tcp://127.0.0.1:{live}"
    assert settings.cache.tokenizer == str(tmp_path) and settings.load.interval_s == 0.5

    prefill = _prefill_args(args, layout.prefills[1], layout.namespaces[1], events[1])
    config = json.loads(prefill[prefill.index("--kv-events-config") + 1])
    assert config["enable_kv_cache_events"] is True
    assert config["endpoint"] == f"tcp://127.0.0.1:{live}"
    assert config["replay_endpoint"] == f"tcp://127.0.0.1:{replay}"
    parsed = worker_args(prefill[1:])
    assert (parsed.dp, parsed.protocol, parsed.tokenizer, parsed.pages) == (
        2,
        "vllm-mooncake",
        str(tmp_path),
        256,
    )


def test_kv_events_can_be_turned_off() -> None:
    args = _parse(["--no-kv-events", "--", "--pages", "8", "--bytes-per-token", "64"])
    layout = _Layout(args)
    assert layout.events == [None]
    assert not any(a.startswith("events=") for a in _router_args(args, layout, args.port))
    prefill = _prefill_args(args, layout.prefills[0], layout.namespaces[0], None)
    assert "--kv-events-config" not in prefill
    assert build(worker_args(prefill[1:])).config.kv_events is None


def test_a_second_replica_reaches_the_ranks_registered_with_the_first() -> None:
    args = _parse(["--router-replicas", "2", "--port", "18000", "--", "--pages", "8"])
    layout = _Layout(args)
    assert layout.replicas is not None
    first, second = (_router_args(args, layout, p, i) for i, p in enumerate(layout.replicas.ports))
    url, ns_port = f"http://127.0.0.1:{layout.prefills[0]}", layout.namespaces[0]
    assert first[first.index(url) + 1] == "ns:p0" and "--bootstrap-namespace" in first
    assert second[second.index(url) + 1] == str(ns_port) and "--bootstrap-namespace" not in second
    settings = router_settings(second[1:])  # the router accepts it all
    assert settings.prefill[0].bootstrap_port == ns_port
    assert settings.replicas.peers == [f"127.0.0.1:{layout.replicas.sync_ports[0]}"]
    assert settings.server.port == layout.replicas.ports[1] != 18000


def test_models_spread_over_the_workers_and_are_declared_to_the_router() -> None:
    args = _parse(["--models", "a,b", "--prefill", "2", "--decode", "3", "--", "--pages", "8"])
    layout = _Layout(args)
    settings = router_settings(_router_args(args, layout, args.port)[1:])
    assert [spec.models for spec in settings.prefill] == [("a",), ("b",)]
    assert [spec.models for spec in settings.decode] == [("a",), ("b",), ("a",)]
    prefill = _prefill_args(args, layout.prefills[1], layout.namespaces[1], layout.events[1], 1)
    assert build(worker_args(prefill[1:])).config.model == "b"


def test_more_models_than_workers_of_a_role_is_refused() -> None:
    with pytest.raises(SystemExit, match="--models needs at least one prefill and one decode"):
        main(["--models", "a,b", "--prefill", "2", "--decode", "1"])
