#!/usr/bin/env bash
# Set up pd-router's main job (`.venv/bin/pd-cluster`) on a fresh Debian 12 machine: the Debian
# packages it needs, .venv, the project. The test tools are scripts/setup-test.sh's (it runs this
# first). Idempotent: what is already there is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
source scripts/lib/debian.sh
# python3-venv: only if $PYTHON lacks venv/ensurepip (on a bare Debian 12 it also brings python3
# itself); the Mooncake transfer engine wheel's shared libraries; curl: the sample request
# pd-cluster prints when it is ready.
debian_packages python3-venv "${MOONCAKE_DEBIAN_PACKAGES[@]}" curl

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "pd-router needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e .
echo "pd-router is set up in .venv ($(.venv/bin/python --version))"
