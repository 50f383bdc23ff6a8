"""Shared fixtures of the real-engine suite: the tiny local model every engine serves."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ENGINE_VENVS = (REPO / ".venv-vllm", REPO / ".venv-sglang")
MODEL_BUILD_TIMEOUT_S = 300


def model_builder_python() -> Path:
    """An engine environment's Python: the model builder needs torch and transformers, which the
    router's ``.venv`` does not have. ``PDR_ENGINE_PYTHON`` overrides (e.g. a hand-made venv)."""
    override = os.environ.get("PDR_ENGINE_PYTHON")
    candidates = [Path(override)] if override else [venv / "bin/python" for venv in ENGINE_VENVS]
    for python in candidates:
        if python.exists():
            return python
    pytest.skip("no engine environment: run scripts/setup-vllm.sh or scripts/setup-sglang.sh")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Llama with its tokenizer (``model.py``), built once per session."""
    out = tmp_path_factory.mktemp("tiny-model")
    built = subprocess.run(
        [str(model_builder_python()), str(Path(__file__).with_name("model.py")), str(out)],
        timeout=MODEL_BUILD_TIMEOUT_S,
        capture_output=True,
        text=True,
    )
    if built.returncode != 0:
        pytest.fail(f"model.py failed ({built.returncode}):\n{built.stderr[-3000:]}")
    return out
