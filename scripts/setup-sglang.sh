#!/usr/bin/env bash
# Set up .venv-sglang: real SGLang 0.5.23 on CPU for the real-engine suite (tests/real_engines).
# Idempotent; works on a fresh Debian machine with Python 3.11 (we are root, or have sudo).
#
# Why it is not `pip install sglang`: SGLang pins torch==2.14.1 and ~20 CUDA-only packages
# (flashinfer, sglang-kernel, deep-ep, cutlass-dsl, ...), which pull GBs of CUDA wheels and do not
# run here. torch 2.13.0 has a CPU build on this machine kind, so we install sglang --no-deps and
# then its requirements minus the CUDA-only ones under a torch==2.13.0 constraint. The kernels and
# torchvision that SGLang imports on CPU are stood in for by tests/real_engines/sglang_stubs/,
# which the harness puts on the engine's PYTHONPATH (see docs/real-engines.md section 4).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
TORCH_VERSION=2.13.0
SGLANG_VERSION=0.5.23
# SGLang requirements we do not install: CUDA-only kernels and their toolchains, and the
# registry's torchvision/torchaudio/torchcodec (CUDA-linked: `torchvision::nms does not exist`
# breaks transformers' imports). triton stays: SGLang imports it at module level.
EXCLUDED="torch torchvision torchaudio torchcodec timm flashinfer-python flash-attn-4
sglang-kernel sgl-kernel sgl-deep-ep sgl-deep-gemm sgl-flash-mla cuda-python humming-kernels
nvidia-cutlass-dsl nvidia-mathdx nvshmem4py-cu13 quack-kernels tilelang
torch-memory-saver deepseek-recipe"

source scripts/lib/debian.sh
debian_packages python3-venv "${MOONCAKE_DEBIAN_PACKAGES[@]}"

"$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11), "SGLang setup expects Python 3.11"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip packaging

CONSTRAINTS=$(mktemp)
REQUIREMENTS=$(mktemp)
trap 'rm -f "$CONSTRAINTS" "$REQUIREMENTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"

"$PY" -m pip install -q -c "$CONSTRAINTS" "torch==$TORCH_VERSION"
"$PY" -m pip install -q --no-deps "sglang==$SGLANG_VERSION"
# sglang's own requirement list (this platform's markers, no extras) minus EXCLUDED.
EXCLUDED="$EXCLUDED" "$PY" - >"$REQUIREMENTS" <<'EOF'
import os
from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

excluded = {canonicalize_name(name) for name in os.environ["EXCLUDED"].split()}
for line in requires("sglang") or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in excluded:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
"$PY" -m pip install -q --no-warn-conflicts -c "$CONSTRAINTS" -r "$REQUIREMENTS" triton mooncake-transfer-engine-non-cuda
# Something above may still have dragged one in as a dependency: they break SGLang's imports.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$PY" -c "import torch, sglang, mooncake.engine; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
echo "SGLang $SGLANG_VERSION is set up in $VENV ($("$PY" --version), torch $TORCH_VERSION CPU)"
