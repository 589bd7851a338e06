#!/usr/bin/env bash
# Issue 34 item 1 on the H200, from a clean device machine: the capture store's whole path through a real
# `coldsnap-provider serve` (with `[docker] capture_store`) on the bundled Docker Engine, runtime-v1 only
# (bench/e2e_store.py): `transformers serve` unchanged, cold and captured (path MODE), image-build of a capsule
# carrying the capture (into the node store), image-push to Debian's docker-registry on 127.0.0.1, image-remove +
# the capture removed from the store + the page cache dropped, image-pull, then RESTORES restores of the pulled
# capsule from a dropped page cache to the first token (identical completions), beside the machine's own rates.
#   scripts/device store [LAYERS] [RESTORES] [MODE]   LAYERS default 16 (8.6 GB of weights): the root disk holds the
#                                                    store's chunks and the capture's files made from them, twice
#                                                    the images (2 x 10.5 GB at 16 layers, ran in ~4 min; the 8B
#                                                    shape's 2 x 19 GB need ~45 GB free: the machine has had 30 and
#                                                    64). MODE default full-interposer-hydrator.
#   scripts/device store [LAYERS] second [MODE]      issue 34's second capture instead (~4 min at 16 layers): two
#                                                    cold servers of the same model, each captured, built into the
#                                                    store and pushed; what the second adds to the store and the
#                                                    registry, by kind of file (no rates, pull or restores).
#   scripts/device store [LAYERS] second-aslr-off    the same, the units' processes without address-space
#                                                    randomisation (personality; the server unchanged).
#   scripts/device store [LAYERS] second-restored    the second capture of the first one restored (to its first
#                                                    token), not of a second cold server.
# Where each part lives: the store (/var/tmp/cs-store/store) and Docker's data on the root disk; the model, the
# capture's images (the build context), the daemon's build spool and the registry's storage on /dev/shm (tmpfs:
# the disk cannot hold them beside the store).
# Carry (64 MiB in all): .device-criu42, .device-docker, .device-registry (docker-registry.xz: `xz -9 -c
# /usr/bin/docker-registry`), and the wheels as .whl-store: .whl less the test wheels (hypothesis, pytest and its
# plugins, pluggy, iniconfig, sortedcontainers) and .whl/serve less uvloop (the server's uvicorn then runs on
# asyncio's loop), named by COLDSNAP_DEVICE_WHEELS=.whl-store (this step's default). Results in $OUT: store.txt,
# store-table.md, store.json, host.txt, daemon.log.
set -uo pipefail
export COLDSNAP_DEVICE_WHEELS=${COLDSNAP_DEVICE_WHEELS:-.whl-store}
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
LAYERS=${1:-16}
RESTORES=${2:-3}
SECOND=()
if [ "$RESTORES" = second ]; then SECOND=(--second-capture); RESTORES=0; fi
if [ "$RESTORES" = second-aslr-off ]; then SECOND=(--second-capture --aslr-off); RESTORES=0; fi
if [ "$RESTORES" = second-restored ]; then SECOND=(--second-capture --recapture-restored); RESTORES=0; fi
MODE=${3:-full-interposer-hydrator}
WORK=/var/tmp/cs-store
SHM=/dev/shm/cs-store
MODEL=/dev/shm/serve-llama-$LAYERS
SITE=/tmp/serve-site
rm -rf "$WORK" "$SHM" "$SITE"; mkdir -p "$WORK" "$SHM/context" "$SHM/spool" "$SHM/registry"
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
trap 'echo "$THP_WAS" > "$THP_FILE"; rm -rf "$WORK" "$SHM" "$MODEL"' EXIT
echo "${THP:-always}" > "$THP_FILE" || { echo "cannot set transparent huge pages to ${THP:-always}"; exit 1; }

step host
{ nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv; free -g; nproc; df -h /dev/shm /var/tmp
  echo "THP $(cat $THP_FILE)"; } > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "the model folder: engine_llama weights ($LAYERS layers) + a local tokenizer, in the background"
serve_model "$MODEL" "$LAYERS"

step "docker-registry"
mkdir -p /tmp/registry-bin
xz -dc .device-registry/docker-registry.xz > /tmp/registry-bin/docker-registry && chmod +x /tmp/registry-bin/docker-registry \
    || { echo "phase 'set-up' failed: carry .device-registry/docker-registry.xz"; exit 2; }
export PATH=/tmp/registry-bin:$PATH

step "docker engine (bundled)"
start_docker

step "capsule build context: worker, CRIU, the server's site (its wheels into $SITE)"
serve_capsule /tmp/cs-capsule-serve "$SITE" > /dev/null \
    || { echo "phase 'set-up' failed: the capsule context"; tail "$OUT/capsule.txt"; exit 1; }

step "coldsnap-provider serve with a capture store"
DOCKER_EXTRA="capture_store = \"$WORK/store\"
spool_dir = \"$SHM/spool\""
start_serve

step "waiting for the model folder"
wait_model "$MODEL"

step "bench/e2e_store.py (mode $MODE, $RESTORES restores, $LAYERS layers)"
timeout -k 5 "${DRIVER_TIMEOUT:-$((590 - SECONDS - 20))}" python3 bench/e2e_store.py --state-dir "$STATE" \
    --capsule coldsnap/capsule-serve:h200 --build /tmp/cs-capsule-serve=coldsnap/capsule-serve:h200 --model "$MODEL" \
    --work "$WORK/work" --out "$OUT" --context "$SHM/context" --store "$WORK/store" --registry-root "$SHM/registry" \
    --mode "$MODE" --restores "$RESTORES" "${SECOND[@]}" 2>&1 | tee "$OUT/store.txt"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "e2e_store.py ran past its time limit (the last '== phase' line above is the last that ended)"
echo "e2e_store exit $rc"
df -h /var/tmp /dev/shm
stop_all >> "$OUT/capsule.txt" 2>&1; tail -4 "$OUT/capsule.txt"
exit "$rc"
