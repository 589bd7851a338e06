#!/usr/bin/env bash
# A single-node Kubernetes cluster on this machine for the Kubernetes tests ("node-k"), idempotent:
#   scripts/_k8s.sh up     # build or reuse the binaries, start what is not running, wait for the Node Ready
#   scripts/_k8s.sh down   # stop everything it started (by pid), remove its cgroups; CLEAN=1 also drops state
#   scripts/_k8s.sh env    # the paths the tests use, as shell assignments
# Kubernetes v1.20.2 (scripts/_k8s_build.sh, cached under $K8S_CACHE), with etcd, containerd, runc and the CNI
# bridge plugin from Debian bookworm's packages (unpacked privately, never installed). Every component runs in
# one private network + mount namespace held by a `sleep`: the machine's own dockerd, containerd, iptables and
# /run are never touched. The namespace has a tmpfs /run of its own and reaches the host through one veth pair:
# the node is 10.77.0.1 (apiserver https://10.77.0.1:6443), the host side 10.77.0.254. Pods get 10.78.0.0/24 on
# a bridge inside the namespace. Images come from docker-archive tarballs imported with ctr (no registry).
# What lives outside $K8S_DIR: the veth's host end and /sys/fs/cgroup/*/coldsnap-k8s (both removed by down).
set -euo pipefail

K8S_DIR="${K8S_DIR:-/var/lib/coldsnap-k8s}"
K8S_CACHE="${COLDSNAP_K8S_CACHE:-/var/cache/coldsnap-k8s}"
K8S_VERSION=v1.20.2
BIN="$K8S_CACHE/$K8S_VERSION/bin"
DEB="$K8S_CACHE/debroot"
NODE_IP=10.77.0.1
HOST_IP=10.77.0.254
HOST_LINK=csk8s0
NODE_NAME=node-k
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NS_PID_FILE="$K8S_DIR/ns.pid"
# Debian bookworm versions these scripts were measured with (docs/kubernetes.md).
DEBS=(etcd-server=3.4.23-4+b4 containerd=1.6.20~ds1-1+deb12u3 runc=1.1.5+ds1-1+deb12u1
      containernetworking-plugins=1.1.1+ds1-3+b5 busybox-static)

k8s_say() { printf '[k8s] %s\n' "$*" >&2; }

