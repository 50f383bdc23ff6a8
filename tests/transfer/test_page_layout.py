"""transfer/page_layout.py: page addresses, runs contiguous on both sides, entries, batches,
chunks."""

from __future__ import annotations

import random

import pytest

from transfer.page_layout import (
    MAX_ENTRIES_PER_BATCH,
    Entry,
    KVPageLayout,
    ReadyPages,
    Run,
    aux_entries,
    batches,
    columns,
    contiguous_runs,
    pages_for_tokens,
    ready_pages,
    total_bytes,
    transfer_entries,
)

PAGE = 4 * 8  # 4 tokens of 8 bytes per layer


def packed(base: int = 0, *, layers: int = 2, pages: int = 8, k_and_v: bool = True) -> KVPageLayout:
    return KVPageLayout.packed(
        base,
        num_layers=layers,
        page_size_tokens=4,
        bytes_per_token_per_layer=8,
        num_pages=pages,
        k_and_v=k_and_v,
    )


# --- geometry and addresses ---------------------------------------------------------------------


def test_packed_geometry() -> None:
    layout = packed(1000)
    assert layout.page_bytes == PAGE
    assert layout.region_bytes == 8 * PAGE
    assert layout.num_regions == 4
    assert layout.total_bytes == 4 * 8 * PAGE
    assert layout.base_ptrs == (1000, 1000 + 256, 1000 + 512, 1000 + 768)


def test_realistic_geometry() -> None:
    layout = KVPageLayout.packed(
        0, num_layers=32, page_size_tokens=16, bytes_per_token_per_layer=1024, num_pages=4096
    )
    assert layout.page_bytes == 16 * 1024
    assert layout.total_bytes == 64 * 4096 * 16 * 1024  # 4 GiB


@pytest.mark.parametrize(
    ("layer", "page", "value", "offset"),
    [
        (0, 0, False, 0),
        (0, 1, False, PAGE),
        (0, 7, False, 7 * PAGE),
        (1, 0, False, 8 * PAGE),  # layer 1's K region follows layer 0's
        (1, 3, False, 11 * PAGE),
        (0, 0, True, 16 * PAGE),  # V regions come after every K region
        (1, 2, True, 26 * PAGE),
    ],
)
def test_offsets(layer: int, page: int, value: bool, offset: int) -> None:
    layout = packed(5000)
    assert layout.offset(layer, page, value=value) == offset
    assert layout.address(layer, page, value=value) == 5000 + offset


def test_scattered_regions() -> None:
    layout = KVPageLayout(
        num_layers=2,
        page_size_tokens=4,
        bytes_per_token_per_layer=8,
        num_pages=8,
        k_and_v=True,
        base_ptrs=(10_000, 50_000, 20_000, 90_000),
    )
    assert layout.address(1, 2) == 50_000 + 2 * PAGE
    assert layout.address(1, 2, value=True) == 90_000 + 2 * PAGE
    assert layout.page_addresses(3) == tuple(b + 3 * PAGE for b in layout.base_ptrs)


