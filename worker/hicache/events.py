"""KV events of the lower cache tiers: ``BlockStored`` / ``BlockRemoved`` with their ``medium``.

SGLang's names (docs/concepts/protocols.md 7.2): ``GPU`` (L1, the device pool:
``worker.prefix_cache`` emits
those), ``CPU_PINNED`` (L2, host memory) and ``DISK`` (L3, storage). A tier's ``BlockStored``
carries the same ``token_ids`` and parent chaining as the GPU one: consecutive pages of one
prompt (each the parent of the next) share one event, whose parent is the first page's parent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from transfer.events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent
from worker.hicache.stores.base import StoredPageHeader

__all__ = ["CPU_PINNED", "DISK", "GPU", "MEDIA", "removed_events", "stored_events"]

GPU: Final = MEDIUM_GPU
CPU_PINNED: Final = "CPU_PINNED"
DISK: Final = "DISK"
MEDIA: Final = (GPU, CPU_PINNED, DISK)


def stored_events(
    headers: Sequence[StoredPageHeader], medium: str, page_size: int
) -> list[KVEvent]:
    """One ``BlockStored`` per run of chained pages in ``headers`` (in their order)."""
    runs: list[list[StoredPageHeader]] = []
    for header in headers:
        if runs and header.parent_digest == runs[-1][-1].digest:
            runs[-1].append(header)
        else:
            runs.append([header])
    return [
        BlockStored(
            block_hashes=[h.event_id for h in run],
            parent_block_hash=run[0].parent_event_id,
            token_ids=[t for h in run for t in h.token_ids],
            block_size=page_size,
            lora_id=None,
            medium=medium,
        )
        for run in runs
    ]


def removed_events(headers: Sequence[StoredPageHeader], medium: str) -> list[KVEvent]:
    """One ``BlockRemoved`` for ``headers`` (none when empty)."""
    if not headers:
        return []
    return [BlockRemoved(block_hashes=[h.event_id for h in headers], medium=medium)]
