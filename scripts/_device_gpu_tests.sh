#!/usr/bin/env bash
# `scripts/device gpu-tests [--dry-run] [PYTEST ARGS...]`: every GPU test of the repository, once, in one call of
# at most 540 s. The tests are chosen by what they say they need (`pytest --gpu-only`: a skip mark whose reason
# names an NVIDIA driver, see tests/conftest.py), not by a list kept here; PYTEST ARGS narrow it further (paths,
# -k EXPR) or split it when a run needs more than one call.
# Carries: .whl (the daemon's wheels and pytest, pytest-asyncio, pytest-timeout, hypothesis), .device-criu42 (or
# .device-criu) for the worker's and the interposer's capture tests. The tests that need the system dockerd
# (tests/runtime: /var/run/docker.sock, which the GPU machine lacks) are deselected and named in the summary.
# What earlier sessions found and this keeps: THP `always` for the run (CRIU fills restored memory with huge pages
# only then), put back afterwards; the checkout's coldsnap_probe before any copy a carried wheel installed; the
# CUDA interposer built once (gcc diagnostics kept) and named in COLDSNAP_CUDA_INTERPOSER_LIBRARY; SIGINT, not
# SIGTERM, at the budget, so pytest runs the fixtures' teardown that kills the torch targets (and frees their
# GPU memory) and still writes the junit XML.
# Results: $OUT/gpu-tests.tar.xz (junit.xml, pytest.txt, build.txt, host.txt, collected.txt, summary.txt) and
# $OUT/summary.txt beside it.
# Exit: pytest's, or 3 when a GPU test skipped on a GPU host for want of a driver.
# Measured before (bench/results/h200-*tests*): the interposer's 10 in 49 s, the hydrator's in 41 s, the worker's,
# canaries' and hydration's in 20-32 s; the whole set is expected in ~3-4 min. Should one run be cut at the budget
# (exit 124), split it in two calls: `scripts/device gpu-tests tests/probe/test_interposer_gpu.py
# tests/probe/test_worker.py tests/probe/test_hydrate.py`, then `scripts/device gpu-tests tests
# --ignore=tests/probe/test_interposer_gpu.py --ignore=tests/probe/test_worker.py --ignore=tests/probe/test_hydrate.py`.
# Environment: GPU_TESTS_BUDGET (default 500: pytest's whole run, seconds), GPU_TEST_TIMEOUT (default 150: one test).
set -uo pipefail
DRY=0
if [ "${1:-}" = --dry-run ]; then DRY=1; shift; fi
source "$(dirname "$0")/_device_env.sh"
export PYTHONPATH="$PWD:$PYTHONPATH"
BUDGET=${GPU_TESTS_BUDGET:-500}
PER_TEST=${GPU_TEST_TIMEOUT:-150}
RUN="$OUT/gpu-tests"
rm -rf "$RUN" && mkdir -p "$RUN"
START=$SECONDS
SUMMARY="$RUN/summary.txt"
: > "$SUMMARY"
step() { echo "== [$((SECONDS - START)) s] $*" | tee -a "$SUMMARY"; }
PYTEST=(python3 -m pytest --gpu-only -p no:cacheprovider -rfEs --tb=short --timeout "$PER_TEST"
        --junitxml "$RUN/junit.xml" -o junit_family=xunit2)

