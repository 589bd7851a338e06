#!/usr/bin/env bash
# Tensor-parallel capture and restore on a host with two GPUs (nvidia-h200-x2; CRIU under .device-criu, wheels
# under .whl): cold TP2 engine vs two restores, plus the failures that must stop every rank. See bench/README.md.
#   scripts/device tp-bare [--layers 16] [--tokens 16] [--world-size 2]
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4
timeout -k 5 "${TP2_TIMEOUT:-540}" python3 bench/tp2_restore.py --criu "$(command -v criu)" --out "$OUT" "$@" 2>&1 | tee "$OUT/tp2-restore.txt"
for log in /dev/shm/cs-tp2/engine/rank-*.log; do echo "== $log"; tail -c 3000 "$log"; done > "$OUT/engine-logs.txt" 2>&1
{ echo "== coordinator"; find /dev/shm/cs-tp2/coord -type f | sort | head -80; cat /dev/shm/cs-tp2/coord/*/abort.json 2>/dev/null
  echo "== processes"; ps -eo pid,stat,etime,args | grep -E "engine_tp|coldsnap_probe|criu" | grep -v grep; } > "$OUT/state.txt" 2>&1
