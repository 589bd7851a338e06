#!/usr/bin/env bash
# A capture through a registry on the GPU machine (issue 34): bench/capsule_transfer.py against the bundled Docker
# Engine and Debian's docker-registry on 127.0.0.1, Docker's path and the capture store's side by side, with the
# machine's memory, O_DIRECT disk and registry-link rates in the same run. MIB (default 4096), PATHS (default
# docker,store) and CHANGE (the second capture's changed share, default 4; 0: none, it copies the capture): Docker's
# path moves about 0.05-0.1 GB/s, so 16 GiB fits one call (and the 64 GiB disk) only as
# `scripts/device transfer 16384 store 0`. Carry .device-docker (the bundled engine), .whl, and .device-registry
# holding docker-registry (cp /usr/bin/docker-registry .device-registry/ on the CPU machine). Results in $OUT:
# transfer.txt (the tables) and transfer.json.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
MIB=${1:-4096}
PATHS=${2:-docker,store}
CHANGE=${3:-4}
[ -x .device-registry/docker-registry ] || { echo "carry .device-registry/docker-registry" >&2; exit 2; }
export PATH=$PWD/.device-registry:$PATH
step "docker"
start_docker
step "capsule_transfer $MIB MiB, paths $PATHS"
timeout -k 5 560 python3 bench/capsule_transfer.py --busybox "$D/usr/bin/busybox-static" --mib "$MIB" \
    --paths "$PATHS" --change-percent "$CHANGE" --docker-url "unix://$D/docker.sock" --out "$OUT/transfer.json" 2>&1 | tee "$OUT/transfer.txt"
rc=${PIPESTATUS[0]}
rm -rf /var/tmp/cs-transfer-*  # a run cut short leaves its capture and stores
exit "$rc"
