#!/usr/bin/env bash
# The node hydrator's RAM tier against its disk tier on the GPU machine (issue 34 item 3, issue 35): the same
# 16 GiB device dump on tmpfs staged three times through a hydrator with the tier on (a miss, then hits), after a
# capture's warm (at once, and once held), twice with it off, and a half-zero dump over the budget whose data fits,
# side by side (bench/ram_tier.py, about two minutes), then the RAM tier's and the warm's GPU tests.
#   scripts/device ram-tier [GIB [BENCH OPTIONS...]]   GIB: the dump's size (default 16); BENCH OPTIONS go to
#   bench/ram_tier.py, e.g. `--rows warmed,off --dump-threads 16` (a capture's warm, then a restore's stage at
#   once, joining it, or once held, beside the tier off: about a minute). TESTS=0: the tests are not run.
# Carries .whl; results (ram-tier.txt: the table; ram-tier.json; ram-tier-test.txt) go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; free -g | head -2; nproc; } 2>&1 \
    | tee "$OUT/host.txt"
GIB=${1:-16}
shift $(($# > 0))
timeout -k 5 300 python3 bench/ram_tier.py --gib "$GIB" --out "$OUT" "$@" 2>&1 | tee "$OUT/ram-tier-run.txt"
rc=${PIPESTATUS[0]}
rm -rf /dev/shm/cs-ram-tier-*  # a run cut short leaves its dump
[ "${TESTS:-1}" = 0 ] && exit "$rc"
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -s tests/probe/test_ram_tier.py \
    tests/probe/test_warm.py 2>&1 \
    | tee "$OUT/ram-tier-test.txt" | tail -15
tests=${PIPESTATUS[0]}
[ "$rc" = 0 ] && rc=$tests
exit "$rc"
