"""``bench.load.flow_bound``: the simulated bound on flow-control figure (a)."""

from __future__ import annotations

import pytest

from bench.load.flow_bound import Fleet, main, simulate

EVEN = Fleet(prefills=4, service_s=0.22, spread=0.05, b_rate=7.0, poisson=False)


def test_b_alone_never_waits_when_its_evenly_spaced_requests_fit() -> None:
    (bound,) = simulate(EVEN, [0], requests=2000, seed=1)
    assert bound.b_alone_p99_s <= 0.22 * 1.05 + 1e-9  # its own forward pass, no wait


def test_a_flood_costs_b_the_wait_for_a_free_prefill_and_a_held_back_place_removes_it() -> None:
    work_conserving, held_back = simulate(EVEN, [0, 1], requests=5000, seed=1)
    # four one-at-a-time prefills: B waits for the first of them to finish, 0 .. S
    assert 1.4 < work_conserving.ratio < 1.8
    assert work_conserving.a_share > held_back.a_share  # the place held back is A's loss
    assert held_back.ratio < 1.1
    (seven,) = simulate(Fleet(7, 0.22, 0.05, 7.0, False), [0], requests=5000, seed=1)
    assert seven.ratio < work_conserving.ratio  # more prefills: a free one sooner


def test_the_options_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--reserve", "4"], ["--prefills", "0"], ["--spread", "1.5"]):
        with pytest.raises(SystemExit):
            main(bad)
    main(["--requests", "500", "--reserve", "0,1"])
    out = capsys.readouterr().out
    assert "| 0 |" in out and "| 1 |" in out and "evenly spaced" in out
