#!/usr/bin/env bash
# Issue 22's restore-to-first-token rows on a GPU host, in one call (bench/restore_ttft.py through
# scripts/device ttft, THP always, CUDA stack limit 256 B, images on tmpfs, the fill and copy ceilings measured
# in each part):
#   scripts/device line-rate [PARTS]     PARTS: comma list of (default 16,64; the other call: 64h,release,cpu)
#     16      16 GiB: the interposer (no cooperation), the weights hydrated (KV cache discarded) and the full
#             device image, side by side, RESTORES restores each;
#     64      64 GiB: the interposer, weights made on the GPU (a 64 GiB dump fits in host memory beside no
#             64 GiB weights file), RESTORES restores;
#     64h     64 GiB: the weights hydrated, KV cache discarded (its own run: the weights file and no dump);
#     release 16 GiB: the interposer's release with other copy settings (COLDSNAP_CUDA_INTERPOSER_STAGING_MIB,
#             _THREADS, _DIGEST), one restore each: where its copy threads spend their time, by setting (the
#             "release of" line: wall s, then thread-seconds D2H / digest / zero / write);
#     cpu     the release's CPU part on this host's cores, no GPU (bench/release_cpu.py: digests per engine, tmpfs
#             writes by threads and files, the release's block loop), 4 GiB into /dev/shm;
#     staging the release by copy setting (issue 35 item 3, bench/release_staging.py): a 16 GiB torch process
#             released into a huge=always tmpfs and /dev/shm with 4 MiB (the default), 1024, 512, 256 and 128 KiB
#             staging buffers, and 256 KiB with 24 threads, about 130 s (REGISTER_GIB=2: first what registering a
#             file's pages costs per window, measured already: bench/results/h200-release-direct-2026-12-02/);
#     mounts  where the dump goes (issue 35 item 3): 8 GiB by 16 threads into a tmpfs mounted per huge= option
#             (never, always, within_size), written as the release does, its loop, and into mapped files
#             populated ahead (bench/release_cpu.py --mounts), about 30 s.
# Environment: RESTORES (default 3). Carries .whl and .device-criu42 (or .device-criu); each part's output in
# $OUT/<part>/ (its table in <part>.txt, the JSON beside it), then everything in $OUT/line-rate.tar.xz.
set -uo pipefail
PARTS=${1:-16,64}
RESTORES=${RESTORES:-3}
ALL="${OUT:-$PWD/device-out}"
COMMON=(--stack-bytes 256 --images-root /dev/shm/cs-img --root /tmp/cs --tokens 16 --restores "$RESTORES")
part() {  # part NAME SECONDS ARGS...: one restore_ttft run in its own $OUT, bounded
    local name=$1 seconds=$2
    shift 2
    mkdir -p "$ALL/$name"
    echo "== $name: restore_ttft $*"
    OUT="$ALL/$name" THP=always timeout -s INT -k 15 "$seconds" bash "$(dirname "$0")/_device_ttft.sh" "$@" \
        > "$ALL/$name/$name.txt" 2>&1
    echo "   exit $?"
    grep -v "server stage" "$ALL/$name/$name.txt" | grep -E "^\||ceilings|FAILED|release of|captured" | cut -c1-400
}
# Each part has its bound (below); the four together (880 s) do not fit one call of 600 s: two calls.
declare -A BOUND=([16]=240 [64]=200 [64h]=200 [release]=240 [cpu]=120 [mounts]=90 [staging]=200)
TOTAL=0
for p in ${PARTS//,/ }; do
    [ -n "${BOUND[$p]:-}" ] || { echo "unknown part $p (16, 64, 64h, release, cpu, mounts, staging)"; exit 2; }
    TOTAL=$((TOTAL + BOUND[$p]))
done
if [ "$TOTAL" -gt 570 ]; then
    echo "parts $PARTS are bounded by $TOTAL s together, more than one call: run 16,64 and 64h,release apart"; exit 2
fi
for p in ${PARTS//,/ }; do
    case "$p" in
        16) part 16 240 --sizes 16 --modes interposer,hydrate,full --kv discarded "${COMMON[@]}" ;;
        64) rm -f /dev/shm/coldsnap-weights-*.bin  # host memory for the 64 GiB dump
            part 64 200 --sizes 64 --modes interposer --device-weights "${COMMON[@]}" ;;
        64h) part 64h 200 --sizes 64 --modes hydrate --kv discarded "${COMMON[@]}" ;;
        release)
            for setting in "4 16 crc32-64m" "4 16 sha256-64m" "16 16 crc32-64m" "8 8 crc32-64m"; do
                read -r mib threads digest <<< "$setting"
                COLDSNAP_CUDA_INTERPOSER_STAGING_MIB=$mib COLDSNAP_CUDA_INTERPOSER_THREADS=$threads \
                    COLDSNAP_CUDA_INTERPOSER_DIGEST=$digest \
                    part "release-${mib}m-${threads}t-${digest}" 60 --sizes 16 --modes interposer --device-weights \
                    --stack-bytes 256 --images-root /dev/shm/cs-img --root /tmp/cs --tokens 16 --restores 1
            done ;;
        cpu) mkdir -p "$ALL/cpu"
            echo "== cpu: bench/release_cpu.py"
            timeout -s INT -k 15 120 python3 bench/release_cpu.py --gib 4 --threads 1,8,16 --files 1,16 \
                --dir /dev/shm --out "$ALL/cpu" > "$ALL/cpu/cpu.txt" 2>&1
            echo "   exit $?"
            grep "^|" "$ALL/cpu/cpu.txt" ;;
        staging) mkdir -p "$ALL/staging"
            echo "== staging: bench/release_staging.py --gib 16"
            (source "$(dirname "$0")/_device_env.sh"
             timeout -s INT -k 15 200 python3 bench/release_staging.py --gib 16 --register-gib "${REGISTER_GIB:-0}" \
                 --out "$ALL/staging") \
                > "$ALL/staging/staging.txt" 2>&1
            echo "   exit $?"
            grep -E "^\||^==|^   |digests|Error|error" "$ALL/staging/staging.txt" | cut -c1-400 ;;
        mounts) mkdir -p "$ALL/mounts"
            echo "== mounts: bench/release_cpu.py --mounts never,always,within_size"
            (source "$(dirname "$0")/_device_env.sh"  # bench/_common's imports: the carried wheels
             timeout -s INT -k 15 90 python3 bench/release_cpu.py --mounts never,always,within_size --gib 8 \
                 --threads 16 --files 16 --out "$ALL/mounts") > "$ALL/mounts/mounts.txt" 2>&1
            echo "   exit $?"
            grep "^|" "$ALL/mounts/mounts.txt" ;;
        *) echo "unknown part $p"; exit 2 ;;
    esac
done
tar -C "$ALL" -cJf "$ALL/line-rate.tar.xz" --exclude line-rate.tar.xz $(cd "$ALL" && ls -d */ 2>/dev/null)
