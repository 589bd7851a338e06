#!/usr/bin/env bash
# Why the driver's CUDA restore of a JAX process fails (issue 36): bench/jax_restore_diag.py's matrix of cases
# (minimal JAX and torch programs, engines/jax_server.py; in place without CRIU, through the workers, and the
# restore by hand), each with the worker's errors, the driver's answers, dmesg, the process's maps, threads and
# descriptors before the dump and after CRIU's restore (a CRIU hook), and whether it answers as before.
#   scripts/device jaxdiag [--cases a,b,...] [--budget 280]
# Carries .device-criu42 (or .device-criu). THP `always` for the run, as gpu-tests has it. Expected: <= 300 s.
# Results: $OUT/jaxdiag.txt (everything printed), jaxdiag.json, work/<case>/snaps (the /proc snapshots).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
export PYTHONPATH="$PWD:$PYTHONPATH"  # this checkout's coldsnap_probe before any copy a carried wheel installed
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
if [ -w "$THP_FILE" ]; then
    THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
    trap 'echo "$THP_WAS" > "$THP_FILE"' EXIT
    echo always > "$THP_FILE" || true
fi
echo "THP $(cat $THP_FILE 2>&1); $(criu --version 2>&1 | head -1)"
timeout -s INT -k 20 560 python3 bench/jax_restore_diag.py --criu "$(command -v criu)" --out "$OUT" "$@"
