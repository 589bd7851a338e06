#!/usr/bin/env bash
# Issue 37 finding 1 on a GPU host: the capture/restore worker inside a capsule container, confined as a
# profile's privileged workload is now (capabilities without DAC_READ_SEARCH, the provider's capsule seccomp
# profile written by coldsnap_runtime/backend/_confine.py, a private cgroup namespace, CRIU with
# capsule.patch) and as the grant was before (DAC_READ_SEARCH, seccomp unconfined, the host's cgroup
# namespace), side by side in one run (bench/capsule_confinement.py), then the escapes tried in the confined one.
#   scripts/device confine [MIB] [RESTORES] [ROUNDS]       (default 4096 MiB, 3 restores, 2 rounds)
# carries: .device-docker (the full bundle, with the docker CLI), .device-criu42 (scripts/criu/build --bundle).
# Results: $OUT/confine-*.json, $OUT/confine.txt.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
MIB=${1:-4096}
RESTORES=${2:-3}
ROUNDS=${3:-2}
RESULTS=$ROOT/.confine-out  # bound into the capsules (their /tmp is their own)
rm -rf "$RESULTS" && mkdir -p "$RESULTS"
exec > >(tee "$OUT/confine.txt") 2>&1
step "docker"
start_docker
echo "spec_store_bypass: $(cat /sys/devices/system/cpu/vulnerabilities/spec_store_bypass 2>&1)"
docker_ rm -f confine-check >/dev/null 2>&1
if ! docker_ image inspect coldsnap-confine:1 >/dev/null 2>&1; then
    rm -rf /tmp/bb && mkdir -p /tmp/bb/bin /tmp/bb/tmp /tmp/bb/run
    cp $D/usr/bin/busybox-static /tmp/bb/bin/busybox
    for a in $(/tmp/bb/bin/busybox --list); do ln -sf busybox /tmp/bb/bin/$a; done
    tar -C /tmp/bb -c . | docker_ import --change 'ENV PATH=/bin' - coldsnap-confine:1 >/dev/null
fi
# The profile, from the production module itself (as a bare package: it and _syscalls import only the
# standard library, while the package's __init__ imports msgspec, which this host lacks).
python3 - > /tmp/capsule-seccomp.json <<'PY' || { echo "the capsule seccomp profile could not be made"; exit 1; }
import importlib, sys, types
package = types.ModuleType("capsule_backend"); package.__path__ = ["coldsnap_runtime/backend"]
sys.modules["capsule_backend"] = package
print(importlib.import_module("capsule_backend._confine").seccomp_profile())
PY
PY_BIN=$(dirname "$(command -v python3)")
common=(--rm --name confine-check --network none --tmpfs /tmp:rw,exec,size=64g
        -v /usr:/usr:ro -v /lib:/lib:ro -v /lib64:/lib64:ro -v /opt:/opt:ro -v /usr/local/nvidia:/usr/local/nvidia:ro
        -v "$ROOT:$ROOT" -w "$ROOT" -e PYTHONPATH="$ROOT" -e "PATH=$PY_BIN:$CRIU_ROOT/usr/sbin:/usr/bin:/bin"
        -e LD_LIBRARY_PATH="$CRIU_ROOT/usr/lib/x86_64-linux-gnu:/usr/local/nvidia/lib64" --security-opt apparmor=unconfined)
for dev in /dev/nvidia*; do [ -c "$dev" ] && common+=(--device "$dev"); done
caps=(--cap-add SYS_ADMIN --cap-add SYS_PTRACE --cap-add NET_ADMIN --cap-add SYS_CHROOT --cap-add SYS_TIME)
confined=("${caps[@]}" --security-opt seccomp=/tmp/capsule-seccomp.json --cgroupns private)
before=("${caps[@]}" --cap-add DAC_READ_SEARCH --security-opt seccomp=unconfined)
in_capsule() {  # in_capsule SIDE COMMAND...: COMMAND in a fresh capsule container of that side
    local side=$1; shift
    if [ "$side" = confined ]; then docker_ run "${common[@]}" "${confined[@]}" coldsnap-confine:1 "$@"
    else docker_ run "${common[@]}" "${before[@]}" coldsnap-confine:1 "$@"; fi
}
for round in $(seq "$ROUNDS"); do  # two rounds, alternating, so neither side always runs on a warmer machine
    for side in confined before; do
        step "$side (round $round): $MIB MiB, $RESTORES restores"
        in_capsule "$side" python3 bench/capsule_confinement.py "$side" "$MIB" "$RESTORES" \
            "$RESULTS/confine-$side-$round.json"
        echo "exit $?"
    done
done
for side in confined before; do
    step "criu check ($side)"
    in_capsule "$side" criu check 2>&1 | tail -5
done
step "the escapes, in the confined capsule"
in_capsule confined sh -c '
    mkdir -p /tmp/p /tmp/c
    mount -t proc proc /tmp/p 2>/dev/null && echo "procfs MOUNTED" || echo "procfs refused"
    mount -o remount,rw /proc/sys 2>/dev/null && echo "/proc/sys REMOUNTED rw" || echo "/proc/sys remount refused"
    mount -t cgroup2 none /tmp/c 2>/dev/null && echo "cgroup2 MOUNTED" || echo "cgroup mount refused"
    grep CapEff /proc/self/status'
cp "$RESULTS"/*.json "$OUT"/ 2>/dev/null
python3 - "$OUT" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
print(f"{'side':10} {'round':>5} {'capture s':>10} {'restores s (wall)':>30} verified")
for path in sorted(out.glob("confine-*-*.json")):
    r = json.loads(path.read_text())
    cap = r["capture"]
    capture = sum(cap["timings_s"].values()) if cap["exit"] == 0 else float("nan")
    walls = " / ".join(f"{x['wall_s']:.2f}" for x in r["restores"])
    print(f"{r['label']:10} {path.stem.rsplit('-', 1)[1]:>5} {capture:10.2f} {walls:>30} "
          f"{all(x['verified'] for x in r['restores']) and bool(r['restores'])}")
    if cap["exit"]:
        print("  capture error:", cap["error"][-1500:])
PY
stop_docker() { kill -TERM "$(cat $D/docker.pid)" 2>/dev/null; }
stop_docker
