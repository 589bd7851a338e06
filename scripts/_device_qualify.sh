#!/usr/bin/env bash
# Qualify a GPU machine for real: the probe, CRIU, admission for n580 and n610, and the cache.
#   scripts/device qualify     (the GPU tests, test_canaries among them, are `scripts/device gpu-tests`)
# Run on the GPU host from the repository root, with CRIU unpacked under .device-criu and the
# wheels the host lacks (msgspec, structlog, aiodocker) under .whl; results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
STATE=$(mktemp -d /tmp/cs-qualify-XXXX)
{
    echo "== host"; nvidia-smi --query-gpu=index,name,uuid,driver_version,compute_cap --format=csv
    python3 --version; uname -r
    echo "== criu check"; criu check 2>&1 | tail -3
} > "$OUT/host.txt" 2>&1
echo "== profile (raw probe)"
/usr/bin/time -f "profile wall %e s" python3 -m coldsnap_probe profile >"$OUT/profile.json" 2>"$OUT/profile.stderr"
echo "profile exit $?"; tail -2 "$OUT/profile.stderr"
for driver in n610 n580; do
    for pass in fresh cached; do
        python3 -m coldsnap_provider probe --driver "$driver" --host-process --state-dir "$STATE" --json \
            >"$OUT/probe-$driver-$pass.json" 2>>"$OUT/probe.stderr"
        echo "probe $driver $pass exit $?"
    done
done
python3 - "$OUT" <<'PY'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
profile = json.loads((out / "profile.json").read_text())
for f in profile["features"]:
    print(f"{f['id']:40} {f['status']:12} {f.get('failure_phase', ''):14} {f['seconds']:.3f}s {f.get('reason', '')[:90]}")
print("identity:", json.dumps(profile["identity"], sort_keys=True))
for p in sorted(out.glob("probe-*.json")):
    try:
        o = json.loads(p.read_text())
        print(p.name, "admitted", o["admitted"], "cached", o["cached"], "error", o["error"])
    except Exception as e:
        print(p.name, "unreadable:", e)
PY
ls -la "$STATE/host-feature-profiles" 2>&1 | tee -a "$OUT/host.txt"