def test_k_only_layout() -> None:
    layout = packed(layers=3, k_and_v=False)
    assert layout.num_regions == 3
    assert layout.offset(2, 1) == (2 * 8 + 1) * PAGE
    with pytest.raises(ValueError, match="no separate V"):
        layout.address(0, 0, value=True)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"base_ptrs": (0, 1, 2)}, "3 base pointers for 4 regions"),
        ({"num_pages": 0}, "num_pages must be >= 1"),
        ({"num_layers": 0, "base_ptrs": ()}, "num_layers must be >= 1"),
        ({"base_ptrs": (0, 1, 2, -1)}, "must be >= 0"),
    ],
)
def test_invalid_layouts(kwargs: dict[str, object], expected: str) -> None:
    fields: dict[str, object] = {
        "num_layers": 2,
        "page_size_tokens": 4,
        "bytes_per_token_per_layer": 8,
        "num_pages": 8,
        "k_and_v": True,
        "base_ptrs": (0, 1, 2, 3),
    }
    with pytest.raises(ValueError, match=expected):
        KVPageLayout(**{**fields, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize(("layer", "page"), [(-1, 0), (2, 0), (0, -1), (0, 8)])
def test_out_of_range_addresses(layer: int, page: int) -> None:
    with pytest.raises(ValueError, match="outside"):
        packed().address(layer, page)


def test_peer_layout() -> None:
    local = packed()
    remote = local.peer((1, 2, 3, 4), page_bytes=PAGE, num_pages=100)
    assert remote.base_ptrs == (1, 2, 3, 4)
    assert remote.num_pages == 100
    with pytest.raises(ValueError, match="peer pages are 64 bytes, ours are 32"):
        local.peer((1, 2, 3, 4), page_bytes=64, num_pages=100)
    with pytest.raises(ValueError, match="2 base pointers for 4 regions"):
        local.peer((1, 2), page_bytes=PAGE, num_pages=100)


# --- contiguous runs --------------------------------------------------------------------------

RUNS: list[tuple[str, list[int], list[int], list[tuple[int, int, int]]]] = [
    ("empty", [], [], []),
    ("one page", [3], [9], [(3, 9, 1)]),
    ("contiguous on both", [0, 1, 2, 3], [10, 11, 12, 13], [(0, 10, 4)]),
    ("src contiguous only", [0, 1, 2, 3], [10, 11, 20, 21], [(0, 10, 2), (2, 20, 2)]),
    ("dst contiguous only", [0, 1, 5, 6], [10, 11, 12, 13], [(0, 10, 2), (5, 12, 2)]),
    ("neither", [4, 2, 9], [1, 7, 3], [(4, 1, 1), (2, 7, 1), (9, 3, 1)]),
    ("descending breaks runs", [3, 2, 1], [3, 2, 1], [(3, 3, 1), (2, 2, 1), (1, 1, 1)]),
    ("duplicates break runs", [5, 5, 6], [1, 2, 3], [(5, 1, 1), (5, 2, 2)]),
    ("mixed", [0, 1, 2, 7, 8, 3], [4, 5, 6, 7, 8, 9], [(0, 4, 3), (7, 7, 2), (3, 9, 1)]),
]


@pytest.mark.parametrize(
    ("src", "dst", "runs"), [(s, d, r) for _, s, d, r in RUNS], ids=[n for n, _, _, _ in RUNS]
)
def test_contiguous_runs(src: list[int], dst: list[int], runs: list[tuple[int, int, int]]) -> None:
    result = contiguous_runs(src, dst)
    assert result == runs
    assert all(isinstance(r, Run) for r in result)
    assert sum(r.length for r in result) == len(src)


def test_runs_need_equal_lengths() -> None:
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        contiguous_runs([1, 2, 3], [1, 2])


# --- transfer entries -------------------------------------------------------------------------


def test_entries_split_k_and_v_per_layer() -> None:
    src = KVPageLayout(
        num_layers=2,
        page_size_tokens=4,
        bytes_per_token_per_layer=8,
        num_pages=8,
        k_and_v=True,
        base_ptrs=(1000, 2000, 3000, 4000),
    )
    dst = src.peer((10_000, 20_000, 30_000, 40_000), page_bytes=PAGE, num_pages=16)
    entries = transfer_entries(src, dst, [1, 2, 5], [7, 8, 0])
    # two runs ([1,2] -> [7,8] and [5] -> [0]) in each of K0, K1, V0, V1
    assert entries == [
        (1000 + PAGE, 10_000 + 7 * PAGE, 2 * PAGE),
        (1000 + 5 * PAGE, 10_000, PAGE),
        (2000 + PAGE, 20_000 + 7 * PAGE, 2 * PAGE),
        (2000 + 5 * PAGE, 20_000, PAGE),
        (3000 + PAGE, 30_000 + 7 * PAGE, 2 * PAGE),
        (3000 + 5 * PAGE, 30_000, PAGE),
        (4000 + PAGE, 40_000 + 7 * PAGE, 2 * PAGE),
        (4000 + 5 * PAGE, 40_000, PAGE),
    ]
    assert all(isinstance(e, Entry) for e in entries)
    assert total_bytes(entries) == 3 * PAGE * 4


def test_k_only_entries() -> None:
    src, dst = packed(0, k_and_v=False), packed(100_000, k_and_v=False)
    entries = transfer_entries(src, dst, [0, 1], [4, 5])
    assert entries == [(0, 100_000 + 4 * PAGE, 2 * PAGE), (8 * PAGE, 100_000 + 12 * PAGE, 2 * PAGE)]


def test_whole_packed_pool_is_one_entry() -> None:
    src, dst = packed(0), packed(1 << 20)
    pages = list(range(8))
    assert transfer_entries(src, dst, pages, pages) == [(0, 1 << 20, src.total_bytes)]


def test_scattered_pages_are_one_entry_per_page_and_region() -> None:
    src, dst = packed(0, pages=64), packed(0, pages=64)
    entries = transfer_entries(src, dst, list(range(0, 64, 2)), list(range(1, 64, 2)))
    assert len(entries) == 32 * 4
    assert {e.length for e in entries} == {PAGE}


def test_entries_move_the_right_bytes() -> None:
    """Apply the entries to real buffers and compare page by page with a naive copy."""
    rng = random.Random(4)
    src = packed(0, layers=3, pages=32)
    dst = packed(0, layers=3, pages=48)
    src_buf = bytes(rng.randrange(256) for _ in range(src.total_bytes))
    for _ in range(20):
        n = rng.randrange(1, 20)
        src_pages = (
            sorted(rng.sample(range(32), n)) if rng.random() < 0.5 else rng.sample(range(32), n)
        )
        start = rng.randrange(0, 48 - n)
        dst_pages = (
            list(range(start, start + n)) if rng.random() < 0.5 else rng.sample(range(48), n)
        )
        got = bytearray(dst.total_bytes)
        for e in transfer_entries(src, dst, src_pages, dst_pages):
            got[e.dst : e.dst + e.length] = src_buf[e.src : e.src + e.length]
        want = bytearray(dst.total_bytes)
        for layer in range(3):
            for value in (False, True):
                for s, d in zip(src_pages, dst_pages, strict=True):
                    a, b = src.offset(layer, s, value=value), dst.offset(layer, d, value=value)
                    want[b : b + PAGE] = src_buf[a : a + PAGE]
        assert got == want


@pytest.mark.parametrize(
    ("dst", "src_pages", "dst_pages", "expected"),
    [
        (packed(layers=3), [0], [0], "layouts differ: 4 regions of 32-byte pages vs 6"),
        (packed(k_and_v=False), [0], [0], "layouts differ"),
        (packed(pages=4), [0, 1], [3, 4], "page 4 outside \\[0, 4\\)"),
        (packed(), [8], [0], "page 8 outside"),
        (packed(), [0], [-1], "page -1 outside"),
        (packed(), [0, 1], [0], "2 source pages but 1 destination pages"),
    ],
)
def test_invalid_entries(
    dst: KVPageLayout, src_pages: list[int], dst_pages: list[int], expected: str
) -> None:
    with pytest.raises(ValueError, match=expected):
        transfer_entries(packed(), dst, src_pages, dst_pages)


def test_aux_entries() -> None:
    entries = aux_entries([100, 200], [1000, 2000], [8, 16], 3, 5)
    assert entries == [(124, 1040, 8), (248, 2080, 16)]
    with pytest.raises(ValueError, match="aux buffers"):
        aux_entries([100], [1000, 2000], [8], 0, 0)
    with pytest.raises(ValueError, match=">= 0"):
        aux_entries([100], [1000], [8], -1, 0)


# --- batches ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "cap", "sizes"),
    [
        (0, 1024, []),
        (1, 1024, [1]),
        (1024, 1024, [1024]),
        (1025, 1024, [1024, 1]),
        (3000, 1024, [1024, 1024, 952]),
        (5, 1, [1, 1, 1, 1, 1]),
        (10, 4, [4, 4, 2]),
    ],
)
def test_batches(count: int, cap: int, sizes: list[int]) -> None:
    entries = [Entry(i, i, 1) for i in range(count)]
    result = batches(entries, cap)
    assert [len(b) for b in result] == sizes
    assert [e for b in result for e in b] == entries


def test_default_batch_cap() -> None:
    assert MAX_ENTRIES_PER_BATCH == 1024
    entries = [Entry(i, i, 1) for i in range(2049)]
    assert [len(b) for b in batches(entries)] == [1024, 1024, 1]


def test_batch_cap_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_per_batch"):
        batches([], 0)


def test_columns() -> None:
    assert columns([Entry(1, 2, 3), Entry(4, 5, 6)]) == ([1, 4], [2, 5], [3, 6])
    assert columns([]) == ([], [], [])


# --- chunked prefill --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "sent", "last", "send", "held"),
    [
        (0, 0, False, range(0), None),
        (15, 0, False, range(0), 0),  # the partial first page waits
        (16, 0, False, range(1), None),
        (40, 0, False, range(2), 2),
        (64, 2, False, range(2, 4), None),
        (40, 2, False, range(2, 2), 2),  # nothing new is full yet
        (40, 2, True, range(2, 3), None),  # the last chunk sends its partial page
        (33, 2, True, range(2, 3), None),
        (1, 0, True, range(1), None),
        (0, 0, True, range(0), None),
        (48, 3, True, range(3, 3), None),
    ],
)
def test_ready_pages(tokens: int, sent: int, last: bool, send: range, held: int | None) -> None:
    assert ready_pages(tokens, 16, sent, last) == ReadyPages(send, held)


