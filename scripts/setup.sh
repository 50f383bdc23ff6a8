#!/usr/bin/env bash
# Set up pd-router on a fresh Debian machine with Python 3.11: system packages, .venv, the project.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
APT_PACKAGES=()
if ! "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null; then
    APT_PACKAGES+=(python3-venv)
fi
if [ ! -x /usr/bin/etcd ]; then
    APT_PACKAGES+=(etcd-server)  # the real etcd the registry's etcd tests start
fi
if ! command -v ps >/dev/null; then
    APT_PACKAGES+=(procps)  # ps: the pd-cluster test checks that no child outlives it
fi
# Shared libraries the Mooncake transfer engine wheel (mooncake-transfer-engine-non-cuda) loads.
for lib in libibverbs1 librdmacm1 libnuma1; do
    if ! dpkg-query -W -f='${Status}' "$lib" 2>/dev/null | grep -q 'install ok installed'; then
        APT_PACKAGES+=("$lib")
    fi
done
if [ ${#APT_PACKAGES[@]} -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${APT_PACKAGES[@]}"
fi

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11), "pd-router needs Python >= 3.11"'
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
echo "pd-router is set up in .venv ($(.venv/bin/python --version))"
