#!/usr/bin/env bash
# The CUDA interposer on a fresh GPU host (issues 22 and its reviews), in one run well within 200 s (each step has
# its own timeout; the run ends by ~185 s whatever happens):
#   scripts/device interposer [--sizes 2] [--modes interposer] [--fast]
# --fast: steps 1-3 only (build, smoke, the driver's answers): the quickest answer to "does it load" (~40 s).
# The interposer's GPU tests (tests/probe/test_interposer_gpu.py and the rest) are in `scripts/device gpu-tests`.
# carries: .device-criu42 or .device-criu (CRIU), .whl (the daemon's wheels). Steps, each logged with its elapsed
# time; a failing step does not stop the independent ones after it; everything a failure says is printed:
#   1. build libcoldsnap_cuda.so (gcc -Wall -Wextra -Werror) and list its exports (the gated cu* names counted);
#   2. smoke: an unchanged torch process under the preload allocates, computes, reports its regions and the copy
#      engine's configuration; `unwrapped` must be [] (every entry point the runtime resolved went through us),
#      `request_s` 10 and `operation` null;
#   3. how THIS driver's cuGetProcAddress answers "cuCtxSynchronize" and "cuCtxSynchronize_v2" at 13000 and
#      "cuMemPrefetchAsync" at 12.1/12.2/12.8/13.0 (no preload): the plain cuCtxSynchronize must stay the
#      argument-less function, the _v2 name its own; where the prefetch switches ABI is for the record;
#   4. bench/restore_ttft.py at 2 GiB (a fresh host generates the weights file first: 16 GiB took the whole
#      budget once): the interposer row, each stage printed as it happens.
# Everything lands in $OUT: build.txt, exports.txt, smoke.txt, procaddress.txt, restore_ttft.txt/.json
# (partial.json after each mode), summary.txt.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
export PYTHONPATH="$PWD:$PYTHONPATH"  # this checkout's coldsnap_probe before any copy a carried wheel installed
SIZES=2
MODES=interposer
FAST=0
while [ $# -gt 0 ]; do
    case "$1" in
        --sizes) SIZES="$2"; shift 2 ;;
        --modes) MODES="$2"; shift 2 ;;
        --fast) FAST=1; shift ;;
        *) echo "unknown argument $1"; exit 2 ;;
    esac
done
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
if [ -w "$THP_FILE" ]; then  # CRIU fills the restored memory with huge pages only under `always`
    THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
    trap 'echo "$THP_WAS" > "$THP_FILE"' EXIT
    echo always > "$THP_FILE" || true
fi
START=$SECONDS
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
step() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$SUMMARY"; }
result() { echo "   -> $1 (exit $2, at $((SECONDS - START)) s)" | tee -a "$SUMMARY"; }

step "host"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$SUMMARY"
criu --version 2>&1 | head -1 | tee -a "$SUMMARY"

step "1. build libcoldsnap_cuda.so"
LIB_DIR="$OUT/lib"
timeout 60 python3 - "$LIB_DIR" > "$OUT/build.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path
from coldsnap_probe.hydration import build_library
path, diagnostics = build_library(Path(sys.argv[1]))
print(f"built {path}; gcc diagnostics: {diagnostics or 'none'}")
EOF
rc=$?
cat "$OUT/build.txt" | tail -5
nm -D --defined-only "$LIB_DIR/libcoldsnap_cuda.so" > "$OUT/exports.txt" 2>&1
result "build (exports: $(wc -l < "$OUT/exports.txt"), gated cu* names: $(grep -c ' T cu' "$OUT/exports.txt"))" $rc
export COLDSNAP_CUDA_INTERPOSER_LIBRARY="$LIB_DIR/libcoldsnap_cuda.so"

step "2. smoke: torch under the preload"
SMOKE_DIR=$(mktemp -d /tmp/cs-smoke-XXXX)
chmod 700 "$SMOKE_DIR"
timeout 45 env LD_PRELOAD="$COLDSNAP_CUDA_INTERPOSER_LIBRARY" COLDSNAP_CUDA_INTERPOSER_SOCKET="$SMOKE_DIR/cuda-%p.sock" \
    python3 - > "$OUT/smoke.txt" 2>&1 <<'EOF'
