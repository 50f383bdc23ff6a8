#!/usr/bin/env bash
# Set up .venv-peers: the peer routers that the benchmarks compare ours against, unmodified, from
# PyPI: sglang-router 0.3.2 (`python -m bench.routing.workload`, `python -m bench.load.peers`)
# and vllm-router 0.1.17 (`python -m bench.load.peers`). Idempotent.
#
# They get a venv of their own so their pins (fastapi, uvicorn, aiohttp, orjson, setproctitle)
# never touch .venv. Each wheel ships its Rust router as a Python extension; nothing is compiled
# here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-peers
SGLANG_ROUTER_VERSION=0.3.2
VLLM_ROUTER_VERSION=0.1.17

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 8), "the peer routers need Python >= 3.8"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "sglang-router==$SGLANG_ROUTER_VERSION" "vllm-router==$VLLM_ROUTER_VERSION"
"$PY" -m sglang_router.launch_router --help >/dev/null
"$VENV/bin/vllm-router" --help >/dev/null
echo "sglang-router $SGLANG_ROUTER_VERSION and vllm-router $VLLM_ROUTER_VERSION are set up in $VENV ($("$PY" --version))"
