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
