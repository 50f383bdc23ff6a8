"""deploy/Dockerfile and .dockerignore, read statically (no Docker engine needed).

The image must build from what the build context really holds (every ``COPY`` source exists and
``.dockerignore`` keeps none of it out, and everything ``pyproject.toml`` builds from is copied),
run as a non-root numeric user in a multi-stage build whose final stage carries no build tools,
install the Mooncake wheel variant the project depends on by default (so the two cannot drift),
and start a console script the project declares.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from router.server.cli import parse_args as parse_router_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"
DEBIAN_LIB = ROOT / "scripts" / "lib" / "debian.sh"
MOONCAKE_PREFIX = "mooncake-transfer-engine"
RUNTIME_BASE = "python:3.11-slim"
BUILD_TOOLS = ("build-essential", "gcc", "g++", "make", "cmake", "git")
CACHE_DIRS = frozenset({"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"})


# --- a small Dockerfile reader -----------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the logical line, continuations joined


@dataclass
class Stage:
    base: str  # the FROM image, global ARGs substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]


def logical_lines(text: str) -> list[str]:
    """Instruction lines: comments and blank lines dropped, ``\\`` continuations joined."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or (stripped.startswith("#") and not pending):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return lines


def _arg_default(args: str) -> tuple[str, str]:
    name, _, default = args.partition("=")
    return name.strip(), default.strip().strip('"')


def _substitute(value: str, variables: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: variables[m[1] or m[2]], value)


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = [w for w in args.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(_substitute(words[0], global_args), name))
        elif not stages:
            assert keyword == "ARG", f"{keyword} before the first FROM"
            global_args.update([_arg_default(args)])
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def copy_sources(instruction: Instruction) -> list[str]:
    """A ``COPY``'s sources from the build context ([] for ``COPY --from=stage``)."""
    words = shlex.split(instruction.args)
    flags = [w for w in words if w.startswith("--")]
    if any(f.startswith("--from=") for f in flags):
        return []
    paths = [w for w in words if not w.startswith("--")]
    assert len(paths) >= 2, f"COPY {instruction.args}: expected sources and a destination"
    return paths[:-1]


# --- .dockerignore, as Docker reads it ---------------------------------------------------------


@dataclass(frozen=True)
class IgnoreRule:
    regex: re.Pattern[str]
    negated: bool


def _glob_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax: ``*`` and ``?`` within one path element, ``**`` any depth."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out.append(pattern[i : end + 1].replace("[!", "[^"))
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out) + r"\Z")


def parse_dockerignore(text: str) -> list[IgnoreRule]:
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = os.path.normpath(line.removeprefix("!").strip()).lstrip("/")
        rules.append(IgnoreRule(_glob_regex(pattern), negated))
    return rules


