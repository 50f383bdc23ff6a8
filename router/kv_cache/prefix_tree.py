"""An approximate prefix-cache map from request text alone: which location has seen which prefix.

The ``cache_aware`` policy's fallback when engines publish no KV events (the sglang-router / SMG
approach, docs/concepts/protocols.md section 11.2): every request text routed to a location is
inserted into one
radix tree over characters, and ``match`` answers, per location, the longest prefix of a new text
that location has seen. An engine's real cache is only approximated (it evicts on its own), so
each location's share of the tree is capped at ``max_chars_per_location`` characters, evicting its
least-recently-used leaves first.

Tree shape: edges carry string labels, split where texts diverge. Every node records the
locations that have seen it, each with a last access time. A location present at a node is present
at all of its ancestors (inserts mark the whole path, evictions take leaves first), so a match is
the depth of the deepest node on the text's path that holds the location. Label comparison uses
``str.startswith`` and slice comparisons, so insert and match cost O(len(text)) in C, plus one
Python step per node on the path. Pure data structure: no I/O, injectable clock.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Collection, Iterator

__all__ = ["ApproxPrefixTree", "Location"]

Location = tuple[str, int]
"""(worker id, DP rank)."""

_LOW_WATER = 0.9  # eviction frees down to this share of the cap, so its tree walk amortises


class _Node:
    """One edge of the tree (``label``) and the node it leads to."""

    __slots__ = ("children", "label", "parent", "seen")

    def __init__(self, label: str, parent: _Node | None) -> None:
        self.label = label
        self.parent = parent
        self.children: dict[str, _Node] = {}
        self.seen: dict[Location, float] = {}


def _common_prefix_len(label: str, text: str, start: int) -> int:
    """How many leading chars of ``label`` equal ``text[start:]``: binary search over slice
    comparisons (C speed) instead of a Python loop per char."""
    low, high = 0, min(len(label), len(text) - start)
    while low < high:
        mid = (low + high + 1) // 2
        if text.startswith(label[:mid], start):
            low = mid
        else:
            high = mid - 1
    return low


def _is_leaf_of(node: _Node, location: Location) -> bool:
    """``location`` holds ``node`` and none of its children: it may be evicted there next."""
    return location in node.seen and not any(location in c.seen for c in node.children.values())


class ApproxPrefixTree:
    """Per-location approximate prefix caches over request text, in one shared radix tree.

    Not thread-safe: one event loop owns it.
    """

    def __init__(
        self, max_chars_per_location: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_chars_per_location <= 0:
            raise ValueError(f"max_chars_per_location must be positive: {max_chars_per_location}")
        self._cap = max_chars_per_location
        self._clock = clock
        self._root = _Node("", None)
        self._sizes: dict[Location, int] = {}
        self._total = 0

    def insert(self, text: str, location: Location) -> None:
        """``text`` was routed to ``location``: mark its whole path as seen there, now; then evict
        the location's least-recently-used leaves if it went past the cap."""
        if not text:
            return
        now = self._clock()
        node, pos, end = self._root, 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                child = self._add_leaf(node, text[pos:])
                matched = end - pos
            else:
                label = child.label
                if text.startswith(label, pos):
                    matched = len(label)
                else:
                    matched = _common_prefix_len(label, text, pos)
                    child = self._split(child, matched)
            self._mark(child, location, now)
            pos += matched
            node = child
        if self._sizes.get(location, 0) > self._cap:
            self._evict(location, int(self._cap * _LOW_WATER))

    def match(
        self, text: str, locations: Collection[Location] | None = None
    ) -> dict[Location, int]:
        """Per location (only those in ``locations`` when given), how many leading chars of
        ``text`` it has seen; locations at 0 are omitted. Does not count as an access."""
        found: dict[Location, int] = {}
        node, pos, end = self._root, 0, len(text)
        while pos < end:
            child = node.children.get(text[pos])
            if child is None:
                break
            label = child.label
            if text.startswith(label, pos):
                matched = len(label)
            else:
                matched = _common_prefix_len(label, text, pos)
            for location in child.seen:
                found[location] = pos + matched
            if matched < len(label):
                break
            pos += matched
            node = child
        if locations is None:
            return found
        return {loc: n for loc, n in found.items() if loc in locations}

    def remove(self, location: Location) -> None:
        """Forget everything ``location`` has seen (worker removed, restarted or drained)."""
        if self._sizes.pop(location, None) is None:
            return
        for node in reversed(list(self._nodes_of(location))):  # children before parents
            if node.parent is None:
                continue  # merged into its parent, which is handled later
            del node.seen[location]
            if not node.seen:
                self._detach(node)

    def remove_worker(self, worker_id: str) -> None:
        """``remove`` every rank of ``worker_id``."""
        for location in [loc for loc in self._sizes if loc[0] == worker_id]:
            self.remove(location)

    def size(self, location: Location) -> int:
        """Chars held for ``location`` (the sum of the labels of the nodes it has seen)."""
        return self._sizes.get(location, 0)

    def total_chars(self) -> int:
        """Chars held by the whole tree (each label once, however many locations share it)."""
        return self._total

    # -- internals -----------------------------------------------------------------------------

    def _add_leaf(self, parent: _Node, label: str) -> _Node:
        leaf = _Node(label, parent)
        parent.children[label[0]] = leaf
        self._total += len(label)
        return leaf

    def _split(self, child: _Node, at: int) -> _Node:
        """Cut ``child``'s edge after ``at`` chars; return the new upper node (same locations)."""
        parent = child.parent
        assert parent is not None  # the root is never split
        upper = _Node(child.label[:at], parent)
        upper.seen = dict(child.seen)
        child.label = child.label[at:]
        child.parent = upper
        upper.children[child.label[0]] = child
        parent.children[upper.label[0]] = upper
        return upper

    def _mark(self, node: _Node, location: Location, now: float) -> None:
        if location not in node.seen:
            self._sizes[location] = self._sizes.get(location, 0) + len(node.label)
        node.seen[location] = now

    def _nodes_of(self, location: Location) -> Iterator[_Node]:
        """Every node holding ``location``, parents before children (only its subtree is
        walked, since a location at a node is at all its ancestors)."""
        stack = [c for c in self._root.children.values() if location in c.seen]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(c for c in node.children.values() if location in c.seen)

    def _evict(self, location: Location, target: int) -> None:
        """Drop ``location`` from its least-recently-used leaves until it holds ``target`` chars
        or fewer. One walk of the location's nodes, then a heap of its leaves."""
        order = itertools.count()
        heap = [
            (node.seen[location], next(order), node)
            for node in self._nodes_of(location)
            if _is_leaf_of(node, location)
        ]
        heapq.heapify(heap)
        while heap and self._sizes.get(location, 0) > target:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or location not in node.seen:
                continue  # detached or merged away since it was pushed
            parent = self._drop(node, location)
            if parent is not None and parent is not self._root and _is_leaf_of(parent, location):
                heapq.heappush(heap, (parent.seen[location], next(order), parent))
        if self._sizes.get(location) == 0:
            del self._sizes[location]

    def _drop(self, node: _Node, location: Location) -> _Node | None:
        """Remove ``location`` from a leaf of it; prune and merge; return the surviving parent."""
        del node.seen[location]
        self._sizes[location] -= len(node.label)
        if node.seen:
            return node.parent
        return self._detach(node)

    def _detach(self, node: _Node) -> _Node | None:
        """Unlink a node no location holds (its children hold none either), then merge its
        parent with a lone remaining child when both are held by the same locations."""
        parent = node.parent
        assert parent is not None
        del parent.children[node.label[0]]
        node.parent = None
        self._total -= len(node.label)
        if parent is not self._root and len(parent.children) == 1:
            (only,) = parent.children.values()
            if only.seen.keys() == parent.seen.keys():
                self._merge(parent, only)
        return parent

    def _merge(self, upper: _Node, lower: _Node) -> None:
        """Fold ``lower`` (the only child) into ``upper``: one edge, the later access times."""
        upper.label += lower.label
        upper.children = lower.children
        for grandchild in upper.children.values():
            grandchild.parent = upper
        upper.seen = {loc: max(t, lower.seen[loc]) for loc, t in upper.seen.items()}
        lower.parent = None
