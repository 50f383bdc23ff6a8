"""``pd-worker``: run one simulated engine rank (see ``worker.app``)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

import uvicorn

from transfer.engine.base import TransferEngine
from transfer.engine.fake import LoopbackNetwork
from worker.app import EngineFactory, SimWorker, WorkerConfig, create_app
from worker.config_file import add_config_flag, parse_with_config, show_config
from worker.hicache.config import TierConfig
from worker.kv import PoolShape
from worker.kv_events import KVEventsConfig
from worker.page_queue import DEFAULT_MAX_WAITING, DEFAULT_WAITING_TIMEOUT_S
from worker.tokenizer import TokenizerError

__all__ = ["build_parser", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The flags over their ``--config`` file over the defaults (``worker.config_file``)."""
    return parse_with_config(build_parser(), argv)


Add = Callable[..., argparse.Action]  # a parser's or an argument group's ``add_argument``


def build_parser() -> argparse.ArgumentParser:
    """pd-worker's argument parser."""
    parser = argparse.ArgumentParser(
        prog="pd-worker",
        description="simulated PD engine worker",
        epilog="`pd-worker config show [--config FILE] [FLAGS]` prints the effective "
        "configuration (defaults < file < flags) as the YAML --config reads.",
    )
    add = parser.add_argument
    add_config_flag(parser)
    _add_role_args(add)
    _add_pool_args(add)
    _add_prompt_args(add)
    add(
        "--fault-api",
        action="store_true",
        help="serve POST/GET /debug/fault to inject 5xx answers and slow decoding (soak tests "
        "only; off by default)",
    )
    _add_hicache_args(parser)
    add("--log-level", default="warning")
    return parser


def _add_role_args(add: Add) -> None:
    """The role, where it listens, the PD protocol, its DP ranks and its transfer engine."""
    add("--role", choices=["prefill", "decode", "both"], required=True)
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--registry", help="bootstrap API a prefill registers with (host:port/URL)")
    add("--namespace", help="registry namespace (/bootstrap/NS)")
    add(
        "--protocol",
        choices=["sglang", "vllm-mooncake"],
        default="sglang",
        help="PD protocol a prefill registers and serves (a decode reads both)",
    )
    add("--dp", type=int, default=1, help="prefill DP ranks in this process")
    add("--engine-id", help="vLLM engine id (default: a uuid; _dpN per rank)")
    add(
        "--chunk-tokens",
        type=int,
        default=2048,
        help="chunked prefill: prompt tokens per forward chunk",
    )
    add(
        "--engine",
        choices=["loopback", "mooncake"],
        default="mooncake",
        help="transfer engine (loopback only moves KV within one process)",
    )


def _add_pool_args(add: Add) -> None:
    """The model, its KV pool's shape, and the simulated times."""
    add("--model", default="sim-model")
    add("--layers", type=int, default=8)
    add("--page-size", type=int, default=16)
    add("--bytes-per-token", type=int, default=4096, help="per layer, K+V")
    add("--pages", type=int, default=1024)
    add("--max-prompt-tokens", type=int, default=8192)
    add("--transfer-timeout", type=float, default=30.0)
    add(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_WAITING,
        help="per rank: requests that may wait for KV pages, first come first served (beyond: "
        "503 'The request queue is full.', as SGLang's flag of this name)",
    )
    add(
        "--waiting-timeout",
        type=float,
        default=DEFAULT_WAITING_TIMEOUT_S,
        metavar="S",
        help="how long a request may wait for KV pages (then 503 'Request waiting timeout "
        "reached.', as SGLang's SGLANG_REQ_WAITING_TIMEOUT); a PD request at most "
        "--transfer-timeout",
    )
    add(
        "--kv-drain-timeout",
        type=float,
        default=40.0,
        metavar="S",
        help="decode: how long a failed or abandoned receive waits for the prefill to confirm "
        "its writes into the request's pages are over, before they are withheld for good",
    )
    add(
        "--compute-s-per-token",
        type=float,
        default=0.0,
        help="simulated prefill forward time per prompt token",
    )
    add(
        "--decode-s-per-token",
        type=float,
        default=0.0,
        help="simulated decode step: seconds between streamed tokens",
    )


def _add_prompt_args(add: Add) -> None:
    """How prompts become tokens and block keys, and the KV event feed."""
    add(
        "--tokenizer",
        metavar="DIR",
        help="Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json with a "
        "chat_template); default: one token per UTF-8 byte",
    )
    add(
        "--hash-seed",
        help="vLLM protocol: prefix-cache block hash seed, like PYTHONHASHSEED "
        "(default: random per process; give the same seed across restarts for pages kept in "
        "--hicache-storage-dir to match again)",
    )
    add(
        "--kv-events-config",
        metavar="JSON",
        help='KV cache events, as vLLM/SGLang: \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\'; '
        "DP rank r publishes on port+r",
    )


def _add_hicache_args(parser: argparse.ArgumentParser) -> None:
    """The tiered KV cache (``worker.hicache.controller``), named after SGLang's --hicache-*."""
    add = parser.add_argument_group("tiered KV cache (HiCache)").add_argument
    _add_hicache_l2_args(add)
    _add_hicache_l3_args(add)
    _add_hicache_prefetch_args(add)
    _add_hicache_link_args(add)


def _add_hicache_l2_args(add: Add) -> None:
    """L2 (host pool) size and the backup policy."""
    add("--hicache-host-pages", type=int, default=0, help="L2 host pool pages (0: no tiers)")
    add(
        "--hicache-write-policy",
        choices=["write_through", "write_through_selective", "write_back"],
        default="write_through",
    )
    add(
        "--hicache-selective-hits",
        type=int,
        default=2,
        help="write_through_selective: hits before a page is backed up",
    )


