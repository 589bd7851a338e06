#!/usr/bin/env bash
# A node hydrator's stage that misses the RAM tier, by reader, on the GPU machine (issues 34 and 35): the ring
# against registered windows (hydration/_windows.py) and `auto`, a 16 and a 64 GiB dump on a tmpfs mounted
# huge=always (2 MiB pages, as the daemon rows' IMAGES_HUGE=always) and huge=never (4 KiB pages, as /dev/shm),
# side by side (bench/stage_reader.py, about 2-3 minutes), then the registered windows' GPU tests.
#   scripts/device stage-reader [GIB] [MOUNTS]   GIB: sizes (default 16,64); MOUNTS: huge= options (always,never)
# Carries .whl; results (stage-reader.txt: the table; stage-reader.json; stage-reader-test.txt) go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; free -g | head -2; nproc
  echo "shmem_enabled: $(cat /sys/kernel/mm/transparent_hugepage/shmem_enabled 2>&1)"; } 2>&1 | tee "$OUT/host.txt"
timeout -s INT -k 10 230 python3 bench/stage_reader.py --gib "${1:-16,64}" --mounts "${2:-always,never}" \
    --budget 170 --out "$OUT" 2>&1 | tee "$OUT/stage-reader-run.txt"
rc=${PIPESTATUS[0]}
grep -o '/tmp/cs-stage-reader-[^ ]*' /proc/mounts | xargs -r -n1 umount 2>/dev/null  # a run cut short
timeout -k 5 90 python3 -m pytest -q -p no:cacheprovider -s tests/probe/test_windows.py 2>&1 \
    | tee "$OUT/stage-reader-test.txt" | tail -15
tests=${PIPESTATUS[0]}
[ "$rc" = 0 ] && rc=$tests
exit "$rc"
