"""router.kv_cache.prefix_tree: the approximate (text-only) prefix cache map of the cache_aware
policy."""

from __future__ import annotations

import os
import random

from router.kv_cache.prefix_tree import ApproxPrefixTree, Location

A: Location = ("a", 0)
B: Location = ("b", 0)


class FakeClock:
    """A clock the test moves by hand (one tick per read keeps LRU order unambiguous)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_location_matches_the_longest_prefix_it_has_seen() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=10_000)
    tree.insert("You are helpful. Tell me a joke", A)
    assert tree.match("You are helpful. Tell me a story") == {A: len("You are helpful. Tell me a ")}
    assert tree.match("You are helpful. Tell me a joke, please") == {A: 31}
    assert tree.match("Something else") == {}
    assert tree.match("") == {}


def test_divergent_texts_split_an_edge_and_share_the_prefix_once() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=10_000)
    tree.insert("system: abc|user: one", A)
    tree.insert("system: abc|user: two", B)
    tree.insert("system: xyz", A)
    assert tree.match("system: abc|user: one") == {A: 21, B: 18}
    assert tree.match("system: abc|user: two") == {A: 18, B: 21}
    assert tree.match("system: xyz!") == {A: 11, B: 8}
    shared, tails = len("system: "), len("abc|user: ") + 3 + 3 + len("xyz")
    assert tree.total_chars() == shared + tails
    assert tree.size(A) == shared + len("abc|user: ") + 3 + 3
    assert tree.size(B) == shared + len("abc|user: ") + 3


def test_locations_are_isolated_and_can_be_filtered() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=10_000)
    tree.insert("hello world", A)
    assert tree.match("hello world") == {A: 11}
    assert tree.size(B) == 0
    tree.insert("hello", B)
    assert tree.match("hello world", locations=[B]) == {B: 5}
    assert tree.match("hello world", locations=[("c", 0)]) == {}


def test_eviction_takes_the_least_recently_used_text_first() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=100, clock=FakeClock())
    first, second, third = "1" * 40, "2" * 40, "3" * 40
    tree.insert(first, A)
    tree.insert(second, A)
    tree.insert(first, A)  # used again: now the second is the oldest
    tree.insert(third, A)
    assert tree.size(A) <= 100
    assert tree.match(first) == {A: 40}
    assert tree.match(third) == {A: 40}
    assert tree.match(second) == {}


def test_eviction_trims_leaves_and_keeps_the_shared_prefix() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=140, clock=FakeClock())
    system = "S" * 30
    tree.insert(system + "a" * 40, A)
    tree.insert(system + "b" * 40, A)
    tree.insert(system + "c" * 40, A)  # 150 chars: the oldest leaf goes, not the prefix
    assert tree.match(system + "a" * 40) == {A: 30}
    assert tree.match(system + "b" * 40) == {A: 70}
    assert tree.match(system + "c" * 40) == {A: 70}
    assert tree.size(A) == 110
    assert tree.total_chars() == 110


def test_a_stream_of_unique_prompts_stays_under_the_cap() -> None:
    cap = 20_000
    tree = ApproxPrefixTree(max_chars_per_location=cap, clock=FakeClock())
    system = "You are a careful assistant. " * 4
    locations = [A, B]
    for number in range(10_000):
        text = f"{system}request {number:05d}: " + "x" * (number % 50)
        location = locations[number % 2]
        tree.insert(text, location)
        assert tree.size(location) <= cap
    assert tree.total_chars() <= 2 * cap
    newest = f"{system}request 09999: " + "x" * (9999 % 50)
    assert tree.match(newest) == {B: len(newest), A: len(system) + len("request 0999")}
    assert tree.match(f"{system}request 00002: ")[A] < len(system) + len("request 00002: ")


def test_remove_forgets_one_location_and_prunes_its_nodes() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=10_000)
    tree.insert("abcdef", A)
    tree.insert("abcxyz", B)
    tree.remove(A)
    assert tree.match("abcdef") == {B: 3}
    assert tree.size(A) == 0
    assert tree.total_chars() == 6
    tree.insert("abcdef", A)  # the merged edge splits again
    assert tree.match("abcdef") == {A: 6, B: 3}


def test_remove_worker_removes_every_rank_of_that_worker() -> None:
    tree = ApproxPrefixTree(max_chars_per_location=10_000)
    tree.insert("shared prompt", ("w", 0))
    tree.insert("shared prompt two", ("w", 1))
    tree.insert("shared", ("v", 0))
    tree.remove_worker("w")
    assert tree.match("shared prompt two") == {("v", 0): 6}
    assert tree.total_chars() == 6
    tree.remove_worker("v")
    assert tree.total_chars() == 0
    assert tree.match("shared") == {}


def test_matches_agree_with_a_brute_force_model_through_inserts_and_removals() -> None:
    rng = random.Random(3)
    locations: list[Location] = [("a", 0), ("a", 1), ("b", 0)]
    for _ in range(40):  # bounded: 40 trees of 60 steps
        tree = ApproxPrefixTree(max_chars_per_location=10**9)
        seen: dict[Location, set[str]] = {}
        for _ in range(60):
            location = rng.choice(locations)
            if rng.random() < 0.85:
                text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
                tree.insert(text, location)
                seen.setdefault(location, set()).add(text)
            else:
                tree.remove(location)
                seen.pop(location, None)
            query = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
            expected = {
                loc: max(len(os.path.commonprefix([query, text])) for text in texts)
                for loc, texts in seen.items()
            }
            assert tree.match(query) == {loc: n for loc, n in expected.items() if n}
            assert tree.total_chars() <= sum(len(t) for texts in seen.values() for t in texts)
