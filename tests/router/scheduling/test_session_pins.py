"""The session pin table stays within its bounds: a TTL refreshed on use and a size cap (LRU)."""

from __future__ import annotations

from router.scheduling.session_pins import SessionPins


class Clock:
    """A clock the test moves by hand (no sleeping)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pin_is_found_until_its_ttl_and_each_use_refreshes_it() -> None:
    clock = Clock()
    pins = SessionPins(max_entries=10, ttl_s=60, clock=clock)
    pins.pin("s1", "prefill:a", 1, "decode:b", 500)
    found = pins.get("s1")
    assert found is not None
    assert (found.prefill, found.rank, found.decode, found.prompt_tokens) == (
        "prefill:a",
        1,
        "decode:b",
        500,
    )
    clock.now += 59
    pins.pin("s1", "prefill:a", 1, "decode:b", 600)  # used again: 60 s more from now
    clock.now += 59
    assert pins.get("s1") is not None
    clock.now += 2
    assert pins.get("s1") is None
    assert len(pins) == 0  # the expired pin met by the lookup is dropped


def test_expired_pins_are_dropped_as_new_ones_arrive() -> None:
    clock = Clock()
    pins = SessionPins(max_entries=100, ttl_s=10, clock=clock)
    for i in range(5):
        pins.pin(f"old{i}", None, 0, "decode:a", 0)
    clock.now += 11
    pins.pin("new", None, 0, "decode:a", 0)
    assert len(pins) == 1
    assert pins.evicted == 0  # expired, not evicted for room


def test_the_least_recently_used_pin_goes_when_the_table_is_full() -> None:
    clock = Clock()
    pins = SessionPins(max_entries=3, ttl_s=600, clock=clock)
    for key in ("a", "b", "c"):
        pins.pin(key, "prefill:p", 0, "decode:d", 0)
        clock.now += 1
    pins.pin("a", "prefill:p", 0, "decode:d", 0)  # a used again: b is now the oldest
    pins.pin("d", "prefill:p", 0, "decode:d", 0)
    assert len(pins) == 3
    assert pins.get("b") is None
    assert all(pins.get(key) is not None for key in ("a", "c", "d"))
    assert pins.stats() == {"entries": 3, "max_entries": 3, "ttl_s": 600, "evicted": 1}


def test_a_table_of_one_keeps_the_last_session() -> None:
    pins = SessionPins(max_entries=1, ttl_s=600, clock=Clock())
    for i in range(1000):
        pins.pin(f"s{i}", None, 0, "decode:d", 0)
    assert len(pins) == 1 and pins.get("s999") is not None
