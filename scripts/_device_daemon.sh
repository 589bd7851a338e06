# Sourced by the GPU-machine scripts that drive a real daemon (the e2e, serve, tp, confine and daemon-gpus steps of scripts/device), after _device_env.sh:
# the bundled Docker Engine, the capsule build contexts, and `coldsnap-provider serve` on them.
D=/tmp/dk
STATE=${STATE:-/tmp/cs-e2e-state}
ROOT=$PWD
step() { echo "== $(date +%T) $*"; }

start_docker() {
    mkdir -p "$D"
    [ -x "$D/usr/bin/dockerd" ] || tar -xJf .device-docker/docker-min.tar.xz -C "$D"
    export PATH=$D/usr/bin:$D/usr/sbin:$PATH
    (LD_LIBRARY_PATH=$D/usr/lib/dk setsid dockerd --data-root $D/data --exec-root $D/exec --pidfile $D/docker.pid \
        -H unix://$D/docker.sock --iptables=false --bridge=none >$D/dockerd.log 2>&1 &)
    export DOCKER_HOST=unix://$D/docker.sock
    python3 scripts/_docker_api.py $D/docker.sock wait
}

# The docker CLI, for the scripts that run containers by hand (the confine step): the full bundle has it; the slim one
# (the bundle without it, small enough to carry with the serving wheels: `xz -dc docker-min.tar.xz | tar --delete
# usr/bin/docker | xz -T0 -9 > slim.tar.xz`, renamed docker-min.tar.xz) does not.
docker_() { LD_LIBRARY_PATH=$D/usr/lib/dk command docker "$@"; }

# capsule_context DIR [--worker]: a capsule build context (busybox, CRIU, and with --worker coldsnap_probe)
capsule_context() {
    local dir=$1; shift
    rm -rf "$dir"
    python3 scripts/_capsule_rootfs.py "$dir" --busybox $D/usr/bin/busybox-static --criu-root "$CRIU_ROOT" \
        ${1:+--worker "$ROOT/coldsnap_probe"}
}

# serve_model DIR LAYERS: the model folder `transformers serve` loads (engine_llama's weights, LAYERS layers, bf16,
# fixed seed, and a local tokenizer), written in the background: $WRITER; /tmp/weights.log ends "model exit N".
serve_model() {
    (rm -rf "$1"; /usr/bin/time -f "weights written in %e s" python3 engines/engine_llama.py weights "$1" \
         --layers "$2" > /tmp/weights.log 2>&1 && python3 engines/serve_model.py tokenizer "$1" >> /tmp/weights.log 2>&1
     echo "model exit $?" >> /tmp/weights.log) &
    WRITER=$!
}

# wait_model DIR: until serve_model's writer ends; exits the step when it failed
wait_model() {
    wait "$WRITER"; tail -5 /tmp/weights.log; ls -la "$1"
    grep -q "model exit 0" /tmp/weights.log || { cp /tmp/weights.log "$OUT/"; exit 1; }
}

# serve_capsule DIR [SITE]: the server's dependencies ($WHEEL_DIR/serve: fastapi, starlette, uvicorn, uvloop, pydantic,
# openai and theirs) into SITE, then a capsule build context with the worker, CRIU and that site (without SITE: no
# server site); its log: $OUT/capsule.txt. uvloop stays (when the wheels bring it): every server unit preloads
# libcoldsnap_no_io_uring.so, so its libuv keeps to epoll (docs/restoring-your-own-server.md). With JAX_SITE (the
# site-packages the units' JAX server runs from, mounted from the host) the capsule carries the PTX tools that site
# lacks and this host's XLA finds (ptxas, nvlink, libdevice at /opt/cuda: issue 36, scripts/_capsule_rootfs.py).
serve_capsule() {
    rm -rf "$1" ${2:+"$2"}
    if [ -n "${2:-}" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$2" \
            "$WHEEL_DIR"/serve/*.whl || { echo "phase 'set-up' failed: the server's wheels" >&2; exit 1; }
    fi
    python3 scripts/_capsule_rootfs.py "$1" --busybox $D/usr/bin/busybox-static --criu-root "$CRIU_ROOT" \
        --worker "$ROOT/coldsnap_probe" ${2:+--server-site "$2"} ${JAX_SITE:+--jax-site "$JAX_SITE"} \
        --criu-compat scripts/capsule/criu_sockopt_compat.c \
        2>&1 | tee "$OUT/capsule.txt"
}

METRICS="unix:$STATE/metrics.sock"  # the daemon's Prometheus endpoint (issue 26); save_scrape reads it

# start_serve [SUFFIX]: the daemon on the bundled engine; DOCKER_EXTRA adds lines to its [docker] section (the store
# step's capture_store and spool_dir).
start_serve() {
    mkdir -p "$STATE" && chmod 700 "$STATE"
    python3 -c "import prometheus_client" 2>/dev/null || {
        echo "prometheus_client is missing: carry its wheel under .whl (pip download prometheus_client)"; exit 1; }
    cat > /tmp/cs-e2e.toml <<CONF
[docker]
url = "unix://$D/docker.sock"
${DOCKER_EXTRA:-}
[gpus]
mode = "native"
[runtime]
privileged = "host-capabilities"
[metrics]
address = "$METRICS"
[audit]
file = "$OUT/audit${1:-}.jsonl"
CONF
    rm -f "$STATE/control.sock"  # a stopped daemon's: wait for this one's
    python3 -m coldsnap_provider serve --config /tmp/cs-e2e.toml --state-dir "$STATE" --log-level info \
        > "$OUT/daemon${1:-}.log" 2>&1 &
    SERVE=$!
    for _ in $(seq 100); do [ -S "$STATE/control.sock" ] && return 0; sleep 0.2; done
    echo "coldsnap-provider serve did not start:"; tail -20 "$OUT/daemon${1:-}.log"; exit 1
}

# save_scrape NAME: after the collector's next scan, the endpoint's scrape to $OUT/metrics-NAME.txt; prints
# the capture/restore phase series the capsules reported (issue 26).
save_scrape() {
    sleep 2
    python3 scripts/_metrics_scrape.py "$METRICS" "$OUT/metrics-$1.txt"; echo "scrape exit $? (0: restore phases present)"
}

stop_all() {
    python3 scripts/_docker_api.py $D/docker.sock images
    echo "containers left: $(python3 scripts/_docker_api.py $D/docker.sock containers)"
    kill -TERM $SERVE; wait $SERVE; echo "serve exit $?"  # (not in a pipeline: $SERVE is this shell's child)
    kill -TERM "$(cat $D/docker.pid)" 2>/dev/null
    for _ in $(seq 40); do [ -e "$D/docker.pid" ] || break; sleep 0.25; done
}
