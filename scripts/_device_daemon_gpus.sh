#!/usr/bin/env bash
# Issue 12 items 1, 2, 5 on a GPU host with no NVIDIA container toolkit, through a real daemon:
#   the bundled Docker Engine (.device-docker/docker-min.tar.xz, from ../shared/device/docker/make-bundle),
#   `coldsnap-provider serve` with [gpus] mode = "native" and [runtime] privileged = "host-capabilities",
#   a capsule image built by the daemon's image-build, GPU visibility / bad-id / privileged runs, and the
#   in-capsule probe (control-socket `probe`) for n610 and n580, each twice (fresh, then cached).
# The project's GPU tests are `scripts/device gpu-tests`; tests/shim against the real NCCL is `scripts/device nccl`.
# Run from the repository root with .device-criu, .device-docker and .whl carried; results go to $OUT.
#   scripts/device daemon-gpus [--engine]   (--engine: also item 3's cold start of the 8B-shaped engine)
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
STATE=/tmp/cs-gpus-state
source "$(dirname "$0")/_device_daemon.sh"
CTX=/tmp/cs-capsule
mkdir -p "$D" "$STATE" && chmod 700 "$STATE"

step host
{
    nvidia-smi --query-gpu=index,uuid,pci.bus_id,name,driver_version --format=csv
    ls -l /dev/nvidia* 2>&1; cat /proc/driver/nvidia/gpus/*/information 2>&1
    ls /usr/local/nvidia /usr/local/nvidia/* 2>&1 | head -40
    grep Cap /proc/self/status; cat /proc/sys/kernel/cap_last_cap
    python3 -c "import sys, os, sysconfig; print(sys.executable, os.path.realpath(sys.executable), sysconfig.get_paths()['stdlib'])"
} > "$OUT/host.txt" 2>&1
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i 0 | tr -d ' ')
echo "GPU 0: $UUID"

step "docker engine (bundled)"
start_docker
docker() { docker_ "$@"; }
grep CapBnd /proc/$(cat $D/docker.pid)/status

step "capsule build context"
/usr/bin/time -f "rootfs assembled in %e s" python3 scripts/_capsule_rootfs.py "$CTX" --busybox $D/usr/bin/busybox-static \
    --criu-root "$CRIU_ROOT" 2>&1 | tee "$OUT/capsule.txt"

step "coldsnap-provider serve"
cat > /tmp/cs-gpus.toml <<EOF
[docker]
url = "unix://$D/docker.sock"
[gpus]
mode = "native"
[runtime]
privileged = "host-capabilities"
EOF
sed 's/host-capabilities/docker/' /tmp/cs-gpus.toml > /tmp/cs-gpus-docker.toml
python3 -m coldsnap_provider serve --config /tmp/cs-gpus.toml --state-dir "$STATE" --log-level info \
    > "$OUT/daemon.log" 2>&1 &
SERVE=$!
for _ in $(seq 100); do [ -S "$STATE/control.sock" ] && break; sleep 0.2; done
ls -la "$STATE"

ENGINE=()
if [ "${1:-}" = "--engine" ]; then
    step "engine weights (8B-shaped Llama, bf16, fixed seed) written once to /dev/shm"
    /usr/bin/time -f "weights written in %e s" python3 engines/engine_llama.py weights /dev/shm/engine-8b 2>&1 | tail -2
    ENGINE=(--engine /dev/shm/engine-8b)
fi

step "through the daemon"
timeout 480 python3 scripts/_device_gpus.py --state-dir "$STATE" --context "$CTX" --out "$OUT" \
    --docker-host "unix://$D/docker.sock" --uuid "$UUID" "${ENGINE[@]}"
echo "driver exit $?"
docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | tee -a "$OUT/capsule.txt"

step "privileged under the default policy (docker): refused before create, naming the capability"
python3 -m coldsnap_provider probe --image coldsnap/capsule-probe:h200 --driver n610 --config /tmp/cs-gpus-docker.toml \
    --state-dir /tmp/cs-gpus-other --json > /tmp/probe-docker-policy.json 2> /tmp/probe-docker-policy.stderr
echo "exit $?" | tee -a "$OUT/capsule.txt"; tail -3 /tmp/probe-docker-policy.stderr | tee -a "$OUT/capsule.txt"
echo "containers left: $(docker ps -aq | wc -l)"

kill -TERM $SERVE; wait $SERVE; echo "serve exit $?"
kill -TERM "$(cat $D/docker.pid)" 2>/dev/null
grep -c '"level": *"warning"' "$OUT/daemon.log" || true
