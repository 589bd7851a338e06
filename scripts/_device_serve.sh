#!/usr/bin/env bash
# Issue 23 on the H200, from a clean device machine: `transformers serve`, unchanged, captured and restored
# through a real `coldsnap-provider serve` on the bundled Docker Engine (bench/e2e_serve.py), cold vs
# restored Docker-to-first-token over HTTP, the paths side by side in one run.
#   scripts/device serve [LAYERS] [RESTORES] [MODES]   LAYERS: 32 = the 8B shape (default); fewer for a
#                                                     shakedown, which first runs the server outside Docker
#                                                     (with the adapter, and under the CUDA interposer when
#                                                     MODES has a full-interposer path; SMOKE=0 skips it; stdio
#                                                     to $OUT/smoke*.log). MODES: comma list of
#                                                     full-interposer-hydrator, full-interposer, full, adapter,
#                                                     adapter-hydrator (default full-interposer-hydrator,
#                                                     full-interposer,adapter-hydrator,full); the fault cases
#                                                     (forked workers included) run on the first of
#                                                     full-interposer/adapter/full that restored (a path with
#                                                     a node hydrator has removed it by then).
# Environment: DRIVER_TIMEOUT bounds the driver (default: what a 590 s call has left after the set-up, less 20 s); FAULTS=0 leaves the fault cases out; THP (default always) is the node's transparent
# huge page mode for the run, put back afterwards; IMAGES (default /dev/shm/cs-serve-img) is where the images
# and device dumps go; CRIU_THREADS sets CRIU_RESTORE_THREADS in the units (default unset: the CPUs CRIU may
# use). The CUDA stack limit and a discarded KV cache need a call inside the server: not set for an unchanged one.
# Run from the repository root with .device-criu42 (or .device-criu), .device-docker and .whl (the daemon's
# wheels, and under .whl/serve the server's: fastapi, starlette, uvicorn, pydantic, openai and theirs)
# carried; results in $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
LAYERS=${1:-32}
RESTORES=${2:-3}
MODES=${3:-full-interposer-hydrator,full-interposer,adapter-hydrator,full}
WORK=/var/tmp/cs-serve
IMAGES=${IMAGES:-/dev/shm/cs-serve-img}
MODEL=/dev/shm/serve-llama-$LAYERS
SITE=/tmp/serve-site
PORT=18471
rm -rf "$WORK" "$IMAGES"; mkdir -p "$WORK"
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
trap 'echo "$THP_WAS" > "$THP_FILE"; rm -rf "$IMAGES"' EXIT
echo "${THP:-always}" > "$THP_FILE" || { echo "cannot set transparent huge pages to ${THP:-always}"; exit 1; }

step host
{ nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv; free -g; nproc; df -h /dev/shm /var/tmp
  echo "THP $(cat $THP_FILE)"; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "the model folder: engine_llama weights ($LAYERS layers, bf16, fixed seed) + a local tokenizer, in the background"
serve_model "$MODEL" "$LAYERS"

step "docker engine (bundled)"
start_docker

step "capsule build context: worker, CRIU, the server's site (its wheels into $SITE)"
serve_capsule /tmp/cs-capsule-serve "$SITE"

step "coldsnap-provider serve"
start_serve

step "waiting for the model folder"
wait_model "$MODEL"

if [ "$LAYERS" -lt 32 ] && [ "${SMOKE:-1}" = 1 ]; then
    step "smoke: the server outside Docker, with the adapter, one request"
    (cd /tmp && exec env PYTHONPATH="$ROOT/coldsnap_probe/adapters:$ROOT:$SITE" COLDSNAP_HYDRATION_SOCKET=/tmp/smoke-hyd.sock \
        HF_HUB_OFFLINE=1 timeout 150 /opt/torch/.venv/bin/transformers serve "$MODEL" --device cuda:0 \
        --host 127.0.0.1 --port 18470 > "$OUT/smoke.log" 2>&1) &
    SMOKE=$!
    timeout 160 python3 -c "
import anyio, sys, json
from bench.serve_client import stream_chat, chat_request
done = anyio.run(lambda: stream_chat('127.0.0.1', 18470, chat_request('$MODEL', 'Hello , world !', max_tokens=8),
                                     connect_limit=140))
print(json.dumps({'smoke_text': done.text, 'chunks': done.chunks, 'finish': done.finish_reason}))
" 2>&1 | tail -5
    kill $SMOKE; wait $SMOKE; tail -15 "$OUT/smoke.log"
    if [[ ",$MODES," == *,full-interposer,* || ",$MODES," == *,full-interposer-hydrator,* ]]; then
        step "smoke: the server outside Docker under the CUDA interposer (the capsule's library), one request"
        LIB=/tmp/cs-capsule-serve/rootfs/opt/coldsnap/lib/libcoldsnap_cuda.so
        rm -f /tmp/smoke-cuda-*.sock
        (cd /tmp && exec env PYTHONPATH="$SITE" LD_PRELOAD="$LIB" COLDSNAP_CUDA_INTERPOSER_SOCKET=/tmp/smoke-cuda-%p.sock \
            HF_HUB_OFFLINE=1 timeout 150 /opt/torch/.venv/bin/transformers serve "$MODEL" --device cuda:0 \
            --host 127.0.0.1 --port 18470 > "$OUT/smoke-interposer.log" 2>&1) &
        SMOKE=$!
        timeout 160 python3 -c "
import anyio, glob, json
from bench.serve_client import stream_chat, chat_request
from coldsnap_probe.hydration import interposer_request
done = anyio.run(lambda: stream_chat('127.0.0.1', 18470, chat_request('$MODEL', 'Hello , world !', max_tokens=8),
                                     connect_limit=140))
sockets = glob.glob('/tmp/smoke-cuda-*.sock')
status = [interposer_request(s, {'op': 'status'}, 'status') for s in sockets]
print(json.dumps({'smoke_text': done.text, 'chunks': done.chunks, 'sockets': sockets, 'status': status})[:3000])
assert sockets and all(s.get('regions') for s in status), 'no allocation of the server went through the interposer'
" 2>&1 | tail -8
        kill $SMOKE; wait $SMOKE; tail -15 "$OUT/smoke-interposer.log"
    fi
fi

step "bench/e2e_serve.py (modes $MODES, $RESTORES restores, faults)"
timeout "${DRIVER_TIMEOUT:-$((590 - SECONDS - 20))}" python3 bench/e2e_serve.py --state-dir "$STATE" --capsule coldsnap/capsule-serve:h200 \
    --build /tmp/cs-capsule-serve=coldsnap/capsule-serve:h200 --model "$MODEL" --work "$WORK" --out "$OUT" \
    --images-root "$IMAGES" --port $PORT --restores "$RESTORES" --modes "$MODES" ${CRIU_THREADS:+--criu-threads "$CRIU_THREADS"} \
    $([ "${FAULTS:-1}" = 1 ] && echo --faults) 2>&1 | tee "$OUT/serve.txt"
echo "e2e exit ${PIPESTATUS[0]}"
stop_all >> "$OUT/capsule.txt" 2>&1; tail -4 "$OUT/capsule.txt"
