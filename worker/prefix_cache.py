"""One rank's KV pages: free, referenced by requests, or cached under a block key (prefix cache).

Like vLLM's block pool and SGLang's radix cache, at page granularity:

* a request ``acquire``s its prompt: the longest run of its leading full pages already cached is
  shared (reference-counted), new pages come from the free list for the rest. At most
  ``(tokens - 1) // page_size`` pages are reused, so at least one token is computed (the engines
  need the last position's logits), and the cached token count is a multiple of the page size;
* as the forward pass computes pages, ``commit`` caches the full ones under their keys (a key
  already cached by another page stays private to its request: no duplicates);
* ``release`` drops references; an unreferenced cached page stays valid and reusable, and joins
  the LRU list (a request's pages are released tail first, so a prompt's tail is evicted before
  its head, as vLLM does);
* ``allocate`` takes free pages first, then evicts the least recently released cached pages; it
  raises ``PoolExhausted`` without evicting anything when even that is not enough.

A referenced page is never evicted, so pages still being read or written by a transfer (held
until the transfer ends, or forever when quarantined) are safe. Pages that receive KV from a
prefill are plain ``allocate``d pages, never cached.

``on_release`` (if set; the rank's waiting line, ``worker.page_queue``) hears that a ``release``
gave pages back, after it did, so a request waiting for pages can try again.

``on_evict`` (if set; the tiered cache's controller, ``worker.hicache.controller``) hears of every
evicted page with its key, synchronously, before the page is handed out again (its KV is still
there to copy), and ``commit`` returns the lease positions it newly cached.

Every change to the cached set is reported to ``events`` (if set) as one list per call:
``BlockStored`` per newly cached run of a request's pages, ``BlockRemoved`` for evictions and
``AllBlocksCleared`` for ``clear``. Not thread-safe: one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from transfer.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from worker.block_hash import BlockKey

__all__ = ["EventSink", "EvictSink", "Lease", "PoolExhausted", "PrefixCache"]

EventSink = Callable[[list[KVEvent]], None]
EvictSink = Callable[[list[tuple[int, BlockKey]]], None]
"""Called with ``(page, key)`` of each page evicted by one allocation, before any is reused."""


class PoolExhausted(Exception):
    """Not enough free or evictable KV pages for a request."""


@dataclass(slots=True)
class Lease:
    """A request's page table: the shared cached prefix, then pages of its own."""

    pages: list[int]
    tokens: Sequence[int]
    keys: list[BlockKey]  # one per full page of ``tokens``
    cached_tokens: int  # prompt tokens served from the cache
    committed: int = 0  # leading full pages already cached (by us or before us)


class PrefixCache:
    """The page allocator and prefix cache of one KV pool of ``num_pages`` pages."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.events: EventSink | None = None
        self.on_evict: EvictSink | None = None
        self.on_release: Callable[[], None] | None = None
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() takes page 0 first
        self._refs: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self._index: dict[bytes, int] = {}  # key digest -> page
        self._key_of: dict[int, BlockKey] = {}

    @property
    def free_pages(self) -> int:
        """Pages an allocation may take: free ones plus unreferenced cached ones."""
        return len(self._free) + len(self._lru)

    @property
    def used_pages(self) -> int:
        """Pages referenced by requests (including withheld ones), as engines count usage."""
        return self.num_pages - self.free_pages

    @property
    def cached_pages(self) -> int:
        """Pages holding a cached block, referenced or not."""
        return len(self._index)

    def match(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are cached now (no side effects)."""
        count = 0
        for key in keys:
            if key.digest not in self._index:
                break
            count += 1
        return count

    def acquire(self, tokens: Sequence[int], keys: Sequence[BlockKey]) -> Lease:
        """Pages for a prompt to be computed: its cached prefix shared, the rest allocated.

        Raises ``PoolExhausted`` (nothing taken) when the rest does not fit.
        """
        size = self.page_size
        reusable = self.match(keys[: max(len(tokens) - 1, 0) // size])
        shared = [self._index[key.digest] for key in keys[:reusable]]
        for page in shared:
            self._ref(page)
        try:
            own = self.allocate(-(-len(tokens) // size) - reusable)
        except PoolExhausted:
            self.release(shared)
            raise
        return Lease(shared + own, tokens, list(keys), reusable * size, committed=reusable)

    def commit(self, lease: Lease, computed_tokens: int) -> list[int]:
        """Cache ``lease``'s full pages within the first ``computed_tokens`` (KV written);
        returns the positions (page indices in the lease) newly cached."""
        full = min(computed_tokens // self.page_size, len(lease.keys))
        stored: list[int] = []
        for index in range(lease.committed, full):
            key, page = lease.keys[index], lease.pages[index]
            if key.digest not in self._index and page not in self._key_of:
                self._index[key.digest] = page
                self._key_of[page] = key
                stored.append(index)
        lease.committed = max(lease.committed, full)
        self._emit(self._stored_events(lease, stored))
        return stored

    def allocate(self, count: int) -> list[int]:
        """``count`` private pages, evicting LRU cached pages when the free list is short."""
        if count > self.free_pages:
            raise PoolExhausted(f"{count} KV pages needed, {self.free_pages} free")
        evicted: list[tuple[int, BlockKey]] = []
        while len(self._free) < count:
            page, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(page)
            del self._index[key.digest]
            evicted.append((page, key))
            self._free.append(page)
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
        if evicted:
            self._emit([BlockRemoved(block_hashes=[key.event_id for _, key in evicted])])
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page, tail first; unreferenced cached pages stay cached."""
        for page in reversed(pages):
            left = self._refs[page] - 1
            if left:
                self._refs[page] = left
                continue
            del self._refs[page]
            if page in self._key_of:
                self._lru[page] = None
            else:
                self._free.append(page)
        if self.on_release is not None:
            self.on_release()

    def clear(self) -> None:
        """Forget every cached block (referenced pages become private until released)."""
        for page in self._lru:
            self._free.append(page)
        self._lru.clear()
        self._index.clear()
        self._key_of.clear()
        self._emit([AllBlocksCleared()])

    def _ref(self, page: int) -> None:
        self._lru.pop(page, None)
        self._refs[page] = self._refs.get(page, 0) + 1

    def _stored_events(self, lease: Lease, stored: list[int]) -> list[KVEvent]:
        """One ``BlockStored`` per run of consecutive newly cached pages."""
        size = self.page_size
        events: list[KVEvent] = []
        runs: list[list[int]] = []
        for index in stored:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            events.append(
                BlockStored(
                    block_hashes=[lease.keys[i].event_id for i in run],
                    parent_block_hash=lease.keys[first - 1].event_id if first else None,
                    token_ids=list(lease.tokens[first * size : (last + 1) * size]),
                    block_size=size,
                    lora_id=None,
                )
            )
        return events

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self.events is not None:
            self.events(events)
