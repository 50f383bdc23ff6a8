#!/usr/bin/env bash
# Set up pd-router on a fresh Debian machine with Python 3.11: system packages, .venv, the project.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
source scripts/lib/debian.sh
# etcd-server: the real etcd the registry's etcd tests start; procps: ps, the pd-cluster test
# checks that no child outlives it; prometheus: the real Prometheus the dashboard and alert-rule
# test scrapes a pd-cluster with; chromium: the headless browser the status-page test drives;
# kubectl (with its built-in kustomize >= 5): renders deploy/k8s in tests/deploy.
debian_packages python3-venv etcd-server procps prometheus chromium kubectl \
    "${MOONCAKE_DEBIAN_PACKAGES[@]}"

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "pd-router needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
echo "pd-router is set up in .venv ($(.venv/bin/python --version))"
