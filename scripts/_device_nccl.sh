#!/usr/bin/env bash
# Prove the NCCL shim on a GPU host against the real NCCL runtime (the nvidia-nccl wheel there).
# Run from the repository root with the wheels the host lacks under .whl; results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
BUILD=$(mktemp -d /tmp/csns-XXXX)
CFLAGS="-std=c11 -Wall -Wextra -Werror -fPIC -shared -Inccl_shim/include"
gcc $CFLAGS -fvisibility=hidden nccl_shim/src/coldsnap_nccl_shim.c -o "$BUILD/libcsns.so" -ldl -lpthread || exit 1
export COLDSNAP_NCCL_SHIM_LIBRARY="$BUILD/libcsns.so"
NCCL_DIR=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))")
LIBNCCL="$NCCL_DIR/libnccl.so.2"
VERSION=$(python3 - "$LIBNCCL" <<'PY'
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1]); v = ctypes.c_int(); assert lib.ncclGetVersion(ctypes.byref(v)) == 0; print(v.value)
PY
)
echo "real NCCL: $LIBNCCL version code $VERSION" | tee "$OUT/nccl.txt"
MAJOR=$((VERSION / 10000)); MINOR=$(((VERSION / 100) % 100)); PATCH=$((VERSION % 100))
ID="nccl-$MAJOR.$MINOR.$PATCH-1+coldsnap.1"
export COLDSNAP_NCCL_PROVIDER_ID="$ID" COLDSNAP_NCCL_PROVIDER_REVISION=1 COLDSNAP_NCCL_DLSYM_BRIDGE_ABI=1
echo "== 1. the real libnccl.so.2 alone: not a ColdSnap provider"
python3 -m nccl_shim inspect --library "$LIBNCCL" --json > "$OUT/real-nccl.json"; echo "exit $?"
echo "== 2. a provider over the real NCCL (loaded version read from the real ncclGetVersion)"
gcc $CFLAGS -DFORWARD_NCCL -DCOMPILED_VERSION="$VERSION" -DPROVIDER_ID="\"$ID\"" -DREVISION=1u \
    tests/shim/conformance_provider.c -o "$BUILD/libprovider.so" -L"$NCCL_DIR" -Wl,--no-as-needed -l:libnccl.so.2 \
    -Wl,-rpath,"$NCCL_DIR" -ldl || exit 1
python3 -m nccl_shim inspect --library "$BUILD/libprovider.so" --json > "$OUT/provider-real-nccl.json"; echo "exit $?"
echo "== 3. the same provider compiled for another NCCL: compiled/loaded mismatch against the real runtime"
gcc $CFLAGS -DFORWARD_NCCL -DCOMPILED_VERSION="$((VERSION - 1))" -DPROVIDER_ID="\"$ID\"" -DREVISION=1u \
    tests/shim/conformance_provider.c -o "$BUILD/libstale.so" -L"$NCCL_DIR" -Wl,--no-as-needed -l:libnccl.so.2 \
    -Wl,-rpath,"$NCCL_DIR" -ldl || exit 1
python3 -m nccl_shim inspect --library "$BUILD/libstale.so" --json > "$OUT/provider-stale.json"; echo "exit $?"
echo "== 4. the preloaded (process-global) path: LD_PRELOAD provider then the real NCCL"
LD_PRELOAD="$BUILD/libprovider.so:$LIBNCCL" python3 -m nccl_shim inspect --json > "$OUT/provider-preloaded.json"
echo "exit $?"
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(p.read_text()); i = r.get("identity") or {}
    print(f"{p.name:28} admitted={r['admitted']!s:5} rule={r['rule']} id={i.get('provider_id')} "
          f"compiled={i.get('compiled_nccl_version')} loaded={i.get('loaded_nccl_version')} "
          f"ncclGetVersion={i.get('nccl_version')} error={r['error']}")
PY
echo "== shim test suite on this host"
COLDSNAP_NCCL_SHIM_LIBRARY="$BUILD/libcsns.so" python3 -m pytest -q -p no:cacheprovider tests/shim 2>&1 | tail -4
