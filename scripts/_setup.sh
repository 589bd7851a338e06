# Shared set-up for scripts/serve and scripts/test: Debian packages, a running dockerd, a venv.
# Sourced, not run. Idempotent: each step is skipped when already done.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${COLDSNAP_VENV:-$ROOT/.venv}"

as_root() {
    if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi
}

say() { printf '[coldsnap-provider setup] %s\n' "$*" >&2; }

# install_packages CMD:PACKAGE ... — install PACKAGE when CMD is missing.
install_packages() {
    local missing=() pair cmd pkg
    for pair in "$@"; do
        cmd="${pair%%:*}"; pkg="${pair#*:}"
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        say "installing ${missing[*]}"
        as_root apt-get update -qq
        as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

ensure_python() {
    PYTHON="${PYTHON:-python3}"
    # A minimal Debian (debootstrap minbase, a container image) has no Python at all.
    [ "$PYTHON" != python3 ] || install_packages python3:python3
    if ! "$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
        echo "coldsnap-provider needs Python >= 3.11 ($PYTHON is too old)" >&2
        exit 1
    fi
    if ! "$PYTHON" -c 'import venv, ensurepip' 2>/dev/null; then
        install_packages "no-such-command-coldsnap:python3-venv"
    fi
}

process_runs() {  # process_runs PID: alive and not a zombie
    local state
    state="$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$1/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

ensure_dockerd() {
    install_packages dockerd:docker.io
    if docker info >/dev/null 2>&1; then return; fi
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        as_root systemctl start docker || true
    fi
    if ! docker info >/dev/null 2>&1; then
        # A dockerd (or its containerd) killed with the session before may linger as a zombie:
        # dockerd would take its pid file for a live daemon and refuse to start.
        local pidfile
        for pidfile in /var/run/docker.pid /var/run/docker/containerd/containerd.pid; do
            if [ -s "$pidfile" ] && ! process_runs "$(cat "$pidfile")"; then as_root rm -f "$pidfile"; fi
        done
        say "starting dockerd (log: /var/log/coldsnap-dockerd.log)"
        as_root sh -c 'nohup dockerd >>/var/log/coldsnap-dockerd.log 2>&1 &'
    fi
    for _ in $(seq 1 120); do
        docker info >/dev/null 2>&1 && return
        sleep 0.5
    done
    echo "dockerd did not come up; see /var/log/coldsnap-dockerd.log" >&2
    exit 1
}

# The package build compiles the NCCL shim (setup.py): a C compiler and the C library's headers. The shim
# includes no Python.h, so python3-dev is not needed. (gcc only recommends libc6-dev: checked on its own.)
ensure_compiler() {
    install_packages gcc:gcc
    if [ ! -e /usr/include/dlfcn.h ]; then
        install_packages "no-such-command-coldsnap:libc6-dev"
    fi
}

# ensure_venv EXTRAS — create the venv and (re)install the package when pyproject.toml changed.
ensure_venv() {
    local extras="$1" stamp
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    # Reinstall (and so rebuild the C shim) when the metadata or the C sources change.
    stamp="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/nccl_shim/src/*.c "$ROOT"/nccl_shim/include/*.h \
        | sha256sum | cut -c1-16)-$extras"
    if [ "$(cat "$VENV/.coldsnap-stamp" 2>/dev/null)" != "$stamp" ]; then
        ensure_compiler
        say "installing coldsnap-provider[$extras] into $VENV"
        "$VENV/bin/pip" install -q --upgrade pip >/dev/null
        "$VENV/bin/pip" install -q -e "$ROOT[$extras]"
        echo "$stamp" > "$VENV/.coldsnap-stamp"
    fi
}
