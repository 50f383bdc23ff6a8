"""``bench.transfer.event_read``: a KV event reader's CPU per batch, interleaved builds."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.transfer.event_read import main, read_once

HERE = str(Path(__file__).resolve().parents[2])


def test_each_reader_gets_every_batch_and_reports_its_cpu_per_batch() -> None:
    for kind in ("subscriber", "floor"):
        cost = read_once(HERE, kind, batches=40, rate=400.0, blocks=2)
        assert 0.0 < cost < 100_000.0  # µs of CPU a batch, measured (a reader that lost one fails)


def test_the_table_sets_this_tree_against_the_compared_one_and_the_floor(
    capsys: pytest.CaptureFixture[str],
) -> None:
    main(["--batches", "30", "--rate", "400", "--repeats", "1", "--compare-pythonpath", HERE])
    out = capsys.readouterr().out
    for name in ("current", "floor", "compare"):
        assert f"  {name} " in out
    assert "current/compare" in out
    with pytest.raises(SystemExit):
        main(["--batches", "1"])
