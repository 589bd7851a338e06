#!/usr/bin/env bash
# Issues 27/28 through the daemon, on one host of N GPUs (nvidia-h200-x2 / x4 / x8): bench/e2e_tp.py against a real
# `coldsnap-provider serve` on the bundled Docker Engine, every rank of engines/engine_tp.py in its own capsule unit
# (its own GPU, host network), a node hydrator per GPU, cold vs restores of one capture, the failures that must stop
# every rank. Run from the repository root with .device-criu, .device-docker and .whl carried; results go to
# $OUT/tp$N-$SIZE.
#   scripts/device tp N SIZE [STEP] [options of bench/e2e_tp.py]
# N: the world size (2, 4, 8). SIZE: small, 70b (Llama-3-70B layer shapes) or 405b (the largest layer count
# that fits). STEP, each within the 600 s a command may run (a warm machine keeps /dev/shm between calls):
#   plan      print the plan and the commands, check the memory budget; runs on a CPU machine, needs no GPU
#   weights   write every rank's weights once, all ranks at once, to /dev/shm (enlarged first when too small)
#   run       node hydrators, the cold engine, capture, RESTORES (default 3) restores, nothing downgraded
#   failures  the failure cases on run's capture, then one more restore
#   all       weights + run + failures in one call (the small size)
# MEMORY_LIMIT: host memory the run may use (default: the lent machine's, 256G / 512G / 560G for 2 / 4 / 8 GPUs);
# the memory cgroup's memory.max wins when smaller. MemTotal is never used: it reads low at first there.
set -uo pipefail
N=${1:?usage: scripts/device tp N SIZE [plan|weights|run|failures|all] [bench options]}
SIZE=${2:?usage: scripts/device tp N SIZE [plan|weights|run|failures|all] [bench options]}
STEP=${3:-all}
shift 2; [ $# -gt 0 ] && shift
case "$N" in 2) MEM=256G ;; 4) MEM=512G ;; 8) MEM=560G ;; *) MEM=$((N * 70))G ;; esac
MEMORY_LIMIT=${MEMORY_LIMIT:-$MEM}
WORK=${TP_WORK:-/dev/shm/cs-e2e-tp}
PLAN=(--world-size "$N" --shape "$SIZE" --memory-limit "$MEMORY_LIMIT")
BENCH=(bench/e2e_tp.py "${PLAN[@]}" --work "$WORK" --restores "${RESTORES:-3}")
case "$STEP" in plan|weights|run|failures|all) ;; *) echo "unknown step $STEP"; exit 2 ;; esac
if [ "$STEP" = all ] && [ "$SIZE" != small ]; then  # weights alone can take minutes at this size
    echo "step all is for the small size: run $SIZE as weights, run, failures (one call each, within 600 s)"; exit 2
fi

if [ "$STEP" = plan ]; then  # CPU-only: what would run, and whether it fits
    python3 bench/tp_plan.py "${PLAN[@]}" --work "$WORK" "$@"; RC=$?
    echo "would run, one command each (nvidia-h200-x$N):"
    for step in weights run failures; do echo "  scripts/device tp $N $SIZE $step"; done
    echo "  = python3 ${BENCH[*]} --phase STEP --state-dir ... --capsule coldsnap/capsule-engine:h200 --out \$OUT/tp$N-$SIZE"
    exit "$RC"
fi

OUT="${OUT:-$PWD/device-out}/tp$N-$SIZE"
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
step host
{ nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.used --format=csv; nvidia-smi topo -m | head -$((N + 2))
  cat /sys/fs/cgroup/memory.max 2>/dev/null; grep -E "MemTotal|MemAvailable" /proc/meminfo; df -h /dev/shm; } \
    2>&1 | tee -a "$OUT/host.txt"
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$GPUS" -ge "$N" ] || { echo "TP$N needs $N GPUs, this host has $GPUS"; exit 2; }
python3 bench/tp_plan.py "${PLAN[@]}" --work "$WORK" | tee "$OUT/plan.txt" || { echo "the plan does not fit"; exit 2; }
NEED=$(python3 bench/tp_plan.py "${PLAN[@]}" --work "$WORK" --json | python3 -c \
    'import json, sys; p = json.load(sys.stdin); print(p["shm_needed"] if (p["shm_size"] or 0) < p["shm_needed"] else 0)')
if [ "$NEED" -gt 0 ]; then  # tmpfs size is a limit, not an allocation: the plan checked the memory behind it
    step "enlarging /dev/shm to $((NEED >> 30)) GiB + 8"; mount -o remount,size=$(((NEED >> 20) + 8192))M /dev/shm || exit 1
fi
mkdir -p "$WORK"

if [ "$STEP" = weights ]; then
    step "bench/e2e_tp.py --phase weights"
    timeout -k 5 "${TP_TIMEOUT:-570}" python3 "${BENCH[@]}" --phase weights --out "$OUT" "$@" 2>&1 | tee "$OUT/weights.txt"
    RC=${PIPESTATUS[0]}; cat "$WORK"/weights-*/write-*.log > "$OUT/weights-logs.txt" 2>&1; exit "$RC"
fi
step "docker engine (bundled)"; start_docker
step "capsule build context (with the worker)"; capsule_context /tmp/cs-capsule-engine --worker > "$OUT/capsule.txt" 2>&1
step "coldsnap-provider serve"; start_serve "-$STEP"
step "bench/e2e_tp.py --phase $STEP $*"
timeout -k 5 "${TP_TIMEOUT:-540}" python3 "${BENCH[@]}" --phase "$STEP" --state-dir "$STATE" \
    --capsule coldsnap/capsule-engine:h200 --build /tmp/cs-capsule-engine=coldsnap/capsule-engine:h200 --out "$OUT" \
    "$@" 2>&1 | tee "$OUT/e2e-tp-$STEP.txt"
RC=${PIPESTATUS[0]}
echo "e2e-tp $STEP exit $RC"
for log in "$WORK"/run/rank-*.log "$WORK"/run/launch-*.log; do echo "== $log"; tail -c 2500 "$log"; done \
    > "$OUT/engine-logs-$STEP.txt" 2>&1
{ find "$WORK/coord" -type f | sort | head -200; cat "$WORK"/coord/*/abort.json 2>/dev/null; } > "$OUT/coord-$STEP.txt" 2>&1
save_scrape "e2e-tp-$STEP" > "$OUT/metrics-phases-$STEP.txt" 2>&1
stop_all >> "$OUT/capsule.txt" 2>&1; tail -4 "$OUT/capsule.txt"
exit "$RC"