def is_excluded(rules: list[IgnoreRule], path: str) -> bool:
    """Whether ``path`` (relative, with ``/``) stays out of the build context: the last rule
    matching it or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for rule in rules:
        if any(rule.regex.match(c) for c in candidates):
            excluded = not rule.negated
    return excluded


def context_files(source: Path) -> list[str]:
    """Files under ``source`` (relative to the repository), caches left out."""
    if source.is_file():
        return [source.relative_to(ROOT).as_posix()]
    found = []
    for directory, subdirs, files in os.walk(source):
        subdirs[:] = [d for d in subdirs if d not in CACHE_DIRS]
        found += [
            (Path(directory) / f).relative_to(ROOT).as_posix()
            for f in files
            if not f.endswith((".pyc", ".pyo"))
        ]
    return found


# --- the project -------------------------------------------------------------------------------


def pyproject() -> dict[str, Any]:
    return tomllib.loads(PYPROJECT.read_text())


def mooncake_variant() -> str:
    """The Mooncake wheel the project depends on (exactly one variant)."""
    names = [
        re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0]
        for dep in pyproject()["project"]["dependencies"]
    ]
    variants = [n for n in names if n.startswith(MOONCAKE_PREFIX)]
    assert len(variants) == 1, f"expected one Mooncake dependency in pyproject, got {variants}"
    return variants[0]


def mooncake_debian_packages() -> list[str]:
    match = re.search(r"^MOONCAKE_DEBIAN_PACKAGES=\(([^)]*)\)", DEBIAN_LIB.read_text(), re.M)
    assert match, f"no MOONCAKE_DEBIAN_PACKAGES array in {DEBIAN_LIB}"
    return match[1].split()


def apt_packages(stage: Stage) -> list[str]:
    packages: list[str] = []
    for run in stage.all("RUN"):
        for command in re.split(r"&&|;", run.args):
            words = command.split()
            if "apt-get" in words and "install" in words:
                packages += [w for w in words[words.index("install") + 1 :] if w[0] != "-"]
    return packages


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text())


# --- the tests ---------------------------------------------------------------------------------


def test_multi_stage_build_whose_runtime_stage_uses_the_builder(dockerfile: Dockerfile) -> None:
    assert len(dockerfile.stages) >= 2, "the image must be a multi-stage build"
    builders = {s.name for s in dockerfile.stages[:-1] if s.name}
    final = dockerfile.final
    used = {
        m
        for i in final.instructions
        for m in re.findall(r"(?:--from=|from=)([\w.-]+)", i.args)
        if i.keyword in ("COPY", "RUN")
    }
    assert used & builders, f"the final stage takes nothing from a builder stage {builders}"
    assert final.base == RUNTIME_BASE, f"runtime stage FROM {final.base}, expected {RUNTIME_BASE}"


def test_final_stage_runs_as_a_numeric_non_root_user(dockerfile: Dockerfile) -> None:
    users = dockerfile.final.all("USER")
    assert users, "the final stage sets no USER: the image would run as root"
    user, _, group = users[-1].args.partition(":")
    assert user.isdigit() and int(user) > 0, f"USER {users[-1].args}: want a numeric non-root UID"
    assert not group or (group.isdigit() and int(group) > 0), f"USER {users[-1].args}: GID"


def test_mooncake_wheel_default_is_the_variant_pyproject_depends_on(
    dockerfile: Dockerfile,
) -> None:
    variant = mooncake_variant()
    defaults = {
        _arg_default(i.args)[1]
        for stage in dockerfile.stages
        for i in stage.all("ARG")
        if _arg_default(i.args)[0] == "MOONCAKE_WHEEL"
    }
    assert defaults == {variant}, f"ARG MOONCAKE_WHEEL defaults {defaults}, pyproject: {variant}"
    # the chosen variant replaces pyproject's one before the wheels are built: that step must
    # name the variant pyproject has, or another choice would install two variants
    swaps = [
        run.args
        for stage in dockerfile.stages
        for run in stage.all("RUN")
        if "sed" in run.args and "${MOONCAKE_WHEEL}" in run.args
    ]
    assert swaps and all(f'"{variant}' in s for s in swaps), f"no swap of {variant}: {swaps}"


def test_every_copy_source_is_in_the_build_context(dockerfile: Dockerfile) -> None:
    rules = parse_dockerignore(DOCKERIGNORE.read_text())
    sources = [s for stage in dockerfile.stages for c in stage.all("COPY") for s in copy_sources(c)]
    assert sources, "nothing is copied from the build context"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: not in the repository"
        excluded = [f for f in context_files(path) if is_excluded(rules, f)]
        assert not excluded, f"COPY {source}: .dockerignore keeps out {excluded[:5]}"


def test_everything_pyproject_builds_from_is_copied(dockerfile: Dockerfile) -> None:
    project = pyproject()
    copied = {
        Path(s).as_posix().rstrip("/")
        for stage in dockerfile.stages
        for c in stage.all("COPY")
        for s in copy_sources(c)
    }
    needed = {"pyproject.toml", project["project"]["readme"]}
    setuptools = project["tool"]["setuptools"]
    needed |= {p.rstrip("*").rstrip(".") for p in setuptools["packages"]["find"]["include"]}
    assert needed <= copied, f"the build needs {sorted(needed - copied)} too"
    rules = parse_dockerignore(DOCKERIGNORE.read_text())
    for package, patterns in setuptools.get("package-data", {}).items():
        for pattern in patterns:
            files = [
                p.relative_to(ROOT).as_posix()
                for p in (ROOT / package.replace(".", "/")).glob(pattern)
            ]
            assert files, f"package data {package}/{pattern} matches nothing"
            assert not any(is_excluded(rules, f) for f in files), f"{files} are ignored"


def test_dockerignore_keeps_environments_vcs_caches_and_tests_out() -> None:
    rules = parse_dockerignore(DOCKERIGNORE.read_text())
    for path in (
        ".venv/bin/python",
        ".venv-vllm/bin/python",
        ".git/HEAD",
        "tests/conftest.py",
        "testkit/polling.py",
        "router/__pycache__/app.cpython-311.pyc",
        ".mypy_cache/3.11/router/app.meta.json",
        ".pytest_cache/v/cache/lastfailed",
    ):
        assert is_excluded(rules, path), f".dockerignore lets {path} into the build context"


def test_entrypoint_is_a_console_script_of_the_project(dockerfile: Dockerfile) -> None:
    entrypoints = dockerfile.final.all("ENTRYPOINT")
    assert entrypoints, "the final stage has no ENTRYPOINT"
    command = exec_form(entrypoints[-1].args)  # exec form: signals reach the router
    scripts = pyproject()["project"]["scripts"]
    assert command[0] in scripts, f"ENTRYPOINT {command[0]!r} is not in {sorted(scripts)}"


def test_image_exposes_the_routers_default_port(
    dockerfile: Dockerfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in [n for n in os.environ if n.startswith("PDR_")]:
        monkeypatch.delenv(name)
    exposed = {int(p.split("/")[0]) for e in dockerfile.final.all("EXPOSE") for p in e.args.split()}
    assert parse_router_args([]).server.port in exposed, f"EXPOSE {sorted(exposed)}"


def test_no_healthcheck_in_the_image(dockerfile: Dockerfile) -> None:
    found = [s.name for s in dockerfile.stages if s.all("HEALTHCHECK")]
    assert not found, "the image declares a HEALTHCHECK: orchestrators probe /health and /ready"


def test_runtime_stage_installs_mooncakes_libraries_and_no_build_tools(
    dockerfile: Dockerfile,
) -> None:
    final = dockerfile.final
    assert sorted(apt_packages(final)) == sorted(mooncake_debian_packages()), (
        f"runtime apt packages {apt_packages(final)}, Mooncake needs {mooncake_debian_packages()}"
    )
    text = " ".join(i.args for i in final.instructions)
    present = [t for t in BUILD_TOOLS if re.search(rf"(?<![\w-]){re.escape(t)}(?![\w-])", text)]
    assert not present, f"build tools in the final stage: {present}"
    for run in final.all("RUN"):
        if "apt-get install" in run.args:
            assert "--no-install-recommends" in run.args, run.args
            assert "rm -rf /var/lib/apt/lists" in run.args, f"apt lists left behind: {run.args}"
    no_pip_cache = any("PIP_NO_CACHE_DIR=1" in e.args for e in final.all("ENV"))
    for run in final.all("RUN"):
        if "pip install" in run.args:
            assert no_pip_cache or "--no-cache-dir" in run.args, f"pip cache kept: {run.args}"
