"""The settings tree is the one source of the flags and of docs/configuration.md: every setting
has a flag or a stated reason to have none, every flag is on the page, and the page is exactly
what ``python -m router.server.settings_reference`` prints."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, Field

from router.server.cli import build_parser
from router.server.settings_reference import main, render
from router.server.settings_spec import sections, undeclared
from router.settings import cli, env_only

PAGE = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
REGENERATE = "python -m router.server.settings_reference > docs/configuration.md"


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        flag
        for action in parser._actions
        for flag in action.option_strings
        if flag not in ("-h", "--help")
    ]


def _undocumented(page: str) -> list[str]:
    """The router's flags the page does not show as a flag (in a code span)."""
    return [flag for flag in _flags(build_parser()) if not re.search(f"`{flag}[ `]", page)]


class _Section(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)

    flagged: int = Field(default=1, json_schema_extra=cli("--flagged"))
    """has a flag"""
    quiet: int = Field(default=2, json_schema_extra=env_only("rarely tuned"))
    """has a reason to have none"""
    forgotten: int = 3
    """has neither"""
    unexplained: int = Field(default=4, json_schema_extra=cli("--unexplained"))


class _Root(BaseModel):
    section: _Section = _Section()


def test_every_setting_has_help_and_a_flag_or_a_reason_for_none() -> None:
    assert undeclared(sections()) == []


def test_a_setting_without_a_flag_reason_or_help_is_found() -> None:
    assert undeclared(sections(_Root)) == ["PDR_SECTION__FORGOTTEN", "PDR_SECTION__UNEXPLAINED"]


def test_every_flag_is_on_the_reference_page() -> None:
    assert _undocumented(PAGE.read_text()) == [], REGENERATE


def test_a_flag_missing_from_the_page_is_found() -> None:
    page = PAGE.read_text().replace("`--max-n`", "`--max-nn`")
    assert _undocumented(page) == ["--max-n"]


def test_the_reference_page_is_the_generator_output(capsys: pytest.CaptureFixture[str]) -> None:
    main()
    assert capsys.readouterr().out == render()
    assert PAGE.read_text() == render(), REGENERATE
