#!/usr/bin/env bash
# Issue 35 item 4 on the H200, from a clean device machine: the tail under faults. `transformers serve`, unchanged,
# under the CUDA interposer with a staging node hydrator (bench/e2e_serve.py's full-interposer-hydrator path),
# captured once through a real `coldsnap-provider serve`, then restored RESTORES times (default 100) with a fault
# in every phase in turn, each followed by a clean restore (bench/restore_faults.py): the capture worker killed in
# cuda-lock / cuda-checkpoint / criu-dump, the restore worker in criu-restore / cuda-restore / hydrate, the node
# hydrator killed during a stage and between restores, the pages image truncated, the pagemap image unreadable.
# After every step: the CUDA driver's state of every GPU process, units left (the daemon's inspect), stages left
# (the hydrator's status).
#   scripts/device faults [LAYERS] [RESTORES]   LAYERS: the model's layers (default 4: the run fits one call)
# Environment: DRIVER_TIMEOUT bounds the driver (default: what a 570 s call has left after the set-up, less 15 s);
# the driver starts no new round past BUDGET_S (default DRIVER_TIMEOUT less 40 s). IMAGES (default
# /dev/shm/cs-faults-img) is where the images and device dumps go.
# Run from the repository root with .device-criu42 (or .device-criu), .device-docker and .whl (the daemon's wheels,
# and under .whl/serve the server's) carried; results in $OUT (faults.json, faults-table.md, faults.txt).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
LAYERS=${1:-4}
RESTORES=${2:-100}
WORK=/var/tmp/cs-faults
IMAGES=${IMAGES:-/dev/shm/cs-faults-img}
MODEL=/dev/shm/serve-llama-$LAYERS
SITE=/tmp/serve-site
PORT=18471
rm -rf "$WORK" "$IMAGES"; mkdir -p "$WORK"
trap 'rm -rf "$IMAGES"' EXIT

step host
{ nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv; nproc; df -h /dev/shm; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "the model folder ($LAYERS layers) and the server's dependencies, in the background"
(if [ ! -f "$MODEL/tokenizer.json" ]; then rm -rf "$MODEL"; python3 engines/engine_llama.py weights "$MODEL" \
     --layers "$LAYERS" > /tmp/weights.log 2>&1 && python3 engines/serve_model.py tokenizer "$MODEL" >> /tmp/weights.log 2>&1; fi
 echo "model exit $?" >> /tmp/weights.log) &
WRITER=$!
[ -d "$SITE" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
    .whl/serve/*.whl || exit 1

step "docker engine (bundled)"
start_docker

step "capsule build context: worker, CRIU, the server's site"
rm -rf /tmp/cs-capsule-serve
python3 scripts/_capsule_rootfs.py /tmp/cs-capsule-serve --busybox $D/usr/bin/busybox-static \
    --criu-root "$CRIU_ROOT" --worker "$ROOT/coldsnap_probe" --server-site "$SITE" \
    --criu-compat scripts/capsule/criu_sockopt_compat.c > "$OUT/capsule.txt" 2>&1 || { tail -20 "$OUT/capsule.txt"; exit 1; }

step "coldsnap-provider serve ([metrics] on: every unit has a report directory, where the workers' live phase is)"
start_serve

step "waiting for the model folder"
wait $WRITER; tail -3 /tmp/weights.log
grep -q "model exit 0" /tmp/weights.log || { cp /tmp/weights.log "$OUT/"; exit 1; }

LIMIT=${DRIVER_TIMEOUT:-$((570 - SECONDS - 15))}
step "bench/restore_faults.py ($RESTORES restores, a fault in every phase in turn; $LIMIT s)"
timeout "$LIMIT" python3 bench/restore_faults.py --state-dir "$STATE" --capsule coldsnap/capsule-serve:h200 \
    --build /tmp/cs-capsule-serve=coldsnap/capsule-serve:h200 --model "$MODEL" --work "$WORK" --out "$OUT" \
    --images-root "$IMAGES" --port $PORT --restores "$RESTORES" --budget-s "${BUDGET_S:-$((LIMIT - 40))}" \
    2>&1 | tee "$OUT/faults.txt"
echo "faults exit ${PIPESTATUS[0]}"
stop_all >> "$OUT/capsule.txt" 2>&1; tail -2 "$OUT/capsule.txt"
