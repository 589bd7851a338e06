#!/usr/bin/env bash
# CRIU's parallel private-page restore on the GPU machine: bench/criu_restore.py at 16 GiB (about 2 minutes),
# CRIU_RESTORE_THREADS=1 (stock) against N = the machine's CPUs, images on tmpfs, in the page cache and on a cold
# disk, with the disk's read rate and the page_fill ceiling measured in the same run.
#   scripts/device criu shape   instead: CRIU's dump and restore of a 2 GiB process 55 % written with zeros, pages
#                               of zeros written (stock) vs left out (zero-pages.patch) vs released, side by side
#                               (bench/criu_dump_shape.py, best of 3, about 40 s): criu-dump-shape.txt, its JSON.
#   scripts/device criu phases  instead: CRIU's restore of an engine-shaped CPU process (100 threads, 300 libraries,
#                               1.1 GB), phase by phase from CRIU's log, without and with the kernel-feature cache
#                               (bench/criu_restore_phases.py, 5 restores a variant, about 40 s): criu-phases.txt.
#   scripts/device criu start   instead: the restore worker's path from its main to CRIU's start, a small CPU
#                               process restored 20 times with the images' carried kernel-feature cache hidden
#                               (the worker probes) and as captured (no probe), then one restore's imports under
#                               -X importtime (bench/path_to_criu.py, about 20 s): path-to-criu.txt. BEFORE=DIR: a
#                               directory holding an older coldsnap_probe (`git archive REF coldsnap_probe | tar -x
#                               -C DIR`, carried), restored side by side.
#   scripts/device criu threads instead: CRIU's dump of a server-shaped process (1.14 GB of pages, 100 threads),
#                               stock vs dump-threads.patch's threads (1, 4, the CPUs), images on a tmpfs mounted
#                               huge=always as the capture's (bench/criu_dump_threads.py, best of 3, about 60 s):
#                               criu-dump-threads.txt, its JSON.
# Run from the repository root as root with .device-criu42 (scripts/criu/build --bundle .device-criu42) and .whl
# carried; results (criu-restore.txt: the table; criu_restore.json; criu-env.txt) go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
if [ ! -x .device-criu42/usr/sbin/criu ]; then
    echo "carry .device-criu42 (scripts/criu/build --bundle .device-criu42)" >&2
    exit 2
fi
{ echo "== criu"; criu --version; criu check 2>&1 | tail -2
  echo "== cpus $(nproc); THP $(cat /sys/kernel/mm/transparent_hugepage/enabled)"; free -g | head -2; } \
    > "$OUT/criu-env.txt" 2>&1
cat "$OUT/criu-env.txt"
if [ "${1:-}" = shape ]; then
    timeout -k 5 "${CRIU_BENCH_TIMEOUT:-170}" python3 bench/criu_dump_shape.py --criu "$PWD/.device-criu42/usr/sbin/criu" \
        --repeat 3 --out "$OUT" 2>&1 | tee "$OUT/criu-dump-shape.txt"
    rc=${PIPESTATUS[0]}
    rm -rf /dev/shm/criu-shape-*  # a run cut short leaves its images
    exit "$rc"
fi
if [ "${1:-}" = phases ]; then
    timeout -k 5 "${CRIU_BENCH_TIMEOUT:-170}" python3 bench/criu_restore_phases.py \
        --criu "$PWD/.device-criu42/usr/sbin/criu" --rounds 5 --out "$OUT" 2>&1 | tee "$OUT/criu-phases.txt"
    rc=${PIPESTATUS[0]}
    rm -rf /dev/shm/coldsnap-criu-phases-* /tmp/coldsnap-criu-phases-*  # a run cut short leaves its images
    exit "$rc"
fi
if [ "${1:-}" = start ]; then
    timeout -k 5 "${CRIU_BENCH_TIMEOUT:-170}" python3 bench/path_to_criu.py --criu "$PWD/.device-criu42/usr/sbin/criu" \
        --restores 20 --importtime ${BEFORE:+--before "$BEFORE"} --out "$OUT/path-to-criu.json" 2>&1 \
        | tee "$OUT/path-to-criu.txt"
    exit "${PIPESTATUS[0]}"
fi
if [ "${1:-}" = threads ]; then
    huge=$(mktemp -d /tmp/criu-threads-huge.XXXXXX)
    mount -t tmpfs -o size=16g,huge=always tmpfs "$huge" || exit 1
    timeout -k 5 "${CRIU_BENCH_TIMEOUT:-170}" python3 bench/criu_dump_threads.py \
        --criu "$PWD/.device-criu42/usr/sbin/criu" --rows "1,4,0" --dir "$huge" --out "$OUT" 2>&1 \
        | tee "$OUT/criu-dump-threads.txt"
    rc=${PIPESTATUS[0]}
    umount "$huge" && rmdir "$huge"
    exit "$rc"
fi
timeout -k 5 "${CRIU_BENCH_TIMEOUT:-170}" python3 bench/criu_restore.py --criu "$PWD/.device-criu42/usr/sbin/criu" \
    --gib "${CRIU_BENCH_GIB:-16}" --disk-dir /var/tmp --out "$OUT" 2>&1 | tee "$OUT/criu-restore.txt"
rc=${PIPESTATUS[0]}
rm -rf /dev/shm/coldsnap-criu-bench-* /var/tmp/coldsnap-criu-bench-*  # a run cut short leaves its images
exit "$rc"