def _add_hicache_l3_args(add: Add) -> None:
    """L3: the page store backend and its settings."""
    add("--hicache-storage-backend", choices=["none", "file", "mooncake"], default="none")
    add(
        "--hicache-storage-dir",
        metavar="DIR",
        help="file backend directory (DP rank i of a --dp > 1 prefill: DIR/rank<i>); a worker "
        "restarted on it serves what it holds (vLLM protocol: with the same --hash-seed)",
    )
    add("--hicache-storage-pages", type=int, default=0, help="L3 capacity (0: unbounded)")
    add("--hicache-storage-fsync", choices=["never", "page"], default="never")
    add("--hicache-mooncake-master", metavar="HOST:PORT", help="mooncake backend: the master")
    add("--hicache-mooncake-metadata", default="P2PHANDSHAKE", help="mooncake metadata server")


def _add_hicache_prefetch_args(add: Add) -> None:
    """L3 -> L2 prefetch: its late policy, threshold, timeout and rate."""
    add(
        "--hicache-prefetch-policy",
        choices=["best_effort", "wait_complete", "timeout"],
        default="best_effort",
    )
    add(
        "--hicache-prefetch-threshold",
        type=int,
        default=256,
        metavar="TOKENS",
        help="prefetch an L3 hit from this many tokens on",
    )
    add("--hicache-prefetch-timeout", type=float, default=1.0, metavar="S")
    add(
        "--hicache-prefetch-rate",
        type=float,
        default=0.0,
        metavar="BYTES_PER_S",
        help="prefetch rate limit (0: none)",
    )


def _add_hicache_link_args(add: Add) -> None:
    """The modelled links and the layer-by-layer load."""
    add(
        "--hicache-host-bandwidth",
        type=float,
        default=25e9,
        metavar="BYTES_PER_S",
        help="modelled L1<->L2 link (PCIe 4.0 x16 ~ 25 GB/s; 0: free)",
    )
    add(
        "--hicache-storage-bandwidth",
        type=float,
        default=0.0,
        metavar="BYTES_PER_S",
        help="cap on L3 I/O (0: only the real I/O)",
    )
    add(
        "--hicache-layerwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="load L2/L3 hits layer by layer under the forward pass",
    )


def _tiers(args: argparse.Namespace) -> TierConfig:
    return TierConfig(
        host_pages=args.hicache_host_pages,
        write_policy=args.hicache_write_policy,
        selective_hits=args.hicache_selective_hits,
        storage_backend=args.hicache_storage_backend,
        storage_dir=args.hicache_storage_dir,
        storage_pages=args.hicache_storage_pages,
        storage_fsync=args.hicache_storage_fsync,
        mooncake_master=args.hicache_mooncake_master,
        mooncake_metadata=args.hicache_mooncake_metadata,
        prefetch_policy=args.hicache_prefetch_policy,
        prefetch_threshold_tokens=args.hicache_prefetch_threshold,
        prefetch_timeout_s=args.hicache_prefetch_timeout,
        prefetch_rate=args.hicache_prefetch_rate,
        host_bandwidth=args.hicache_host_bandwidth,
        storage_bandwidth=args.hicache_storage_bandwidth,
        layerwise=args.hicache_layerwise,
    )


def _engine(name: str, host: str) -> EngineFactory:
    async def mooncake() -> TransferEngine:
        from transfer.engine.mooncake import MooncakeEngine

        return await MooncakeEngine.start(host)

    network = LoopbackNetwork()

    async def loopback() -> TransferEngine:
        return network.engine()

    return mooncake if name == "mooncake" else loopback


def build(args: argparse.Namespace) -> SimWorker:
    if args.role == "prefill" and not args.registry:
        raise SystemExit("pd-worker: a prefill needs --registry")
    extra = {"engine_id": args.engine_id} if args.engine_id else {}
    try:
        shape = PoolShape(
            layers=args.layers,
            page_size=args.page_size,
            bytes_per_token=args.bytes_per_token,
            pages=args.pages,
        )
        config = WorkerConfig(
            args.role,
            model=args.model,
            shape=shape,
            registry=args.registry,
            namespace=args.namespace,
            host=args.host,
            protocol=args.protocol,
            dp_size=args.dp,
            chunk_tokens=args.chunk_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            transfer_timeout_s=args.transfer_timeout,
            max_queued_requests=args.max_queued_requests,
            waiting_timeout_s=args.waiting_timeout,
            kv_drain_timeout_s=args.kv_drain_timeout,
            compute_s_per_token=args.compute_s_per_token,
            decode_s_per_token=args.decode_s_per_token,
            tokenizer=args.tokenizer,
            hash_seed=args.hash_seed,
            kv_events=_kv_events(args.kv_events_config),
            tiers=_tiers(args),
            **extra,
        )
        return SimWorker(config, _engine(args.engine, args.host))
    except (ValueError, TokenizerError) as exc:
        raise SystemExit(f"pd-worker: {exc}") from exc


def _kv_events(text: str | None) -> KVEventsConfig | None:
    return None if text is None else KVEventsConfig.from_json(text)


def main(argv: Sequence[str] | None = None) -> None:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:2] == ["config", "show"]:  # the effective configuration, passwords hidden
        sys.stdout.write(show_config(parse_args(given[2:])))
        return
    args = parse_args(given)
    logging.basicConfig(level=args.log_level.upper())
    app = create_app(build(args), fault_api=args.fault_api)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)


if __name__ == "__main__":
    main()
