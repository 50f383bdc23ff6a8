"""``router doctor URL``: ask a running router why routing on the cache does or does not work,
and print it (``GET /admin/diagnosis``, admin auth).

Prints each pool's and prefill rank's routing state (EXACT, DEGRADED, FALLBACK) with the rank's
recent agreement, then every finding: a named cause, the evidence, the remedy. Exit status: 0 no
finding, 1 at least one finding, 2 the router could not be asked (unreachable, auth refused, not
a router). Usable in CI and as a probe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO

import httpx

__all__ = ["doctor", "render"]

TOKEN_ENV = "PDR_REGISTRY__ADMIN_TOKEN"  # the router's own admin token variable


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="router doctor",
        description="Ask a running router why cache-aware routing does or does not work. Exit "
        "status: 0 no finding, 1 findings, 2 the router could not be asked.",
    )
    parser.add_argument("url", help="the router, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--admin-token",
        default=os.environ.get(TOKEN_ENV),
        help=f"the router's admin bearer token (default: ${TOKEN_ENV}; none: loopback only)",
    )
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds (10)")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    return parser


def doctor(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = _parser().parse_args(argv)
    url = args.url.rstrip("/") + "/admin/diagnosis"
    headers = {"authorization": f"Bearer {args.admin_token}"} if args.admin_token else {}
    try:
        response = httpx.get(url, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        err.write(f"router doctor: cannot ask {url}: {exc}\n")
        return 2
    if response.status_code != 200:
        err.write(f"router doctor: {url} answered HTTP {response.status_code}: {response.text}\n")
        return 2
    try:
        data = response.json()
        findings = data["findings"]
    except (ValueError, KeyError, TypeError):
        err.write(f"router doctor: {url} did not answer a diagnosis: {response.text[:200]}\n")
        return 2
    out.write(json.dumps(data, indent=2) + "\n" if args.json else render(data))
    return 1 if findings else 0


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _agreement(row: dict[str, Any] | None) -> str | None:
    if not row or not row.get("requests"):
        return None
    line = f"  agreement over the last {row['requests']} requests"
    if not row.get("reported"):
        return line + ": no cached tokens reported"
    return (
        f"{line}: predicted hit rate {_percent(row['predicted_hit_rate'])}, actual "
        f"{_percent(row['actual_hit_rate'])}, mean error {_percent(row['error_ratio'])} of the "
        f"prompt; token counts differ {row['token_count_differs']} of "
        f"{row['token_count_compared']}"
    )


def render(data: dict[str, Any]) -> str:
    """The diagnosis as text: states, agreement, findings with their remedies."""
    lines = [
        f"pool {pool['pool']}: {pool['state'].upper()} - {pool['reason']}"
        for pool in data.get("pools", [])
    ]
    by_rank: dict[tuple[str | None, int | None], list[dict[str, Any]]] = {}
    for finding in data["findings"]:
        by_rank.setdefault((finding["worker"], finding["dp_rank"]), []).append(finding)
    for rank in data.get("ranks", []):
        head = f"prefill {rank['worker']} rank {rank['dp_rank']}"
        lines.append(f"{head}: {rank['state'].upper()} - {rank['reason']}")
        agreement = _agreement(rank.get("agreement"))
        if agreement is not None:
            lines.append(agreement)
        if rank.get("engine_hit_rate") is not None:
            rate = _percent(rank["engine_hit_rate"])
            lines.append(f"  the engine's own counters (its last load polls): hit rate {rate}")
        lines += _findings(by_rank.pop((rank["worker"], rank["dp_rank"]), []))
    for (worker, _), rest in by_rank.items():  # pairs, and ranks no longer judged
        for finding in rest:
            decode = finding.get("decode")
            where = f"prefill {worker}" + (f" -> decode {decode}" if decode else "")
            lines.append(f"{where}:")
            lines += _findings([finding])
    count = len(data["findings"])
    lines.append(
        f"{count} finding{'s' if count != 1 else ''}."
        if count
        else "No finding: routing predicts what the engines find."
    )
    return "\n".join(lines) + "\n"


def _findings(findings: list[dict[str, Any]]) -> list[str]:
    lines = []
    for finding in findings:
        lines.append(f"  FINDING {finding['cause']}: {finding['evidence']}")
        lines.append(f"    remedy: {finding['remedy']}")
    return lines
