#!/usr/bin/env bash
# What bounds a node hydrator's stage that misses the RAM tier, on the GPU machine (issue 35: 64 GiB staged at 15-40
# GB/s against the link's ~54): the ring by reader threads x read size, beside the same reads with no device, a 64 GiB
# dump on a tmpfs mounted huge=never (as /dev/shm) and huge=always, with the kernel's reclaim and compaction counted
# per row (bench/stage_ring.py, about 2 minutes).
#   scripts/device stage-ring [GIB] [RINGS] [MOUNTS]   GIB: the dump (default 64); RINGS: threads x read size
#       (default bench/stage_ring.py's: 16x8M,8x8M,16x2M,8x2M,16x1M,32x2M,16x32M); MOUNTS: huge= (never,always)
# Carries .whl; results (stage-ring.txt: the table and the host; stage-ring.json; stage-ring-run.txt) go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; nvidia-smi topo -m; free -g | head -2
  lscpu | grep -E "^(CPU\(s\)|Model name|NUMA|L3|Thread|Socket)"; } 2>&1 | tee "$OUT/host.txt"
timeout -s INT -k 10 200 python3 bench/stage_ring.py --gib "${1:-64}" ${2:+--rings "$2"} \
    --mounts "${3:-never,always}" --budget 170 --out "$OUT" 2>&1 | tee "$OUT/stage-ring-run.txt"
rc=${PIPESTATUS[0]}
grep -o '/tmp/cs-stage-ring-[^ ]*' /proc/mounts | xargs -r -n1 umount -l 2>/dev/null  # a run cut short
exit "$rc"
