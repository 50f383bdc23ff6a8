"""bench.routing.traces and bench.routing.workload: trace shapes, the result math, the load driver
(against a small real SSE server on 127.0.0.1); no cluster is started."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from bench.common.cluster import Cluster
from bench.common.prometheus import bucket_delta, histogram_buckets, histogram_quantile
from bench.common.stats import Percentiles
from bench.routing import workload
from bench.routing.traces import (
    Trace,
    TraceRequest,
    multi_turn,
    random_prompts,
    shared_prefix,
    standard_traces,
)
from bench.routing.workload import (
    POLICIES,
    POOLED,
    BenchSetup,
    Outcome,
    PolicySpec,
    Report,
    RunResult,
    Snapshot,
    TraceInfo,
    WorkloadConfig,
    check_targets,
    cluster_argv,
    drive,
    engine_cache_tokens,
    failed,
    pages_for,
    parse_args,
    peer_argv,
    render,
    summarize,
    write_json,
)
from testkit.servers import arun_server

# --- traces ------------------------------------------------------------------------------------


def test_traces_are_deterministic_per_seed() -> None:
    assert standard_traces(quick=True, seed=3) == standard_traces(quick=True, seed=3)
    assert standard_traces(quick=True, seed=3) != standard_traces(quick=True, seed=4)


def test_multi_turn_histories_grow_and_system_prompts_are_shared_by_group() -> None:
    trace = multi_turn(conversations=6, turns=3, groups=2, system_tokens=200, seed=1)
    assert trace.requests == 18 and all(len(s) == 3 for s in trace.sessions)
    for session in trace.sessions:
        for earlier, later in zip(session, session[1:], strict=False):
            # the next turn resends the history: previous messages, the answer, a new question
            assert later.messages[: len(earlier.messages)] == earlier.messages
            assert [r for r, _ in later.messages[len(earlier.messages) :]] == ["assistant", "user"]
    systems = [s[0].messages[0] for s in trace.sessions]
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3]
    assert all(r.chat and r.path == "/v1/chat/completions" for s in trace.sessions for r in s)


def test_shared_prefix_groups_share_a_prefix_and_arrive_shuffled() -> None:
    trace = shared_prefix(groups=4, per_group=5, prefix_tokens=100, tail_tokens=10, seed=2)
    prompts = [s[0].prompt for s in trace.sessions]
    assert len(prompts) == 20 == len(set(prompts))  # unique tails
    heads = [p[:300] for p in prompts]
    assert len(set(heads)) == 4 and all(heads.count(h) == 5 for h in heads)
    runs = sum(1 for a, b in zip(heads, heads[1:], strict=False) if a != b)
    assert runs > 3  # not group after group
    assert all(not r.chat and r.path == "/v1/completions" for s in trace.sessions for r in s)


def test_random_prompts_share_nothing_and_sizes_follow_chars_per_token() -> None:
    trace = random_prompts(count=30, tokens=200, chars_per_token=4.0, seed=0)
    assert len({s[0].prompt[:64] for s in trace.sessions}) == 30
    assert all(799 <= len(s[0].prompt) <= 812 for s in trace.sessions)
    small = random_prompts(count=3, tokens=200, chars_per_token=1.0)
    assert all(199 <= len(s[0].prompt) <= 212 for s in small.sessions)


def test_working_set_counts_a_shared_prefix_once() -> None:
    prefix = "x" * 640

    def trace(*prompts: str) -> Trace:
        return Trace("t", "", tuple((TraceRequest(prompt=p),) for p in prompts), 1)

    one = trace(prefix + "a" * 64).working_set_chars()
    assert one == 704
    assert trace(prefix + "a" * 64, prefix + "b" * 64).working_set_chars() == 704 + 64
    assert trace("b" * 64 + prefix, prefix).working_set_chars() == 704 + 640


def test_request_bodies_stream() -> None:
    chat = TraceRequest(messages=(("system", "s"), ("user", "u")), max_tokens=5)
    assert chat.body("m") == {
        "model": "m",
        "max_tokens": 5,
        "stream": True,
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
    }
    assert TraceRequest(prompt="p").body("m")["prompt"] == "p"


def test_pages_hold_a_third_of_the_working_set_but_never_too_few_for_concurrency() -> None:
    cfg = WorkloadConfig(page_size=16)
    trace = shared_prefix(groups=16, per_group=4, prefix_tokens=500, concurrency=1)
    blocks = trace.working_set_chars() / 4.0 / 16
    assert pages_for(trace, cfg, 4.0) == math.ceil(blocks / 3)
    crowded = shared_prefix(groups=2, per_group=2, prefix_tokens=500, concurrency=8)
    longest = crowded.max_prompt_chars() / 4.0 / 16 + 2
    assert pages_for(crowded, cfg, 4.0) == math.ceil(8 * longest)


# --- metrics math ------------------------------------------------------------------------------


def test_histogram_quantile_interpolates_inside_the_bucket() -> None:
    buckets = {0.001: 10.0, 0.002: 30.0, 0.005: 40.0, math.inf: 40.0}
    assert histogram_quantile(buckets, 0.25) == pytest.approx(0.001)
    assert histogram_quantile(buckets, 0.5) == pytest.approx(0.0015)
    assert histogram_quantile(buckets, 0.1) == pytest.approx(0.0004)
    assert histogram_quantile({0.001: 0.0, math.inf: 0.0}, 0.5) is None
    assert histogram_quantile({0.001: 1.0, math.inf: 10.0}, 0.99) == pytest.approx(0.001)


def test_router_histogram_delta_over_label_sets() -> None:
    registry = CollectorRegistry()
    hist = Histogram(
        "pdr_routing_decision_seconds",
        "",
        ["policy"],
        buckets=(10e-6, 50e-6, 100e-6),
        registry=registry,
    )
    hist.labels("a").observe(5e-6)
    before = histogram_buckets(generate_latest(registry).decode(), "pdr_routing_decision_seconds")
    for _ in range(4):
        hist.labels("a").observe(20e-6)
        hist.labels("b").observe(70e-6)
    after = histogram_buckets(generate_latest(registry).decode(), "pdr_routing_decision_seconds")
    assert before is not None and after is not None
    delta = bucket_delta(before, after)
    assert delta == {10e-6: 0.0, 50e-6: 4.0, 100e-6: 8.0, math.inf: 8.0}
    assert histogram_quantile(delta, 0.5) == pytest.approx(50e-6)
    assert histogram_buckets("", "pdr_routing_decision_seconds") is None


@pytest.mark.parametrize(
    ("cached", "prompt"),
    [
        ("sglang:cached_tokens", "sglang:prompt_tokens"),
        ("sglang_cached_tokens", "sglang_prompt_tokens"),
        ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
    ],
)
def test_engine_cache_counters_either_protocol(cached: str, prompt: str) -> None:
    registry = CollectorRegistry()
    hits = Counter(cached, "", ["engine"], registry=registry)
    queries = Counter(prompt, "", ["engine"], registry=registry)
    hits.labels("0").inc(30)
    hits.labels("1").inc(10)
    queries.labels("0").inc(100)
    assert engine_cache_tokens(generate_latest(registry).decode()) == (40.0, 100.0)
    assert engine_cache_tokens("# nothing here\n") is None


# --- results -----------------------------------------------------------------------------------


def _run(trace: str, policy: str, ttft: float = 100.0, rps: float = 10.0) -> RunResult:
    return RunResult(
        trace,
        policy,
        "ours",
        POOLED,
        64,
        10,
        completed=10,
        ttft_ms=Percentiles(ttft, ttft, ttft),
        req_per_s=rps,
    )


def test_targets_pass_fail_and_missing_runs_are_na() -> None:
    runs = [
        _run("multi_turn", "round_robin", ttft=100.0),
        _run("multi_turn", "cache_aware", ttft=50.0),
        _run("multi_turn", "sgl_cache_aware", ttft=49.0),
        _run("shared_prefix", "round_robin", ttft=100.0),
        _run("shared_prefix", "cache_aware", ttft=51.0),
        _run("random", "least_load", rps=10.0),
        _run("random", "cache_aware", rps=9.5),
    ]
    verdicts = [(c.description.split(":")[0], c.verdict) for c in check_targets(runs)]
    assert verdicts == [
        ("multi_turn", "PASS"),  # 50 <= 0.5 x 100
        ("multi_turn", "FAIL"),  # 50 is not below 49
        ("shared_prefix", "FAIL"),  # 51 > 50
        ("shared_prefix", "n/a"),  # no sglang-router run
        ("random", "PASS"),  # 9.5 >= 0.95 x 10
    ]


def test_summarize_turns_counters_into_rates() -> None:
    base = RunResult("random", "least_load", "ours", POOLED, 64, 4)
    outcomes = [Outcome(0.2, ttft_s=0.1), Outcome(0.4, ttft_s=0.3), Outcome(0.1, error="boom")]
    before = Snapshot(((100.0, 1000.0), (0.0, 0.0)), {1e-5: 0.0, math.inf: 0.0}, None, 10.0)
    after = Snapshot(((400.0, 1600.0), (0.0, 400.0)), {1e-5: 2.0, math.inf: 2.0}, None, 10.3)
    result = summarize(base, outcomes, 2.0, before, after)
    assert (result.completed, result.errors, result.skipped_requests) == (2, 1, 1)
    assert result.req_per_s == pytest.approx(1.0)
    assert result.hit_ratio == pytest.approx(0.3)
    assert result.prefill_skew == pytest.approx(400 / 350)  # computed: 300 and 400 tokens
    assert result.router_cpu_ms_per_req == pytest.approx(100.0)
    assert result.decision_us is not None and result.decision_us[0] == pytest.approx(5.0)
    assert result.tokenize_us_p50 is None
    assert result.ttft_ms.p50 == pytest.approx(200.0) and result.error_samples == ("boom",)


def test_the_cpu_time_is_read_next_to_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Scraping the router's ``/metrics`` costs it CPU (``--workers N`` merges every process's
    exposition), which no request caused: the CPU is read after the scrape before a run, and
    before it after the run."""
    order: list[str] = []

    def cpu(pids: Sequence[int]) -> float:
        order.append("cpu")
        return 1.0

    def scrape(client: httpx.Client, url: str) -> str:
        order.append("scrape")
        return ""

    monkeypatch.setattr(workload, "_cpu", cpu)
    monkeypatch.setattr(workload, "_metrics", scrape)
    with httpx.Client() as client:
        workload.take_snapshot(client, [], "http://127.0.0.1:9/metrics", (1,))
        assert order == ["scrape", "cpu"]
        order.clear()
        workload.take_snapshot(client, [], "http://127.0.0.1:9/metrics", (1,), after=True)
        assert order == ["cpu", "scrape"]


