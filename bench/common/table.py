"""Plain-text tables: a header row, a rule of dashes under it, columns two spaces apart; cells of
numbers that may be missing."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["or_na", "text_table"]


def text_table(rows: Sequence[Sequence[str]], *, left: int = 0, strip: bool = False) -> list[str]:
    """The lines of a table of ``rows`` (the first is the header): the first ``left`` columns
    left-aligned, the others right-aligned; ``strip``: trailing spaces removed."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [rows[0], ["-" * w for w in widths], *rows[1:]]
    out = [
        "  ".join(
            cell.ljust(w) if i < left else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths, strict=True))
        )
        for line in lines
    ]
    return [line.rstrip() for line in out] if strip else out


def or_na(value: float | None, spec: str = ".1f") -> str:
    """``value`` formatted with ``spec``; ``n/a`` when it is None (not measured, not reported)."""
    return "n/a" if value is None else format(value, spec)
