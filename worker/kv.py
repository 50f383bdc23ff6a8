"""The simulated model: a byte tokenizer, a paged KV pool, KV as a pure function, toy decoding.

KV content of token ``t`` at position ``p`` in layer ``l`` (K: ``kv=0``, V: ``kv=1``) is an
8-byte seed of ``(t, p, l, kv)`` repeated over ``bytes_per_token_per_layer`` bytes, so a decode
can check every received page, and the tokens it generates hash the received bytes: a corrupted
or misplaced page changes the output.
"""

from __future__ import annotations

import ctypes
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from transfer.page_layout import KVPageLayout, pages_for_tokens
from worker.prefix_cache import PoolExhausted, PrefixCache

__all__ = ["KVPool", "PoolExhausted", "PoolShape", "detokenize", "generate", "tokenize"]

_MASK = (1 << 64) - 1
_ALPHABET = "abcdefghijklmnopqrstuvwxyz "


def tokenize(text: str) -> list[int]:
    """The toy tokenizer: one token per UTF-8 byte."""
    return list(text.encode("utf-8"))


def detokenize(tokens: Sequence[int]) -> str:
    return "".join(_ALPHABET[t % len(_ALPHABET)] for t in tokens)


def _seed(token: int, pos: int, layer: int, kv: int) -> bytes:
    mixed = (token * 1_000_003 + pos * 7919 + layer * 131 + kv + 1) * 0x9E3779B97F4A7C15
    return struct.pack("<Q", (mixed ^ (mixed >> 29)) & _MASK)


def generate(kv_digest: bytes, count: int) -> list[int]:
    """``count`` output tokens, a pure function of the KV digest."""
    out: list[int] = []
    state = kv_digest
    for _ in range(count):
        state = hashlib.blake2b(state, digest_size=16).digest()
        out.append(state[0])
    return out


@dataclass(frozen=True, slots=True)
class PoolShape:
    layers: int = 8
    page_size: int = 16
    bytes_per_token: int = 4096  # per layer, K and V together
    pages: int = 1024

    def __post_init__(self) -> None:
        if self.bytes_per_token % 16:
            raise ValueError("bytes_per_token must be a multiple of 16 (8 for K, 8 for V)")


class KVPool:
    """A packed, pinned KV pool (K and V per layer); ``cache`` allocates its pages.

    ``allocate``/``release`` are the cache's plain (uncached) page calls; ``free_pages``
    counts free pages plus cached pages no request references (an allocation may evict them).
    """

    def __init__(self, shape: PoolShape) -> None:
        self.shape = shape
        self._per_layer = shape.bytes_per_token // 2
        probe = self._layout(0)
        self.data = bytearray(probe.total_bytes)
        self._pin = (ctypes.c_char * len(self.data)).from_buffer(self.data)
        self._view = memoryview(self.data)
        self.layout = self._layout(ctypes.addressof(self._pin))
        self.cache = PrefixCache(shape.pages, shape.page_size)
        self.quarantined = 0  # pages withheld after a transfer whose writes may still land

    def _layout(self, base: int) -> KVPageLayout:
        return KVPageLayout.packed(
            base,
            num_layers=self.shape.layers,
            page_size_tokens=self.shape.page_size,
            bytes_per_token_per_layer=self._per_layer,
            num_pages=self.shape.pages,
        )

    @property
    def free_pages(self) -> int:
        return self.cache.free_pages

    @property
    def max_tokens(self) -> int:
        return self.shape.pages * self.shape.page_size

    def allocate(self, num_tokens: int) -> list[int]:
        """Private pages for ``num_tokens`` tokens; raises ``PoolExhausted``."""
        return self.cache.allocate(pages_for_tokens(num_tokens, self.shape.page_size))

    def release(self, pages: Sequence[int]) -> None:
        self.cache.release(pages)

    def quarantine(self, pages: Sequence[int]) -> None:
        """Withhold ``pages`` for good (a transfer may still write them): never released."""
        self.quarantined += len(pages)

    @property
    def page_bytes(self) -> int:
        """Bytes of one whole page: its slice of every region (K and V of every layer)."""
        return self.layout.page_bytes * self.layout.num_regions

    def copy_page_out(self, page: int, dest: memoryview) -> None:
        """``page``'s KV into ``dest`` (``page_bytes`` long), regions in pool order: the layout of
        ``worker.hicache.stores.base.StoredPage.data``."""
        size = self.layout.page_bytes
        for region in range(self.layout.num_regions):
            start = self._offset(region, page, 0)
            dest[region * size : (region + 1) * size] = self._view[start : start + size]

    def copy_layer_in(self, page: int, layer: int, src: memoryview) -> None:
        """Layer ``layer``'s K and V slices of a stored page (``src``, as ``copy_page_out``
        writes it) into ``page``."""
        size = self.layout.page_bytes
        for region in (layer, layer + self.shape.layers):
            start = self._offset(region, page, 0)
            self._view[start : start + size] = src[region * size : (region + 1) * size]

    def _offset(self, region: int, page: int, slot: int) -> int:
        layout = self.layout
        return region * layout.region_bytes + page * layout.page_bytes + slot * self._per_layer

    def _token_slots(
        self, pages: Sequence[int], start: int, end: int
    ) -> list[tuple[int, int, int]]:
        size = self.shape.page_size
        return [(pos, pages[pos // size], pos % size) for pos in range(start, end)]

    def write(
        self, pages: Sequence[int], tokens: Sequence[int], start: int = 0, end: int | None = None
    ) -> None:
        """The forward pass over positions [start, end): each token's KV into its page slot."""
        reps = self._per_layer // 8
        stop = len(tokens) if end is None else end
        for pos, page, slot in self._token_slots(pages, start, stop):
            for region in range(self.layout.num_regions):
                layer, kv = region % self.shape.layers, region // self.shape.layers
                offset = self._offset(region, page, slot)
                self.data[offset : offset + self._per_layer] = (
                    _seed(tokens[pos], pos, layer, kv) * reps
                )

    def read_digest(self, pages: Sequence[int], tokens: Sequence[int]) -> tuple[bytes, int]:
        """The digest of the prompt's KV in ``pages`` and the first bad position (-1: all good)."""
        digest = hashlib.blake2b(digest_size=32)
        reps = self._per_layer // 8
        bad = -1
        view = memoryview(self.data)
        for pos, page, slot in self._token_slots(pages, 0, len(tokens)):
            for region in range(self.layout.num_regions):
                layer, kv = region % self.shape.layers, region // self.shape.layers
                start = self._offset(region, page, slot)
                got = view[start : start + self._per_layer]
                digest.update(got)
                if bad < 0 and got != _seed(tokens[pos], pos, layer, kv) * reps:
                    bad = pos
        return digest.digest(), bad