def test_the_cpu_of_every_router_replica_counts() -> None:
    """With --router-replicas the routers' CPU is every replica's (it was the first one's)."""
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\n"
    burn += "print(flush=True)\ntime.sleep(30)"
    children = [
        subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE) for _ in range(2)
    ]
    try:
        for child in children:
            assert child.stdout is not None
            child.stdout.readline()  # burnt its 0.2 s
        one = workload._cpu((children[0].pid,))
        both = workload._cpu(tuple(child.pid for child in children))
    finally:
        for child in children:
            child.kill()
            child.communicate()
    assert one is not None and both is not None
    assert both >= one + 0.19


def test_render_and_json(tmp_path: Path) -> None:
    runs = (
        _run("random", "least_load"),
        RunResult("random", "cache_aware", "ours", POOLED, 64, 10, not_run="skipped: no policy"),
    )
    report = Report(
        WorkloadConfig(quick=True),
        "testkit tokenizer",
        4.1,
        (TraceInfo("random", "48 prompts", 10, 64),),
        runs,
        check_targets(runs),
        12.0,
    )
    text = render(report)
    assert "skipped: no policy" in text and "n/a" in text and "targets:" in text
    assert not failed(report)
    write_json(report, tmp_path / "out" / "r.json")
    data = json.loads((tmp_path / "out" / "r.json").read_text())
    assert data["runs"][0]["ttft_ms"]["p50"] == 100.0
    assert data["targets"][-1]["passed"] is None