import os, time, torch
from coldsnap_probe.jsonline import request
x = torch.randn(64 << 20, device="cuda")
w = torch.randn(4096, 4096, device="cuda")
y = (w @ w).sum().item()
path = os.environ["COLDSNAP_CUDA_INTERPOSER_SOCKET"].replace("%p", str(os.getpid()))
status = request(path, {"op": "status"})
print("matmul", y, "sum", x.sum().item())
print("status", {k: v for k, v in status.items() if k not in ("wrapped", "uncovered")})
print("uncovered", {k: v for k, v in status["uncovered"].items() if v["count"]})
print("wrapped entry points", status["wrapped"])
assert status["regions"] > 0, "no allocation went through the interposer"
assert status["unwrapped"] == [], status["unwrapped"]
assert status["request_s"] == 10 and status["operation"] is None
print("SMOKE OK")
EOF
rc=$?
tail -6 "$OUT/smoke.txt"
result "smoke" $rc
rm -rf "$SMOKE_DIR"

step "3. the driver's answer for cuCtxSynchronize(_v2) and cuMemPrefetchAsync by version"
timeout 60 python3 - > "$OUT/procaddress.txt" 2>&1 <<'PY'
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
assert cuda.cuInit(0) == 0
gpa = cuda.cuGetProcAddress_v2
gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ctypes.c_uint64,
                ctypes.POINTER(ctypes.c_int)]
names = {ctypes.cast(getattr(cuda, n), ctypes.c_void_p).value: n for n in (
    "cuCtxSynchronize", "cuCtxSynchronize_v2", "cuMemPrefetchAsync", "cuMemPrefetchAsync_v2") if hasattr(cuda, n)}
for symbol, version in (("cuCtxSynchronize", 13000), ("cuCtxSynchronize_v2", 13000), ("cuMemPrefetchAsync", 12010),
                        ("cuMemPrefetchAsync", 12020), ("cuMemPrefetchAsync", 12080), ("cuMemPrefetchAsync", 13000)):
    fn, status = ctypes.c_void_p(), ctypes.c_int()
    rc = gpa(symbol.encode(), ctypes.byref(fn), version, 0, ctypes.byref(status))
    print(f"{symbol}@{version} -> rc {rc}: {names.get(fn.value, hex(fn.value or 0))}")
PY
rc=$?
tee -a "$SUMMARY" < "$OUT/procaddress.txt"
result "procaddress" $rc
[ "$FAST" = 1 ] && { step "done (--fast)"; exit 0; }

step "4. bench/restore_ttft.py --sizes $SIZES --modes $MODES"
rm -rf /dev/shm/cs-img
LEFT=$((180 - (SECONDS - START)))  # the whole run ends by ~185 s: the bench gets what is left (its rows run in
[ "$LEFT" -lt 20 ] && LEFT=20      # --modes order, each one's result saved as soon as it is done)
echo "   bench budget: $LEFT s" | tee -a "$SUMMARY"
timeout "$LEFT" python3 bench/restore_ttft.py --criu "$(command -v criu)" --out "$OUT" --sizes "$SIZES" \
    --modes "$MODES" --tokens 16 --stack-bytes 256 --images-root /dev/shm/cs-img --root /tmp/cs \
    2>&1 | tee "$OUT/restore_ttft.txt" | grep --line-buffered -E "^\[|FAILED|Error|GiB" | cut -c1-300
rc=${PIPESTATUS[0]}
result "restore_ttft" $rc
if [ ! -f "$OUT/restore_ttft.json" ] && [ -f "$OUT/restore_ttft.partial.json" ]; then
    python3 - "$OUT/restore_ttft.partial.json" <<'EOF' | tee -a "$SUMMARY"
import json, sys
for r in json.load(open(sys.argv[1])):
    best = min(r["restores"], key=lambda x: x["ttft_s"])
    print(f"{r['gib']:g} GiB {r['mode']}: cold {r['cold']['ttft_s']:.2f} s, restore TTFT {best['ttft_s']:.2f} s "
          f"(CRIU {best['criu_restore_s']:.2f}, CUDA {best['cuda_restore_s']:.2f}, hydrate {best['wake_s']:.2f}), "
          f"capture {r['capture']}, identical {all(x['tokens_identical'] and x['logits_identical'] for x in r['restores'])}")
EOF
fi
mkdir -p "$OUT/logs"  # the servers', CRIU's and the hydrator's logs of any row that failed (a passed row's are removed)
find /tmp/cs /dev/shm/cs-img -maxdepth 2 -name '*.log' -size -20M -exec cp --parents {} "$OUT/logs/" \; 2>/dev/null
rm -rf /dev/shm/cs-img
step "done"
