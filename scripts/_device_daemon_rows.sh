#!/usr/bin/env bash
# Issue 36 item 5 on the H200: each way an engine holds device memory, restored to its first token through a real
# `coldsnap-provider serve` on the bundled Docker Engine, as the controller drives it (bench/e2e_rows.py): the
# capsule's image-build, the engine's workload-run, the worker's capture, --restores restore units, one table.
#   scripts/device daemon-rows [--rows torch,torch-expandable,torch-async,split,uvloop,jax,jax-platform]
#                              [--gib 16] [--restores 3]
# The rows are bench/engine_rows.py's (PyTorch default, expandable_segments:True, backend:cudaMallocAsync, the
# two-process server, JAX's BFC pool and its platform allocator) under the CUDA interposer with one staging node
# hydrator, plus `uvloop` (transformers serve on uvicorn with uvloop, bench/e2e_serve.py's staged interposer path,
# its model folder 32 layers = 16 GB written meanwhile). Expected: ~8 min for every row; should it not fit, two calls
# (`--rows torch,torch-expandable,torch-async,split` then `--rows uvloop,jax,jax-platform`).
# Environment: DRIVER_TIMEOUT bounds the driver (default: what a 590 s call has left after the set-up, less 20 s);
# THP (default always) as in the serve step; IMAGES (default /dev/shm/cs-rows-img) is where the images go (one
# row's at a time). IMAGES_HUGE (e.g. "never always"): the rows run once per value, side by side in this call,
# each with a fresh tmpfs mounted at $IMAGES with that huge= option (issue 35 item 3: the release and CRIU write
# the images into it), results in $OUT/huge-<value>/, then one table of every run's capture phases.
# Carries .device-criu42 (or .device-criu), .device-docker and .whl (and .whl/serve for uvloop).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
source "$(dirname "$0")/_device_daemon.sh"
WORK=/var/tmp/cs-rows
IMAGES=${IMAGES:-/dev/shm/cs-rows-img}
MODEL=/dev/shm/serve-llama-32
SITE=/tmp/serve-site
CAPSULE=coldsnap/capsule-rows:h200
rm -rf "$WORK" "$IMAGES"; mkdir -p "$WORK"
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
trap 'echo "$THP_WAS" > "$THP_FILE"; umount "$IMAGES" 2>/dev/null; rm -rf "$IMAGES"' EXIT
echo "${THP:-always}" > "$THP_FILE" || { echo "cannot set transparent huge pages to ${THP:-always}"; exit 1; }
ROWS=$(python3 -c "
import sys
a = sys.argv[1:]
print(next((x.split('=', 1)[1] for x in a if x.startswith('--rows=')), a[a.index('--rows') + 1] if '--rows' in a[:-1] else ''))
" "$@")
UVLOOP=0
[ -z "$ROWS" ] || [[ ",$ROWS," == *,uvloop,* ]] && UVLOOP=1
# The JAX rows' server runs from the host's venv (bench/e2e_restore.py's Layout.python, /opt/torch mounted): the
# capsule carries the PTX tools its site lacks (serve_capsule's JAX_SITE).
JAX_PYTHON=${JAX_PYTHON:-/opt/torch/.venv/bin/python3}
if [ -z "$ROWS" ] || [[ ",$ROWS," == *,jax* ]]; then
    JAX_SITE=$("$JAX_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") \
        || { echo "no $JAX_PYTHON: the capsule carries no PTX tools"; JAX_SITE=; }
fi

step host
{ nvidia-smi --query-gpu=index,name,driver_version,memory.used --format=csv; free -g; nproc; echo "THP $(cat $THP_FILE)"
  python3 -c "import jax; print('jax', jax.__version__)" 2>&1 | tail -1
  echo "ptxas on PATH: $(command -v ptxas || echo none); /usr/local/cuda: $(readlink -e /usr/local/cuda || echo none)"
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

if [ "$UVLOOP" = 1 ]; then
    step "the uvloop row's model folder (32 layers, 16 GB), in the background"
    serve_model "$MODEL" 32
fi

step "docker engine (bundled)"
start_docker

step "capsule build context: worker, CRIU, the interposer (the server's site for uvloop, PTX tools for jax)"
serve_capsule /tmp/cs-capsule-rows "$([ "$UVLOOP" = 1 ] && echo "$SITE")"

step "coldsnap-provider serve"
start_serve

if [ "$UVLOOP" = 1 ]; then
    step "waiting for the model folder"
    wait_model "$MODEL"
fi

rows() {  # rows OUT_DIR SECONDS ARGS...: one e2e_rows run
    local out=$1 seconds=$2
    shift 2
    mkdir -p "$out"
    timeout "$seconds" python3 bench/e2e_rows.py --state-dir "$STATE" --capsule "$CAPSULE" \
        --build /tmp/cs-capsule-rows="$CAPSULE" --work "$WORK" --out "$out" --images-root "$IMAGES" \
        $([ "$UVLOOP" = 1 ] && echo --model "$MODEL") "$@" 2>&1 | tee "$out/rows.txt"
    echo "e2e_rows exit ${PIPESTATUS[0]}"
}
if [ -z "${IMAGES_HUGE:-}" ]; then
    step "bench/e2e_rows.py $*"
    rows "$OUT" "${DRIVER_TIMEOUT:-$((590 - SECONDS - 20))}" "$@"
else
    set -- ${IMAGES_HUGE} -- "$@"
    HUGES=()
    while [ "$1" != -- ]; do HUGES+=("$1"); shift; done
    shift
    left=${#HUGES[@]}
    for huge in "${HUGES[@]}"; do
        step "bench/e2e_rows.py $* (images on a tmpfs, huge=$huge)"
        rm -rf "$IMAGES"; mkdir -p "$IMAGES"
        mount -t tmpfs -o "size=${IMAGES_GIB:-64}g,huge=$huge" coldsnap-images "$IMAGES" \
            || { echo "cannot mount a tmpfs with huge=$huge at $IMAGES"; exit 1; }
        grep " $IMAGES " /proc/mounts
        rows "$OUT/huge-$huge" "${DRIVER_TIMEOUT:-$(((590 - SECONDS - 20) / left))}" "$@"
        umount "$IMAGES" || umount -l "$IMAGES"; left=$((left - 1))
    done
    step "capture phases, side by side"
    for huge in "${HUGES[@]}"; do
        echo "images on tmpfs huge=$huge"; sed -n '/^| row *| images on/,/^$/p' "$OUT/huge-$huge/rows-table.md"
    done | tee "$OUT/capture-side-by-side.md"
fi
stop_all >> "$OUT/capsule.txt" 2>&1; tail -4 "$OUT/capsule.txt"