def test_cli_quick_and_subsets() -> None:
    cfg = parse_args(["--quick", "--policies", "round_robin,sgl_cache_aware", "--traces", "random"])
    assert cfg.quick and cfg.run_deadline_s == 40.0
    assert cfg.policies == ("round_robin", "sgl_cache_aware") and cfg.traces == ("random",)
    with pytest.raises(SystemExit):
        parse_args(["--policies", "nope"])


# --- the load driver against a real SSE server --------------------------------------------------


def _sse_app(seen: list[str], live: list[int], peak: list[int]) -> FastAPI:
    app = FastAPI()

    async def answer(request: Request) -> Response:
        body = await request.json()
        text = body.get("prompt") or body["messages"][-1]["content"]
        seen.append(text)
        if text == "fail":
            return JSONResponse({"error": {"message": "no"}}, status_code=500)
        live[0] += 1
        peak[0] = max(peak[0], live[0])

        async def events() -> AsyncIterator[bytes]:
            try:
                await asyncio.sleep(0.01)
                choice = b'{"index": 0, "text": "a", "delta": {"content": "a"}}'
                yield b'data: {"choices": [%s]}\n\n' % choice
                yield b'data: {"choices": [], "usage": {}}\n\n'
                yield b"data: [DONE]\n\n"
            finally:
                live[0] -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    return app