@pytest.mark.parametrize(
    ("tokens", "sent", "last", "expected"),
    [
        (40, 3, False, "3 pages already sent"),
        (40, 4, True, "4 pages already sent"),
        (40, -1, False, "already_sent_pages=-1"),
        (-1, 0, False, "tokens=-1"),
    ],
)
def test_ready_pages_refuses(tokens: int, sent: int, last: bool, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        ready_pages(tokens, 16, sent, last)


@pytest.mark.parametrize("chunks", [[4096], [1000, 1000, 1000, 3], [16, 16, 1], [7, 9, 5, 30, 1]])
def test_chunked_prefill_sends_every_page_once(chunks: list[int]) -> None:
    page_size, tokens, sent = 16, 0, 0
    order: list[int] = []
    for i, size in enumerate(chunks):
        tokens += size
        plan = ready_pages(tokens, page_size, sent, is_last_chunk=i == len(chunks) - 1)
        for page in plan.send:  # only full pages, except on the last chunk
            assert (page + 1) * page_size <= tokens or i == len(chunks) - 1
        order.extend(plan.send)
        sent = plan.send.stop
    assert order == list(range(pages_for_tokens(tokens, page_size)))


def test_pages_for_tokens() -> None:
    assert [pages_for_tokens(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]
    with pytest.raises(ValueError):
        pages_for_tokens(1, 0)
