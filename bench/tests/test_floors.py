"""``bench.load.peers --floors``: the router's server alone and a bare PD proxy on its parts,
measured beside ours and the peer (``bench.load.floor_app``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from bench.common.process import REPO_ROOT
from bench.load import peers
from bench.load.floor_app import FloorApp
from bench.load.peer_report import FLOOR_PROXY, FLOOR_SERVER, floor_rows, summarize
from bench.load.peer_stack import (
    Build,
    Cell,
    EnginePorts,
    RunRecord,
    engine_stack,
    router_argv,
    router_env,
)
from bench.load.peer_tables import render_floors
from bench.load.peers import PeersConfig, plan_builds
from router.settings import EngineProtocol
from router.workers import Role, Worker

N16_32 = Cell(16, 32, False)


def _record(target: str, cpu_us: float, repeat: int = 0) -> RunRecord:
    cell = N16_32
    return RunRecord(
        "sglang", target, repeat, cell.tokens, cell.concurrency, cell.stream, ok=True,
        router_cpu_us=cpu_us, latency_p50_ms=1.0,
    )  # fmt: skip


def test_floor_rows_are_what_ours_and_the_peer_spend_above_the_bare_proxy() -> None:
    records = [
        *(_record("ours", us, i) for i, us in enumerate((200, 210, 190))),
        *(_record("peer", us, i) for i, us in enumerate((140, 130, 150))),
        *(_record(FLOOR_PROXY, us, i) for i, us in enumerate((135, 125, 130))),
        *(_record(FLOOR_SERVER, us, i) for i, us in enumerate((30, 28, 31))),
    ]
    (row,) = floor_rows(summarize(records))
    assert (row.ours_us, row.peer_us, row.proxy_us, row.server_us) == (200, 140, 130, 30)
    assert row.pipeline_us == pytest.approx(70)  # ours - bare proxy
    assert row.room_us == pytest.approx(10)  # what the peer leaves above the bare proxy
    table = render_floors([row])
    assert table[-1] == "| sglang | 16 tok C=32 non-stream | 30 | 130 | 200 | 140 | +70 | +10 |"


def test_no_floor_runs_no_floor_rows() -> None:
    assert floor_rows(summarize([_record("ours", 200), _record("peer", 150)])) == []


def test_floor_builds_run_the_floor_app_from_this_checkout() -> None:
    builds = plan_builds(PeersConfig(peers=False, floors=True), "vllm-mooncake", None)
    assert [(b.name, b.kind, b.role, b.shape) for b in builds] == [
        ("ours", "ours", "ours", ""),
        (FLOOR_SERVER, "floor", "floor", "server"),
        (FLOOR_PROXY, "floor", "floor", "proxy"),
    ]
    proxy: Build = builds[2]
    argv = router_argv(proxy, "sglang", EnginePorts(1001, 1002, 1003), 2000, 2001)
    assert argv[1:8] == [
        "-P",
        "-m",
        "bench.load.floor_app",
        "--shape",
        "proxy",
        "--engine",
        "sglang",
    ]
    assert argv[8:] == [
        "--prefill", "http://127.0.0.1:1001", "1002", "--decode", "http://127.0.0.1:1003",
        "--host", "127.0.0.1", "--port", "2000",
    ]  # fmt: skip
    env = router_env(proxy, {"PYTHONPATH": "/elsewhere", "PDR_FEATURES__METRICS": "false"})
    assert env["PYTHONPATH"] == str(REPO_ROOT)


@pytest.mark.slow  # process-level; scripts/test-slow (the default suite stays ~10 min)
def test_the_floors_proxy_and_answer_every_cell_through_real_fakes(tmp_path: Path) -> None:
    """Fakes, our router and both floors, every process real: each floor answers every request
    of both engines' streaming and whole cells (the load generator counts a bad answer as an
    error, and a run with an error counts in no median)."""
    out = tmp_path / "peers.json"
    argv = (
        "--quick --no-peers --floors --engines vllm-mooncake,sglang --tokens 4 --concurrency 2 "
        f"--modes stream,non-stream --requests 200 --warmup 1 --json {out} --log-dir {tmp_path}"
    )
    assert peers.main(argv.split()) == 0
    report = json.loads(out.read_text())
    assert not report["failures"]
    floors = [r for r in report["records"] if r["target"] in (FLOOR_SERVER, FLOOR_PROXY)]
    assert len(floors) == 2 * 2 * 2  # 2 engines x 2 cells x 2 floors
    assert all(r["ok"] and r["load"]["completed"] >= 200 for r in floors)
    assert len(report["floors"]) == 4
    for row in report["floors"]:  # (a few ms of CPU may read 0: /proc counts 10 ms ticks)
        assert row["proxy_us"] is not None and row["server_us"] is not None
        assert row["pipeline_us"] == pytest.approx(row["ours_us"] - row["proxy_us"])


@pytest.mark.parametrize("engine", ["vllm-mooncake", "sglang"])
@pytest.mark.parametrize("stream", [False, True])
async def test_the_bare_proxy_answers_with_the_engines_answer(
    engine: str, stream: bool, tmp_path: Path
) -> None:
    """The proxy floor really proxies: the fake decode's answer, not the server floor's."""
    with engine_stack(engine, [], 8, tmp_path, 30.0) as stack:
        ports = stack.ports
        prefill = Worker(Role.PREFILL, ports.url(ports.prefill), ports.bootstrap)
        prefill.set_layout(1, ("floor-engine",))
        app = FloorApp(
            "proxy", EngineProtocol(engine), prefill, Worker(Role.DECODE, ports.url(ports.decode))
        )
        body = {"model": "fake-model", "prompt": "hi", "max_tokens": 4, "stream": stream}
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
            answer = await client.post("/v1/completions", json=body)
    assert answer.status_code == 200
    assert "cmpl-floor" not in answer.text  # (the server floor's own answer)
    if stream:
        assert answer.text.count("data: ") >= 4 and answer.text.rstrip().endswith("[DONE]")
    else:
        assert answer.json()["choices"][0]["text"]