async def test_drive_runs_sessions_in_order_with_bounded_concurrency() -> None:
    seen: list[str] = []
    live, peak = [0], [0]
    sessions = tuple(
        tuple(TraceRequest(messages=(("user", f"c{c}t{t}"),)) for t in range(3)) for c in range(6)
    )
    failing = ((TraceRequest(prompt="fail"),),)
    trace = Trace("t", "", sessions + failing, concurrency=3)
    cfg = WorkloadConfig(run_deadline_s=30.0, request_timeout_s=10.0)
    async with arun_server(_sse_app(seen, live, peak)) as port:
        outcomes, wall = await drive(trace, f"http://127.0.0.1:{port}", "m", POOLED, cfg)
    assert len(outcomes) == 19 and wall > 0
    assert [o.error is None for o in outcomes].count(False) == 1
    assert all(o.ttft_s is not None and 0 < o.ttft_s <= o.e2e_s for o in outcomes if not o.error)
    for c in range(6):  # each conversation's turns in order
        turns = [s for s in seen if s.startswith(f"c{c}t")]
        assert turns == [f"c{c}t0", f"c{c}t1", f"c{c}t2"]
    assert 1 < peak[0] <= 3


async def test_drive_starts_nothing_after_the_deadline() -> None:
    trace = random_prompts(count=5, tokens=10)
    cfg = WorkloadConfig(run_deadline_s=0.0)
    outcomes, _ = await drive(trace, "http://127.0.0.1:9", "m", POOLED, cfg)
    assert outcomes == []


# --- command lines -----------------------------------------------------------------------------

SETUP = BenchSetup(Path("/peers/python"), Path("/tok"), chars_per_token=2.5)


def _spec(label: str) -> PolicySpec:
    return next(p for p in POLICIES if p.label == label)


def test_every_worker_gets_the_tokenizer_only_precise_routing_gives_it_the_router() -> None:
    def split(label: str) -> tuple[list[str], list[str]]:
        argv = cluster_argv(WorkloadConfig(), SETUP, _spec(label), 900, 8123)
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]

    cluster, workers = split("cache_aware")
    assert cluster[cluster.index("--tokenizer") + 1] == "/tok"
    assert cluster[cluster.index("--prefill-policy") + 1] == "cache_aware"
    for label in ("cache_aware_approx", "round_robin", "sgl_cache_aware"):
        cluster, workers = split(label)
        assert "--tokenizer" not in cluster
        assert workers[workers.index("--tokenizer") + 1] == "/tok"
        assert workers[workers.index("--pages") + 1] == "900"
    assert "--prefill-policy" not in split("sgl_round_robin")[0]
    assert "--router-arg=--health-interval" in split("round_robin")[0]


def test_peer_runs_are_skipped_without_the_peer_venv() -> None:
    bare = BenchSetup(None, Path("/tok"), 1.0)
    assert bare.unavailable(_spec("sgl_cache_aware")) is not None  # no .venv-peers
    assert bare.unavailable(_spec("cache_aware")) is None


def test_sglang_router_gets_each_prefill_with_its_bootstrap_port() -> None:
    cluster = Cluster(
        child=None,  # type: ignore[arg-type]
        url="http://127.0.0.1:1",
        prefills=(("http://127.0.0.1:2", 92), ("http://127.0.0.1:3", 93)),
        decodes=("http://127.0.0.1:4",),
        model="m",
    )
    argv = peer_argv(_spec("sgl_cache_aware"), cluster, 7000, 7001)
    text = " ".join(argv)
    assert "--pd-disaggregation" in argv and "--policy cache_aware" in text
    assert "--prefill http://127.0.0.1:2 92 --prefill http://127.0.0.1:3 93" in text
    assert "--decode http://127.0.0.1:4" in text and "--port 7000" in text
