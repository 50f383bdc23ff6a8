#!/usr/bin/env bash
# Set up .venv-peers: the peer router sglang-router 0.3.2 (unmodified, from PyPI) that
# `python -m bench.routing.workload` compares ours against. Idempotent.
#
# It gets a venv of its own so its pins (fastapi, uvicorn, aiohttp, orjson, setproctitle) never
# touch .venv. The wheel ships the Rust router as a Python extension; nothing is compiled here.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv-peers
SGLANG_ROUTER_VERSION=0.3.2

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 8), "sglang-router needs Python >= 3.8"'
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "sglang-router==$SGLANG_ROUTER_VERSION"
"$PY" -m sglang_router.launch_router --help >/dev/null
echo "sglang-router $SGLANG_ROUTER_VERSION is set up in $VENV ($("$PY" --version))"
