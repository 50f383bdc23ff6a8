"""Every citation of the wire contract or the real-engine notes resolves inside the repository.

The code cites ``docs/concepts/protocols.md`` (the engines' wire contract) and
``docs/real-engines.md`` by section number ("docs/concepts/protocols.md section 5.1", "... 3.2,
3.3", "... 6.3-6.5"); each page gives every section an explicit anchor (``{ #5.1 }``). Nothing
cites a document outside the repository.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("docs/concepts/protocols.md", "docs/real-engines.md")
_ANCHOR = re.compile(r"\{ #([0-9.]+) \}")
_NUMBER = r"[0-9]+(?:\.[0-9]+)?"
# the page, then (across a line break, after "section(s)", "§", "and", commas, ranges) numbers
_CITATION = re.compile(
    r"(docs/concepts/protocols\.md|docs/real-engines\.md)((?:[\s#'`*]*(?:sections?|§|and|,)?"
    rf"\s*{_NUMBER}(?:\s*[-\u2013]\s*{_NUMBER})?)*)"
)
_OUTSIDE = re.compile(r"\b(PROTOCOLS|REAL_ENGINES)\.md")
# folders that are not the repository's sources (dot-folders: .git, .venv*, caches, too)
_NOT_SOURCES = frozenset({"site", "__pycache__", "build", "dist"})
_TEXT = frozenset({".py", ".md", ".yaml", ".yml", ".sh", ".toml"})


def _tracked_text_files() -> list[Path]:
    """The repository's text files (not its environments, caches or built site)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [s for s in subfolders if not s.startswith(".") and s not in _NOT_SOURCES]
        found += [Path(folder, name) for name in files if Path(name).suffix in _TEXT]
    return sorted(found)


def cited_sections(text: str) -> set[tuple[str, str]]:
    """(page, section) for every section number cited in ``text``."""
    cited = set()
    for match in _CITATION.finditer(text):
        for number in re.findall(_NUMBER, match.group(2)):
            cited.add((match.group(1), number.rstrip(".")))
    return cited


def anchors(page: str) -> set[str]:
    return set(_ANCHOR.findall((ROOT / page).read_text()))


def test_a_citation_is_read_with_all_its_sections() -> None:
    text = "see docs/concepts/protocols.md 3.2, 3.3 and docs/real-engines.md section\n  5."
    assert cited_sections(text) == {
        ("docs/concepts/protocols.md", "3.2"),
        ("docs/concepts/protocols.md", "3.3"),
        ("docs/real-engines.md", "5"),
    }


def test_every_cited_section_exists() -> None:
    known = {page: anchors(page) for page in PAGES}
    missing = []
    for path in _tracked_text_files():
        for page, section in sorted(cited_sections(path.read_text())):
            if section not in known[page]:
                missing.append(f"{path.relative_to(ROOT)} cites {page} section {section}")
    assert missing == []


def test_nothing_cites_a_document_outside_the_repository() -> None:
    outside = [
        f"{path.relative_to(ROOT)}: {match.group(0)}"
        for path in _tracked_text_files()
        for match in _OUTSIDE.finditer(path.read_text())
    ]
    assert outside == []
