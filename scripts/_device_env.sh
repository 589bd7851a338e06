# Shared prelude of the GPU-machine scripts (sourced): carried wheels, CRIU, $OUT.
# CRIU: .device-criu42 (scripts/criu/build --bundle .device-criu42: 4.2 with the parallel page restore) when
# carried, else .device-criu (Debian's 4.1.1); CRIU_ROOT names the one used, for capsules too.
OUT="${OUT:-$PWD/device-out}"
mkdir -p "$OUT"
DEVICE_SITE="${COLDSNAP_DEVICE_SITE:-/tmp/site}"  # where the wheels go (kept while the machine stays warm)
WHEEL_DIR=${COLDSNAP_DEVICE_WHEELS:-.whl}  # a step whose carry is tight names a trimmed set (the store step's)
if [ "${DRY:-0}" != 1 ] && ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then  # (a dry run installs nothing)
    # Once per set of wheels (a script that runs several parts sources this each time). A set is named by its
    # wheels' names and bytes (a rebuilt wheel keeps its name, often its size, and a copy sets its time), and
    # another set's site is removed first: `pip --target --upgrade` would leave its packages this set lacks.
    WHEELS=$(cd "$WHEEL_DIR" && sha256sum -- *.whl | sha256sum)
    if [ "$(cat "$DEVICE_SITE/.coldsnap-wheels" 2>/dev/null)" != "$WHEELS" ]; then
        rm -rf "$DEVICE_SITE"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$DEVICE_SITE" \
            "$WHEEL_DIR"/*.whl || exit 1
        echo "$WHEELS" > "$DEVICE_SITE/.coldsnap-wheels"
    fi
    export PYTHONPATH="$DEVICE_SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
CRIU_ROOT="$PWD/.device-criu42"
[ -d "$CRIU_ROOT" ] || CRIU_ROOT="$PWD/.device-criu"
export CRIU_ROOT
if [ -d "$CRIU_ROOT" ]; then
    # The unpacked CRIU tree may hold its library symlinks as tiny files naming the target: restore them.
    for f in "$CRIU_ROOT"/usr/lib/x86_64-linux-gnu/*.so.*; do
        if [ -f "$f" ] && [ "$(stat -c %s "$f")" -lt 64 ]; then
            target="$(dirname "$f")/$(cat "$f")"
            [ -f "$target" ] && cp --remove-destination "$target" "$f"
        fi
    done
    export LD_LIBRARY_PATH="$CRIU_ROOT/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export PATH="$CRIU_ROOT/usr/sbin:$PATH"
fi
