#!/usr/bin/env bash
# Issues 12 item 4 and 22 item 3 on the H200, from a clean device machine, in one call of at most 600 s:
# bench/e2e_modes.py (the steps: bench/e2e_restore.py) against a real `coldsnap-provider serve` on the bundled Docker
# Engine, cold vs restored Docker-to-first-token of the 8B-shaped engine (engines/engine_llama.py, 16 GiB of
# weights written first) in capsule containers, the modes side by side in one run.
#   scripts/device e2e [--smoke] [MODES] [BUDGET_S]
#     MODES: comma list of interposer,interposer-hydrator,hydrator,hydrate,full (default
#            interposer,interposer-hydrator,hydrator,full: the engine without cooperation under the CUDA
#            interposer, filling itself or staged by a node hydrator; the cooperative hydrator; the full image);
#     BUDGET_S: a later mode is not started past this many seconds of the driver (default: what the call has
#            left minus 150 s, the slowest mode's share);
#     --smoke: 2 layers, modes interposer,interposer-hydrator (or MODES), one restore each: a first check in
#            ~120 s.
# Environment: RESTORES (default 3; 1 with --smoke); THP (default always) is the node's transparent huge page
# mode for the run, put back afterwards; IMAGES (default /dev/shm/cs-e2e-img) is where the images and the
# interposer's device dumps go; CRIU_THREADS sets CRIU_RESTORE_THREADS in the units (default: the CPUs the
# unit may use); STACK_BYTES (default 256) is the cooperative engine's CUDA stack limit (the engine without
# cooperation is never asked); CALL_S (default 590) is the call's whole budget.
# Run from the repository root with .device-criu42 (or .device-criu), .device-docker and .whl carried
# (prometheus_client's wheel included); results go to $OUT: e2e.txt, e2e.json, e2e-table.md, host.txt,
# metrics-e2e.txt (the daemon's scrape after the restores) and audit.jsonl.
set -uo pipefail
SMOKE=0
if [ "${1:-}" = --smoke ]; then SMOKE=1; shift; fi
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
CALL_S=${CALL_S:-590}
WORK=/var/tmp/cs-e2e
IMAGES=${IMAGES:-/dev/shm/cs-e2e-img}
if [ "$SMOKE" = 1 ]; then
    LAYERS=2; MODES=${1:-interposer,interposer-hydrator}; RESTORES=${RESTORES:-1}
else
    LAYERS=32; MODES=${1:-interposer,interposer-hydrator,hydrator,full}; RESTORES=${RESTORES:-3}
fi
WEIGHTS=/dev/shm/engine-llama-$LAYERS
rm -rf "$WORK" "$IMAGES"; mkdir -p "$WORK"
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
trap 'echo "$THP_WAS" > "$THP_FILE"; rm -rf "$IMAGES"' EXIT
echo "${THP:-always}" > "$THP_FILE" || { echo "cannot set transparent huge pages to ${THP:-always}"; exit 1; }

step host
{
    nvidia-smi --query-gpu=index,uuid,name,driver_version,memory.used --format=csv
    df -h / /dev/shm /var/tmp; free -g; nproc; echo "THP $(cat $THP_FILE) (was $THP_WAS)"
    echo "CRIU $CRIU_ROOT: $(criu --version 2>&1 | head -1)"
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "engine weights ($LAYERS layers, bf16, fixed seed) written once to $WEIGHTS, in the background"
(rm -rf "$WEIGHTS"; /usr/bin/time -f "weights written in %e s" python3 engines/engine_llama.py weights "$WEIGHTS" \
     --layers "$LAYERS" > /tmp/weights.log 2>&1
 echo "weights exit $?" >> /tmp/weights.log) &
WRITER=$!

step "docker engine (bundled)"
start_docker

step "capsule build contexts: with the worker and the CUDA interposer (engine capsule), without (the bad-input case)"
{ capsule_context /tmp/cs-capsule-engine --worker; capsule_context /tmp/cs-capsule-plain; } 2>&1 | tee "$OUT/capsule.txt"
if ! ls -la /tmp/cs-capsule-engine/rootfs/opt/coldsnap/lib/libcoldsnap_cuda.so; then
    # The other modes still run (their rows are worth the call); the driver would refuse these at its check.
    MODES=$(tr ',' '\n' <<< "$MODES" | grep -v '^interposer' | paste -sd, -)
    echo "the engine capsule has no CUDA interposer: the interposer modes are left out (modes now: ${MODES:-none})"
    [ -n "$MODES" ] || exit 1
fi

step "coldsnap-provider serve"
start_serve

step "waiting for the weights"
wait $WRITER; tail -4 /tmp/weights.log; ls -la "$WEIGHTS"
grep -q "weights exit 0" /tmp/weights.log || { cp /tmp/weights.log "$OUT/"; exit 1; }

# What the call has left, less 25 s for the scrape and teardown; the last mode must start with 150 s to go.
DRIVER_S=$((CALL_S - SECONDS - 25))
BUDGET=${2:-$((DRIVER_S - 150))}
step "bench/e2e_modes.py (modes $MODES, $RESTORES restores each, driver ${DRIVER_S} s, modes started until ${BUDGET} s)"
timeout "$DRIVER_S" python3 bench/e2e_modes.py --state-dir "$STATE" --capsule coldsnap/capsule-engine:h200 \
    --plain-capsule coldsnap/capsule-probe:h200 --build /tmp/cs-capsule-engine=coldsnap/capsule-engine:h200 \
    --build /tmp/cs-capsule-plain=coldsnap/capsule-probe:h200 --weights "$WEIGHTS" --work "$WORK" --out "$OUT" \
    --images-root "$IMAGES" --modes "$MODES" --budget "$BUDGET" --restores "$RESTORES" \
    --stack-bytes "${STACK_BYTES:-256}" ${CRIU_THREADS:+--criu-threads "$CRIU_THREADS"} 2>&1 | tee "$OUT/e2e.txt"
echo "e2e exit ${PIPESTATUS[0]}"

step "metrics: the restore phases the capsules reported, as Prometheus scrapes them"
save_scrape e2e 2>&1 | tee "$OUT/metrics-phases.txt"
stop_all >> "$OUT/capsule.txt" 2>&1; tail -4 "$OUT/capsule.txt"
