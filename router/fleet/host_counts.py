"""A worker's counts as this host sees them (what a replica publishes to its peers), and the
sum of the peers' counts."""

from __future__ import annotations

from router.load_board import LEGS, TOKENS
from router.workers import Worker

__all__ = ["add_counts", "host_counts"]


def host_counts(worker: Worker) -> tuple[list[int], list[int]]:
    """A worker's legs and pending tokens per rank on this host (every process's with ``router
    --workers N``: the load board's), the peers' left out."""
    legs = _on_host(worker, LEGS, worker.rank_inflight)
    return legs, _on_host(worker, TOKENS, worker.rank_pending_tokens)


def _on_host(worker: Worker, board_field: int, own: list[int]) -> list[int]:
    board = worker.host_load
    if board is None:
        return list(own)
    counts = []
    for rank, mine in enumerate(own):
        host = board.count(rank, board_field)
        counts.append(mine if host is None else host)  # (a rank not on the board: ours alone)
    return counts


def add_counts(into: list[int], values: list[int]) -> None:
    if len(values) > len(into):
        into.extend([0] * (len(values) - len(into)))
    for index, value in enumerate(values):
        into[index] += value