k8s_alive() {  # k8s_alive PIDFILE: the process runs (a zombie does not count)
    local pid state
    [ -s "$1" ] || return 1
    pid="$(cat "$1")"
    state="$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$pid/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

k8s_env() {
    cat <<EOF
K8S_DIR=$K8S_DIR
K8S_NODE=$NODE_NAME
K8S_KUBECONFIG=$K8S_DIR/conf/provider.kubeconfig
K8S_BAD_KUBECONFIG=$K8S_DIR/conf/wrong-token.kubeconfig
K8S_NS_PID_FILE=$NS_PID_FILE
K8S_CTR=$DEB/usr/bin/ctr
K8S_CONTAINERD_SOCKET=$K8S_DIR/containerd/containerd.sock
K8S_IMAGES=$K8S_DIR/images
EOF
}

k8s_deps() {  # etcd, containerd, runc, CNI, busybox from Debian bookworm, unpacked under $DEB (cached)
    local stamp="${DEBS[*]}" apt="$K8S_CACHE/apt" mirror
    [ "$(cat "$DEB/.stamp" 2>/dev/null)" = "$stamp" ] && return
    k8s_say "fetching etcd, containerd, runc, CNI plugins and busybox (Debian bookworm)"
    mirror="$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')"
    mkdir -p "$apt/lists/partial" "$apt/cache" "$K8S_CACHE/debs"
    echo "deb ${mirror:-http://deb.debian.org/debian} bookworm main" > "$apt/sources.list"
    local opts=(-o "Dir::Etc::SourceList=$apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
                -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache=$apt/cache" -o Dir::State::status=/dev/null
                -o APT::Sandbox::User=root)
    apt-get "${opts[@]}" update -qq
    rm -rf "$K8S_CACHE/debs"/*.deb "$DEB"
    (cd "$K8S_CACHE/debs" && apt-get "${opts[@]}" download -qq "${DEBS[@]}")
    for d in "$K8S_CACHE/debs"/*.deb; do dpkg -x "$d" "$DEB"; done
    echo "$stamp" > "$DEB/.stamp"
}

k8s_pki() {  # a CA, the apiserver's certificate, the service-account key pair, static tokens, kubeconfigs
    local pki="$K8S_DIR/pki" conf="$K8S_DIR/conf"
    mkdir -p "$pki" "$conf"
    chmod 0700 "$pki"
    if [ ! -s "$pki/tokens.csv" ]; then
        (cd "$pki"
         openssl genrsa -out ca.key 2048 2>/dev/null
         openssl req -x509 -new -nodes -key ca.key -subj /CN=coldsnap-k8s-ca -days 3650 -out ca.crt
         printf '[req]\ndistinguished_name=dn\n[dn]\n[ext]\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:127.0.0.1,IP:10.0.0.1,IP:%s\n' "$NODE_IP" > apiserver.cnf
         openssl genrsa -out apiserver.key 2048 2>/dev/null
         openssl req -new -key apiserver.key -subj /CN=kube-apiserver -config apiserver.cnf -out apiserver.csr
         openssl x509 -req -in apiserver.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 3650 -extfile apiserver.cnf \
             -extensions ext -out apiserver.crt 2>/dev/null
         openssl genrsa -out sa.key 2048 2>/dev/null
         openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null
         # Random tokens per machine; the provider's is an ordinary user bound by RBAC to one namespace.
         for who in admin kubelet kcm scheduler provider; do printf '%s\n' "$(openssl rand -hex 24)" > "token-$who"; done
         {
             printf '%s,admin,1000,"system:masters"\n' "$(cat token-admin)"
             printf '%s,system:node:%s,1001,"system:nodes"\n' "$(cat token-kubelet)" "$NODE_NAME"
             printf '%s,system:kube-controller-manager,1002,"system:masters"\n' "$(cat token-kcm)"
             printf '%s,system:kube-scheduler,1003,"system:masters"\n' "$(cat token-scheduler)"
             printf '%s,coldsnap-provider,1004\n' "$(cat token-provider)"
         } > tokens.csv)
    fi
    k8s_kubeconfig admin "https://127.0.0.1:6443" "$(cat "$pki/token-admin")" > "$conf/admin.kubeconfig"
    k8s_kubeconfig kubelet "https://127.0.0.1:6443" "$(cat "$pki/token-kubelet")" > "$conf/kubelet.kubeconfig"
    k8s_kubeconfig kcm "https://127.0.0.1:6443" "$(cat "$pki/token-kcm")" > "$conf/kcm.kubeconfig"
    k8s_kubeconfig scheduler "https://127.0.0.1:6443" "$(cat "$pki/token-scheduler")" > "$conf/scheduler.kubeconfig"
    k8s_kubeconfig admin "https://$NODE_IP:6443" "$(cat "$pki/token-admin")" > "$conf/host-admin.kubeconfig"
    k8s_kubeconfig coldsnap-provider "https://$NODE_IP:6443" "$(cat "$pki/token-provider")" > "$conf/provider.kubeconfig"
    k8s_kubeconfig coldsnap-provider "https://$NODE_IP:6443" "not-a-valid-token" > "$conf/wrong-token.kubeconfig"
    chmod 0600 "$conf"/*.kubeconfig
}

k8s_kubeconfig() {  # k8s_kubeconfig USER SERVER TOKEN
    printf 'apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: %s\n    certificate-authority: %s\nusers:\n- name: %s\n  user:\n    token: %s\ncontexts:\n- name: local\n  context: {cluster: local, user: %s}\ncurrent-context: local\n' \
        "$2" "$K8S_DIR/pki/ca.crt" "$1" "$3" "$1"
}

k8s_configs() {
    local conf="$K8S_DIR/conf"
    mkdir -p "$K8S_DIR/cni/net.d" "$K8S_DIR/cni/ipam"
    cat > "$conf/containerd.toml" <<EOF
version = 2
root = "$K8S_DIR/containerd/root"
state = "$K8S_DIR/containerd/state"
[grpc]
  address = "$K8S_DIR/containerd/containerd.sock"
[ttrpc]
  address = "$K8S_DIR/containerd/containerd.sock.ttrpc"
[debug]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "$K8S_DIR/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "docker.io/local/pause:1"
  netns_mounts_under_state_dir = true
  # root here lacks CAP_SYS_RESOURCE: runc cannot set the negative oom_score_adj of the sandbox (-998) and of
  # Guaranteed pods (-997); clamp to >= 0 instead of failing every Pod.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "$DEB/usr/sbin/runc"
        Root = "$K8S_DIR/containerd/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "$DEB/usr/lib/cni"
    conf_dir = "$K8S_DIR/cni/net.d"
EOF
    cat > "$K8S_DIR/cni/net.d/10-coldsnap.conflist" <<EOF
{"cniVersion": "0.4.0", "name": "coldsnap", "plugins": [{"type": "bridge", "bridge": "cnik0", "isGateway": true,
 "ipMasq": false, "hairpinMode": true, "ipam": {"type": "host-local", "dataDir": "$K8S_DIR/cni/ipam",
 "ranges": [[{"subnet": "10.78.0.0/24"}]], "routes": [{"dst": "0.0.0.0/0"}]}}]}
EOF
    cat > "$conf/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
readOnlyPort: 0
cgroupDriver: cgroupfs
cgroupRoot: /coldsnap-k8s
failSwapOn: false
authentication: {anonymous: {enabled: true}, webhook: {enabled: false}}
authorization: {mode: AlwaysAllow}
clusterDomain: cluster.local
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
EOF
}

k8s_images() {  # docker.io/local/pause:1 (static, from pause.c) and docker.io/local/busybox:1 (busybox-static)
    local images="$K8S_DIR/images" stamp
    stamp="$(cat "$HERE/k8s/pause.c" "$HERE/k8s/image.py" "$DEB/bin/busybox" | sha256sum | cut -c1-16)"
    [ "$(cat "$images/.stamp" 2>/dev/null)" = "$stamp" ] && return
    rm -rf "$images"
    mkdir -p "$images/pause" "$images/busybox/bin" "$images/busybox/etc" "$images/busybox/tmp" "$images/busybox/root"
    gcc -Os -static -o "$images/pause/pause" "$HERE/k8s/pause.c"
    strip "$images/pause/pause"
    cp "$DEB/bin/busybox" "$images/busybox/bin/busybox"
    for applet in sh ls cat echo sleep env id pwd printf head tail wc tar mkdir rm true false kill test; do
        ln -sf busybox "$images/busybox/bin/$applet"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$images/busybox/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' > "$images/busybox/etc/group"
    chmod 1777 "$images/busybox/tmp"
    python3 "$HERE/k8s/image.py" "$images/pause" docker.io/local/pause:1 "$images/pause.tar" '["/pause"]' null
    python3 "$HERE/k8s/image.py" "$images/busybox" docker.io/local/busybox:1 "$images/busybox.tar" null '["/bin/sh"]'
    echo "$stamp" > "$images/.stamp"
}

k8s_ready() {  # the apiserver answers and the Node is Ready (from the host, through the veth)
    local token
    k8s_alive "$NS_PID_FILE" || return 1
    token="$(cat "$K8S_DIR/pki/token-admin" 2>/dev/null)" || return 1
    curl -sf --max-time 2 --cacert "$K8S_DIR/pki/ca.crt" -H "Authorization: Bearer $token" \
        "https://$NODE_IP:6443/api/v1/nodes/$NODE_NAME" 2>/dev/null \
        | python3 -c 'import json,sys; n=json.load(sys.stdin); sys.exit(0 if any(c["type"]=="Ready" and c["status"]=="True" for c in n["status"]["conditions"]) else 1)' 2>/dev/null
}

k8s_start() {  # k8s_start NAME ARGV...: run inside the namespace, detached, logging to logs/NAME.log
    local name="$1"; shift
    setsid nsenter -t "$(cat "$NS_PID_FILE")" -n -m -- "$@" > "$K8S_DIR/logs/$name.log" 2>&1 < /dev/null &
    echo $! > "$K8S_DIR/pids/$name.pid"
}

k8s_wait() {  # k8s_wait SECONDS WHAT COMMAND...
    local limit="$1" what="$2" i; shift 2
    for i in $(seq 1 $((limit * 4))); do "$@" >/dev/null 2>&1 && return 0; sleep 0.25; done
    k8s_say "$what did not come up in ${limit}s; logs: $K8S_DIR/logs"
    return 1
}

k8s_namespace() {  # the private network + mount namespace, its veth to the host, its /run and /var/log
    setsid unshare --net --mount --propagation private sleep infinity > /dev/null 2>&1 < /dev/null &
    local pid=$!
    echo "$pid" > "$NS_PID_FILE"
    sleep 0.3
    ip link del "$HOST_LINK" 2>/dev/null || true
    ip link add "$HOST_LINK" type veth peer name "$HOST_LINK-n"
    ip link set "$HOST_LINK-n" netns "$pid"
    ip addr add "$HOST_IP/24" dev "$HOST_LINK"
    ip link set "$HOST_LINK" up
    nsenter -t "$pid" -n -m -- sh -c "ip link set lo up; ip link set $HOST_LINK-n name node0;
        ip addr add $NODE_IP/24 dev node0; ip link set node0 up
        mount -t tmpfs -o mode=0755 tmpfs /run; mkdir -p /run/netns /run/containerd /run/lock
        mount --bind $K8S_DIR/varlog /var/log"
    # kubelet's cgroupRoot (cgroup v1 hybrid: one tree per controller; v2: one tree)
    local tree
    for tree in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
        [ -e "${tree}cgroup.procs" ] || continue
        [ "$tree" = /sys/fs/cgroup/ ] && [ -d /sys/fs/cgroup/cpu ] && continue
        mkdir -p "${tree}coldsnap-k8s"
    done
    if [ -d /sys/fs/cgroup/cpuset/coldsnap-k8s ]; then
        cp /sys/fs/cgroup/cpuset/cpuset.cpus /sys/fs/cgroup/cpuset/coldsnap-k8s/
        cp /sys/fs/cgroup/cpuset/cpuset.mems /sys/fs/cgroup/cpuset/coldsnap-k8s/
    fi
}

k8s_packages() {  # what the set-up itself runs
    local missing=() pair
    for pair in gcc:gcc strip:binutils curl:curl openssl:openssl ip:iproute2 nsenter:util-linux dpkg:dpkg; do
        command -v "${pair%%:*}" >/dev/null 2>&1 || missing+=("${pair#*:}")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        k8s_say "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

k8s_up() {
    [ "$(id -u)" = 0 ] || { k8s_say "needs root (namespaces, cgroups, containerd)"; exit 1; }
    k8s_packages
    nice -n 10 bash "$HERE/_k8s_build.sh"
    k8s_deps
    if k8s_ready; then return; fi
    k8s_down >/dev/null 2>&1 || true
    local t0=$SECONDS
    mkdir -p "$K8S_DIR"/{logs,pids,etcd,kubelet,varlog,containerd}
    k8s_pki
    k8s_configs
    k8s_images
    k8s_namespace
    local ns=(nsenter -t "$(cat "$NS_PID_FILE")" -n -m --) pki="$K8S_DIR/pki" conf="$K8S_DIR/conf"
    export PATH="$DEB/usr/bin:$DEB/usr/sbin:$PATH"  # containerd finds containerd-shim-runc-v2 on PATH
    k8s_start etcd "$DEB/usr/bin/etcd" --name node-k --data-dir "$K8S_DIR/etcd" \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 --initial-advertise-peer-urls http://127.0.0.1:2380 \
        --initial-cluster node-k=http://127.0.0.1:2380 --logger zap --log-level warn
    k8s_start kube-apiserver "$BIN/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 --bind-address=0.0.0.0 \
        --secure-port=6443 --advertise-address="$NODE_IP" --tls-cert-file="$pki/apiserver.crt" \
        --tls-private-key-file="$pki/apiserver.key" --client-ca-file="$pki/ca.crt" --token-auth-file="$pki/tokens.csv" \
        --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction --allow-privileged=true \
        --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc.cluster.local --service-cluster-ip-range=10.0.0.0/24 \
        --kubelet-preferred-address-types=InternalIP,Hostname --profiling=false --v=1
    k8s_start containerd "$DEB/usr/bin/containerd" --config "$conf/containerd.toml" --log-level warn
    k8s_wait 60 "kube-apiserver" "${ns[@]}" curl -sf --max-time 1 --cacert "$pki/ca.crt" https://127.0.0.1:6443/readyz
    k8s_start kube-controller-manager "$BIN/kube-controller-manager" --kubeconfig="$conf/kcm.kubeconfig" \
        --authentication-kubeconfig="$conf/kcm.kubeconfig" --authorization-kubeconfig="$conf/kcm.kubeconfig" \
        --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" --leader-elect=false \
        --bind-address=127.0.0.1 --port=0 --v=1
    k8s_start kube-scheduler "$BIN/kube-scheduler" --kubeconfig="$conf/scheduler.kubeconfig" \
        --authentication-kubeconfig="$conf/scheduler.kubeconfig" --authorization-kubeconfig="$conf/scheduler.kubeconfig" \
        --leader-elect=false --bind-address=127.0.0.1 --port=0 --v=1
    local ctr=("${ns[@]}" "$DEB/usr/bin/ctr" --address "$K8S_DIR/containerd/containerd.sock" -n k8s.io)
    k8s_wait 30 containerd "${ctr[@]}" version
    "${ctr[@]}" images import "$K8S_DIR/images/pause.tar" >/dev/null
    "${ctr[@]}" images import "$K8S_DIR/images/busybox.tar" >/dev/null
    k8s_start kubelet "$BIN/kubelet" --config="$conf/kubelet.yaml" --kubeconfig="$conf/kubelet.kubeconfig" \
        --root-dir="$K8S_DIR/kubelet" --cert-dir="$K8S_DIR/kubelet/pki" --container-runtime=remote \
        --container-runtime-endpoint="unix://$K8S_DIR/containerd/containerd.sock" \
        --image-service-endpoint="unix://$K8S_DIR/containerd/containerd.sock" --hostname-override="$NODE_NAME" \
        --node-ip="$NODE_IP" --pod-infra-container-image=docker.io/local/pause:1 --v=1
    k8s_rbac
    k8s_wait 90 "the Node $NODE_NAME" k8s_ready
    k8s_say "up in $((SECONDS - t0))s: apiserver https://$NODE_IP:6443, node $NODE_NAME"
}

k8s_rbac() {  # the provider's user: Pods (and their logs, exec) in namespace coldsnap-test; Nodes read-only
    local api=(curl -sf --max-time 5 --cacert "$K8S_DIR/pki/ca.crt" -H "Authorization: Bearer $(cat "$K8S_DIR/pki/token-admin")"
               -H "Content-Type: application/json")
    local base="https://$NODE_IP:6443" i
    for i in $(seq 1 40); do "${api[@]}" "$base/readyz" >/dev/null 2>&1 && break; sleep 0.25; done
    "${api[@]}" -X POST "$base/api/v1/namespaces" \
        -d '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"coldsnap-test"}}' >/dev/null 2>&1 || true
    "${api[@]}" -X POST "$base/apis/rbac.authorization.k8s.io/v1/clusterroles" -d '{"apiVersion":"rbac.authorization.k8s.io/v1",
        "kind":"ClusterRole","metadata":{"name":"coldsnap-test-provider-nodes"},"rules":[{"apiGroups":[""],"resources":["nodes"],
        "verbs":["get","list"]}]}' >/dev/null 2>&1 || true
    "${api[@]}" -X POST "$base/apis/rbac.authorization.k8s.io/v1/clusterrolebindings" -d '{"apiVersion":"rbac.authorization.k8s.io/v1",
        "kind":"ClusterRoleBinding","metadata":{"name":"coldsnap-test-provider-nodes"},"roleRef":{"apiGroup":"rbac.authorization.k8s.io",
        "kind":"ClusterRole","name":"coldsnap-test-provider-nodes"},"subjects":[{"kind":"User","name":"coldsnap-provider"}]}' >/dev/null 2>&1 || true
    "${api[@]}" -X POST "$base/apis/rbac.authorization.k8s.io/v1/namespaces/coldsnap-test/roles" -d '{"apiVersion":"rbac.authorization.k8s.io/v1",
        "kind":"Role","metadata":{"name":"coldsnap-provider"},"rules":[{"apiGroups":[""],"resources":["pods"],
        "verbs":["get","list","watch","create","delete"]},{"apiGroups":[""],"resources":["pods/log"],"verbs":["get"]},
        {"apiGroups":[""],"resources":["pods/exec"],"verbs":["get","create"]}]}' >/dev/null 2>&1 || true
    "${api[@]}" -X POST "$base/apis/rbac.authorization.k8s.io/v1/namespaces/coldsnap-test/rolebindings" -d '{"apiVersion":"rbac.authorization.k8s.io/v1",
        "kind":"RoleBinding","metadata":{"name":"coldsnap-provider"},"roleRef":{"apiGroup":"rbac.authorization.k8s.io",
        "kind":"Role","name":"coldsnap-provider"},"subjects":[{"kind":"User","name":"coldsnap-provider"}]}' >/dev/null 2>&1 || true
}

k8s_stop() {  # k8s_stop NAME: TERM, wait up to 10 s, KILL; by the pid file only
    local file="$K8S_DIR/pids/$1.pid" pid i
    [ -s "$file" ] || return 0
    pid="$(cat "$file")"
    if kill "$pid" 2>/dev/null; then
        for i in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$file"
}

k8s_down() {
    local name nspid="" netns p h
    for name in kubelet kube-scheduler kube-controller-manager kube-apiserver etcd; do k8s_stop "$name"; done
    k8s_alive "$NS_PID_FILE" && nspid="$(cat "$NS_PID_FILE")"
    if [ -n "$nspid" ]; then
        local ctr=(nsenter -t "$nspid" -n -m -- "$DEB/usr/bin/ctr" --address "$K8S_DIR/containerd/containerd.sock" -n k8s.io)
        for p in $("${ctr[@]}" tasks ls -q 2>/dev/null); do "${ctr[@]}" tasks kill -s SIGKILL "$p" 2>/dev/null || true; done
    fi
    k8s_stop containerd
    if [ -n "$nspid" ]; then  # what is left in our network namespace (shims, container processes): by pid
        netns="$(readlink "/proc/$nspid/ns/net")"
        for p in /proc/[0-9]*; do
            p="${p#/proc/}"
            [ "$p" = "$nspid" ] && continue
            [ "$(readlink "/proc/$p/ns/net" 2>/dev/null)" = "$netns" ] && kill -9 "$p" 2>/dev/null || true
        done
        kill "$nspid" 2>/dev/null || true
    fi
    rm -f "$NS_PID_FILE"
    ip link del "$HOST_LINK" 2>/dev/null || true
    for h in /sys/fs/cgroup/*/coldsnap-k8s /sys/fs/cgroup/coldsnap-k8s; do  # container processes: by cgroup
        [ -d "$h" ] || continue
        find "$h" -name cgroup.procs -exec cat {} + 2>/dev/null | while read -r p; do kill -9 "$p" 2>/dev/null || true; done
    done
    sleep 0.5
    for h in /sys/fs/cgroup/*/coldsnap-k8s /sys/fs/cgroup/coldsnap-k8s; do
        [ -d "$h" ] && find "$h" -depth -type d -exec rmdir {} \; 2>/dev/null
    done
    # kubelet leaves mounts (pod volumes) only inside the namespace, which is gone now.
    if [ "${CLEAN:-0}" = 1 ]; then
        rm -rf "$K8S_DIR/etcd" "$K8S_DIR/kubelet" "$K8S_DIR/containerd" "$K8S_DIR/cni/ipam" "$K8S_DIR/varlog"
    fi
    k8s_say "down"
}

case "${1:-up}" in
    up) k8s_up ;;
    down) k8s_down ;;
    env) k8s_env ;;
    deps) k8s_deps ;;  # only the Debian pieces (CI may warm its cache with this)
    *) echo "usage: $0 [up|down|env]" >&2; exit 2 ;;
esac
