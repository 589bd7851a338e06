#!/usr/bin/env bash
# Run by scripts/fresh-root as root inside the bare Debian root (chroot, private mount and pid namespaces), from
# a copy of the checkout at /src/coldsnap-provider: the set-up of the README's two commands, in order, each timed.
set -euo pipefail
cd /src/coldsnap-provider

say() { printf '[fresh-root] %s\n' "$*" >&2; }
step() {  # step NAME COMMAND...: run it, report its time
    local name="$1" start
    shift
    say "step $name: $*"
    start=$(date +%s)
    "$@"
    say "step $name: passed in $(( $(date +%s) - start ))s"
}

# The README's "First session" block, as tests/provider/test_cli.py runs it (and checks its output): the Docker Hub
# pull is dropped, the image is a local one and the workload's name is unique (one dockerd is shared with the host).
first_session() {
    local name="fresh-root-hello-$$" daemon log=/tmp/serve.log out=/tmp/first-session.out i
    say "apt-get install jq (the README's first session reads its replies with jq)"
    apt-get install -y -qq jq >/dev/null
    scripts/serve > "$log" 2>&1 &
    daemon=$!
    for i in $(seq 1 100); do
        [ -S /run/coldsnap-provider/control.sock ] && break
        kill -0 "$daemon" 2>/dev/null || { tail -30 "$log" >&2; say "the daemon exited"; return 1; }
        sleep 0.2
    done
    [ -S /run/coldsnap-provider/control.sock ] || { tail -30 "$log" >&2; say "no control socket after 20 s"; return 1; }
    python3 - "$COLDSNAP_FRESH_IMAGE" "$name" > /tmp/first-session.sh <<'EOF'
import sys
image, name = sys.argv[1], sys.argv[2]
section = open("README.md").read().split("\n## First session\n", 1)[1]
block = section.split("```sh\n", 1)[1].split("\n```", 1)[0]
block = "\n".join(line for line in block.splitlines() if '"image-pull"' not in line)
block = "\n".join(line.replace(" hello", f" {name}") if line.startswith("csp workload") else line
                  for line in block.splitlines())
print(block.replace("busybox:1.36", image).replace('"hello"', f'"{name}"'))
EOF
    if ! bash -e -o pipefail /tmp/first-session.sh > "$out" 2>&1; then
        cat "$out" >&2; tail -30 "$log" >&2; kill -TERM "$daemon"; say "the README's first session failed"; return 1
    fi
    grep -q "^hello from " "$out" && grep -qx "removed $name" "$out" && [ "$(tail -1 "$out")" = "closed first-session" ] \
        || { cat "$out" >&2; kill -TERM "$daemon"; say "the first session's output is not the README's"; return 1; }
    rm -f session.json
    kill -TERM "$daemon"
    wait "$daemon" || { tail -30 "$log" >&2; say "the daemon did not stop cleanly on SIGTERM"; return 1; }
    say "first session: $(grep -c . "$out") lines of replies; daemon stopped on SIGTERM"
}

# What the test command's set-up leaves must work: the CRIU it built runs, the venv has the test tools.
test_setup_works() {
    local criu
    say "the CRIU build inside scripts/test: $(grep -h 'built in\|make failed' /tmp/coldsnap-criu-build.log \
        || echo 'not built (cached?)')"
    if [ "${COLDSNAP_FRESH_K8S:-0}" = 1 ]; then
        say "the Kubernetes build inside scripts/test:" \
            "$(grep -h 'built \|done in' /tmp/coldsnap-k8s-build.log | paste -sd ';' -)"
    fi
    criu="$(scripts/criu/build --print-dir)"
    LD_LIBRARY_PATH="$criu/usr/lib/x86_64-linux-gnu" "$criu/usr/sbin/criu" --version
    .venv/bin/python -c 'import pytest, coldsnap_provider, coldsnap_probe, nccl_shim'
    .venv/bin/ruff --version && .venv/bin/mypy --version
}

step serve-setup scripts/serve --setup-only
step first-session first_session
if [ "${COLDSNAP_FRESH_K8S:-0}" = 1 ]; then
    step test-setup scripts/test --setup-only
else
    step test-setup env COLDSNAP_SKIP_K8S_BUILD=1 scripts/test --setup-only
fi
step test-setup-works test_setup_works
