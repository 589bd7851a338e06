#!/usr/bin/env bash
# The restore-to-first-token benchmark on a GPU host (CRIU under .device-criu, wheels under .whl).
#   [THP=always|madvise|never] scripts/device ttft [--sizes 16,32,64] [--modes hydrate] [--strategy hydrator]
#                       [--hydrate-bench 8] [--images-root /dev/shm/cs-img] [--tokens 32] [--stack-bytes 0,256]
#                       [--memory eager,lazy] [--kv kept,discarded] [--rows torch,torch-expandable,torch-async,...]
# Weights live in /dev/shm (one file, generated once for the largest size); see bench/README.md.
# THP: the node's transparent-huge-page mode for this run (restored afterwards); CRIU fills the restored
# process's anonymous memory with huge pages only under `always`.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
THP_FILE=/sys/kernel/mm/transparent_hugepage/enabled
if [ -n "${THP:-}" ]; then
    THP_WAS=$(sed 's/.*\[\(.*\)\].*/\1/' "$THP_FILE")
    trap 'echo "$THP_WAS" > "$THP_FILE"' EXIT
    echo "$THP" > "$THP_FILE" || { echo "cannot set transparent huge pages to $THP"; exit 1; }
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
df -h /tmp /dev/shm | tail -2
python3 bench/restore_ttft.py --criu "$(command -v criu)" --out "$OUT" "$@"
