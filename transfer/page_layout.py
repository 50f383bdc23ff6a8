"""The KV page layout: pure address arithmetic for paged KV pools (pages, runs, engine batches).

A KV pool has one *region* per layer (two with separate K and V), each an array of ``num_pages``
pages of ``page_bytes = page_size_tokens * bytes_per_token_per_layer`` bytes. Regions are listed
in SGLang's ``kv_data_ptrs`` order: K of layers ``0..L-1``, then V of layers ``0..L-1``. They may
sit anywhere; ``KVPageLayout.packed`` puts them back to back in one buffer.

Moving a request's pages is one engine entry ``(src_addr, dst_addr, nbytes)`` per region and per
run of pages that is contiguous on *both* sides, so the entry count (the engine's cost: ~30 us of
CPU per Mooncake TCP entry) shrinks with contiguity. ``batches`` then cuts the entries so that no
more than 1024 are in flight per peer.

No I/O here. Bad arguments raise ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "MAX_ENTRIES_PER_BATCH",
    "Entry",
    "KVPageLayout",
    "ReadyPages",
    "Run",
    "aux_entries",
    "batches",
    "columns",
    "contiguous_runs",
    "pages_for_tokens",
    "ready_pages",
    "total_bytes",
    "transfer_entries",
]

# Mooncake's TCP transport rejects a whole batch beyond ~2048 queued entries per peer and can stay
# wedged; 1024 leaves room for a second batch from another request to the same peer.
MAX_ENTRIES_PER_BATCH = 1024


class Run(NamedTuple):
    """``length`` pages starting at ``src_start`` on the source and ``dst_start`` on the target."""

    src_start: int
    dst_start: int
    length: int


class Entry(NamedTuple):
    """One engine transfer entry: ``length`` bytes from address ``src`` to address ``dst``."""

    src: int
    dst: int
    length: int


class ReadyPages(NamedTuple):
    """A chunk's sending plan: request-relative page positions to send now, and one held back.

    ``held`` is the position of the partial last page that waits for the next chunk, or ``None``.
    """

    send: range
    held: int | None


@dataclass(frozen=True, slots=True)
class KVPageLayout:
    """The geometry and base addresses of one rank's paged KV pool.

    ``base_ptrs`` has ``num_regions`` addresses, in SGLang's ``kv_data_ptrs`` order.
    """

    num_layers: int
    page_size_tokens: int
    bytes_per_token_per_layer: int
    num_pages: int
    k_and_v: bool
    base_ptrs: tuple[int, ...]

    def __post_init__(self) -> None:
        for name in ("num_layers", "page_size_tokens", "bytes_per_token_per_layer", "num_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if len(self.base_ptrs) != self.num_regions:
            raise ValueError(
                f"{len(self.base_ptrs)} base pointers for {self.num_regions} regions "
                f"({self.num_layers} layers{', K and V' if self.k_and_v else ''})"
            )
        if any(ptr < 0 for ptr in self.base_ptrs):
            raise ValueError("base pointers must be >= 0")

    @classmethod
    def packed(
        cls,
        base_ptr: int,
        *,
        num_layers: int,
        page_size_tokens: int,
        bytes_per_token_per_layer: int,
        num_pages: int,
        k_and_v: bool = True,
    ) -> KVPageLayout:
        """All regions back to back in one buffer of ``total_bytes`` starting at ``base_ptr``."""
        region_bytes = page_size_tokens * bytes_per_token_per_layer * num_pages
        regions = num_layers * (2 if k_and_v else 1)
        return cls(
            num_layers=num_layers,
            page_size_tokens=page_size_tokens,
            bytes_per_token_per_layer=bytes_per_token_per_layer,
            num_pages=num_pages,
            k_and_v=k_and_v,
            base_ptrs=tuple(base_ptr + i * region_bytes for i in range(regions)),
        )

    def peer(self, base_ptrs: Sequence[int], *, page_bytes: int, num_pages: int) -> KVPageLayout:
        """A peer's pool with this geometry (as its registration describes it).

        Raises ``ValueError`` when the peer's page size in bytes or region count differs from ours.
        """
        if page_bytes != self.page_bytes:
            raise ValueError(f"peer pages are {page_bytes} bytes, ours are {self.page_bytes}")
        return KVPageLayout(
            num_layers=self.num_layers,
            page_size_tokens=self.page_size_tokens,
            bytes_per_token_per_layer=self.bytes_per_token_per_layer,
            num_pages=num_pages,
            k_and_v=self.k_and_v,
            base_ptrs=tuple(base_ptrs),
        )

    @property
    def num_regions(self) -> int:
        return self.num_layers * (2 if self.k_and_v else 1)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one region (SGLang's ``kv_item_len``)."""
        return self.page_size_tokens * self.bytes_per_token_per_layer

    @property
    def region_bytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def total_bytes(self) -> int:
        """Bytes of all regions (the buffer size of a ``packed`` layout)."""
        return self.region_bytes * self.num_regions

    def region(self, layer: int, *, value: bool = False) -> int:
        """Index into ``base_ptrs`` of ``layer``'s K region (or V region with ``value``)."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} outside [0, {self.num_layers})")
        if value and not self.k_and_v:
            raise ValueError("this layout has no separate V regions")
        return layer + (self.num_layers if value else 0)

    def address(self, layer: int, page: int, *, value: bool = False) -> int:
        """Address of ``page`` in ``layer``'s K region (or V region with ``value``)."""
        self.check_pages((page,))
        return self.base_ptrs[self.region(layer, value=value)] + page * self.page_bytes

    def offset(self, layer: int, page: int, *, value: bool = False) -> int:
        """``address`` relative to the first region's base: the offset into a packed buffer."""
        return self.address(layer, page, value=value) - self.base_ptrs[0]

    def page_addresses(self, page: int) -> tuple[int, ...]:
        """Address of ``page`` in every region, in region order."""
        self.check_pages((page,))
        return tuple(base + page * self.page_bytes for base in self.base_ptrs)

    def check_pages(self, pages: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first page outside ``[0, num_pages)``."""
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            bad = next(p for p in pages if not 0 <= p < self.num_pages)
            raise ValueError(f"page {bad} outside [0, {self.num_pages})")


def contiguous_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[Run]:
    """Pair ``src_pages[i]`` with ``dst_pages[i]`` and merge runs contiguous on both sides.

    A run continues while both the source and the destination page go up by exactly one (as
    SGLang's ``group_concurrent_contiguous``); order is kept.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[Run] = []
    for src, dst in zip(src_pages, dst_pages, strict=True):
        if runs:
            last = runs[-1]
            if src == last.src_start + last.length and dst == last.dst_start + last.length:
                runs[-1] = Run(last.src_start, last.dst_start, last.length + 1)
                continue
        runs.append(Run(src, dst, 1))
    return runs


def transfer_entries(
    src: KVPageLayout, dst: KVPageLayout, src_pages: Sequence[int], dst_pages: Sequence[int]
) -> list[Entry]:
    """Engine entries copying ``src_pages`` of every region of ``src`` to ``dst_pages`` of ``dst``.

    One entry per region and per run contiguous on both sides, region by region (all K, then all
    V); neighbouring entries that happen to be contiguous on both sides across a region boundary
    are merged too. Raises ``ValueError`` if the geometries differ or a page is out of range.
    """
    if (src.page_bytes, src.num_regions) != (dst.page_bytes, dst.num_regions):
        raise ValueError(
            f"layouts differ: {src.num_regions} regions of {src.page_bytes}-byte pages vs "
            f"{dst.num_regions} of {dst.page_bytes}-byte pages"
        )
    src.check_pages(src_pages)
    dst.check_pages(dst_pages)
    runs = contiguous_runs(src_pages, dst_pages)
    size = src.page_bytes
    entries: list[Entry] = []
    for src_base, dst_base in zip(src.base_ptrs, dst.base_ptrs, strict=True):
        for run in runs:
            entry = Entry(
                src_base + run.src_start * size, dst_base + run.dst_start * size, run.length * size
            )
            _append_coalesced(entries, entry)
    return entries


def _append_coalesced(entries: list[Entry], entry: Entry) -> None:
    if entries:
        last = entries[-1]
        if entry.src == last.src + last.length and entry.dst == last.dst + last.length:
            entries[-1] = Entry(last.src, last.dst, last.length + entry.length)
            return
    entries.append(entry)


def aux_entries(
    src_ptrs: Sequence[int],
    dst_ptrs: Sequence[int],
    item_lens: Sequence[int],
    src_index: int,
    dst_index: int,
) -> list[Entry]:
    """Entries that copy aux slot ``src_index`` of every aux buffer onto slot ``dst_index``."""
    if not len(src_ptrs) == len(dst_ptrs) == len(item_lens):
        raise ValueError(
            f"{len(src_ptrs)} source, {len(dst_ptrs)} destination aux buffers, "
            f"{len(item_lens)} item lengths"
        )
    if src_index < 0 or dst_index < 0:
        raise ValueError("aux indices must be >= 0")
    return [
        Entry(s + src_index * n, d + dst_index * n, n)
        for s, d, n in zip(src_ptrs, dst_ptrs, item_lens, strict=True)
    ]


def batches(
    entries: Sequence[Entry], max_per_batch: int = MAX_ENTRIES_PER_BATCH
) -> list[Sequence[Entry]]:
    """``entries`` cut in order into batches of at most ``max_per_batch`` (none empty)."""
    if max_per_batch < 1:
        raise ValueError(f"max_per_batch must be >= 1, got {max_per_batch}")
    return [entries[i : i + max_per_batch] for i in range(0, len(entries), max_per_batch)]


def columns(batch: Sequence[Entry]) -> tuple[list[int], list[int], list[int]]:
    """``batch`` as the (sources, destinations, lengths) lists the engine's batch calls take."""
    return [e.src for e in batch], [e.dst for e in batch], [e.length for e in batch]


def total_bytes(entries: Sequence[Entry]) -> int:
    return sum(e.length for e in entries)


def pages_for_tokens(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens (the last one possibly partial)."""
    if tokens < 0 or page_size < 1:
        raise ValueError(f"tokens={tokens}, page_size={page_size}")
    return -(-tokens // page_size)


def ready_pages(
    prompt_tokens_so_far: int, page_size: int, already_sent_pages: int, is_last_chunk: bool
) -> ReadyPages:
    """Which of a request's pages to send after a prefill chunk (chunked prefill).

    ``prompt_tokens_so_far`` counts the tokens whose KV exists after this chunk. Full pages not
    yet sent go now; a partial last page is held until the next chunk fills it, except after the
    last chunk, when it goes too. Positions are request-relative: index the request's page table
    with them. Raises ``ValueError`` if more pages were sent than the tokens fill.
    """
    if already_sent_pages < 0:
        raise ValueError(f"already_sent_pages={already_sent_pages}")
    used = pages_for_tokens(prompt_tokens_so_far, page_size)
    full = prompt_tokens_so_far // page_size
    ready = used if is_last_chunk else full
    if already_sent_pages > ready:
        raise ValueError(
            f"{already_sent_pages} pages already sent, but only {ready} of {page_size} tokens "
            f"are ready after {prompt_tokens_so_far} tokens"
        )
    held = full if used > full and not is_last_chunk else None
    return ReadyPages(range(already_sent_pages, ready), held)