step "the GPU tests this checkout has (collected here: pytest --gpu-only --collect-only)"
python3 -m pytest --gpu-only -p no:cacheprovider --collect-only -q "$@" > "$RUN/collected.txt" 2>&1
grep "::" "$RUN/collected.txt" | cut -d: -f1 | sort | uniq -c | tee -a "$SUMMARY"
tail -1 "$RUN/collected.txt" | tee -a "$SUMMARY"
DESELECT=()
if ! [ -S /var/run/docker.sock ]; then
    # The tests that run a workload through a daemon on the system dockerd (tests/runtime) need one, which the
    # GPU machine lacks (the bundled engine serves the e2e steps); named here so a missing engine is not a pass.
    for test in $(grep "::" "$RUN/collected.txt" | grep "^tests/runtime/"); do DESELECT+=(--deselect "$test"); done
    [ ${#DESELECT[@]} -gt 0 ] && step "no /var/run/docker.sock: deselected $(( ${#DESELECT[@]} / 2 )) tests/runtime test(s): ${DESELECT[*]}"
fi
if [ "$DRY" = 1 ]; then
    step "dry run: would run, bounded by $BUDGET s (SIGINT) and $PER_TEST s a test:"
    echo "   THP=always; COLDSNAP_CUDA_INTERPOSER_LIBRARY=\$OUT/gpu-tests/lib/libcoldsnap_cuda.so (built first)" | tee -a "$SUMMARY"
    echo "   timeout -s INT -k 15 $BUDGET ${PYTEST[*]} ${DESELECT[*]} $*" | tee -a "$SUMMARY"
    exit 0
fi

THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
if [ -w "$THP_FILE" ]; then
    THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
    trap 'echo "$THP_WAS" > "$THP_FILE"' EXIT
    echo always > "$THP_FILE" || true
fi
step "host"
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
  echo "uid $(id -u); THP $(cat $THP_FILE 2>&1)"; criu --version 2>&1 | head -1; nproc; free -g | head -2; } \
    > "$RUN/host.txt" 2>&1
tee -a "$SUMMARY" < "$RUN/host.txt"
[ -x "$CRIU_ROOT/usr/sbin/criu" ] && export COLDSNAP_TEST_CRIU="$CRIU_ROOT/usr/sbin/criu"

step "build libcoldsnap_cuda.so once (the interposer tests preload it)"
timeout 60 python3 - "$RUN/lib" > "$RUN/build.txt" 2>&1 <<'EOF'
import sys
from pathlib import Path
from coldsnap_probe.hydration import build_library
path, diagnostics = build_library(Path(sys.argv[1]))
print(f"built {path}; gcc diagnostics: {diagnostics or 'none'}")
EOF
echo "   build exit $? $(tail -1 "$RUN/build.txt" | cut -c1-300)" | tee -a "$SUMMARY"
[ -f "$RUN/lib/libcoldsnap_cuda.so" ] && export COLDSNAP_CUDA_INTERPOSER_LIBRARY="$RUN/lib/libcoldsnap_cuda.so"

LEFT=$((BUDGET - (SECONDS - START)))
step "pytest --gpu-only, $LEFT s in all, $PER_TEST s a test"
timeout -s INT -k 15 "$LEFT" "${PYTEST[@]}" "${DESELECT[@]}" "$@" > "$RUN/pytest.txt" 2>&1
rc=$?
grep -E "PASSED|FAILED|ERROR|SKIPPED|Timeout|passed|failed|error" "$RUN/pytest.txt" | tail -25 | tee -a "$SUMMARY"
[ $rc -ne 0 ] && sed -n '/= FAILURES =\|= ERRORS =/,$p' "$RUN/pytest.txt" | head -80
# On a GPU host a GPU test that skips for want of a driver is a failure, not a pass (a skip hides it).
if command -v nvidia-smi >/dev/null && grep -qE "^SKIPPED .*(needs an|no) NVIDIA driver" "$RUN/pytest.txt"; then
    step "GPU tests SKIPPED on this GPU host (the driver was not found: libcuda.so.1 on LD_LIBRARY_PATH?)"
    [ $rc -eq 0 ] && rc=3
fi
step "pytest exit $rc ($( [ $rc = 124 ] && echo "cut at the budget: split the run with PYTEST ARGS" || echo done))"
cp "$SUMMARY" "$OUT/summary.txt"
tar -C "$OUT" -cJf "$OUT/gpu-tests.tar.xz" gpu-tests && rm -rf "$RUN"
exit "$rc"
