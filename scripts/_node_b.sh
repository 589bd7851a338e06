#!/usr/bin/env bash
# A second node on this machine for the SSH-remote tests ("node-b"), idempotent:
#   * sshd on 127.0.0.2:${NODE_B_PORT:-2222}, in its own UTS namespace (hostname node-b) and mount namespace
#     (its own tmpfs /tmp), with its own host key, accepting only a dedicated client key as root;
#   * a second dockerd in node-b's mount namespace and in a network namespace of its own (a second dockerd in
#     the host's network namespace would delete the first one's docker0 bridge), with its own data root, exec
#     root and socket; only node-b's docker_socket names it.
# Everything lives under $NODE_B_DIR (default /run/coldsnap-node-b) plus a data root under /var/lib.
# Usage: scripts/_node_b.sh [up|down|env|packages]  (up is the default; env prints the paths as shell assignments;
# packages only installs what node-b needs: scripts/test --setup-only).
# All traffic stays on 127.0.0.0/8.
set -euo pipefail

NODE_B_DIR="${NODE_B_DIR:-/run/coldsnap-node-b}"
NODE_B_DATA="${NODE_B_DATA:-/var/lib/coldsnap-node-b}"
NODE_B_ADDRESS="${NODE_B_ADDRESS:-127.0.0.2}"
NODE_B_PORT="${NODE_B_PORT:-2222}"
SSHD_PID="$NODE_B_DIR/sshd.pid"
DOCKERD_PID="$NODE_B_DIR/dockerd.pid"
DOCKER_SOCKET="$NODE_B_DIR/docker.sock"
CLIENT_KEY="$NODE_B_DATA/client/id_ed25519"
KNOWN_HOSTS="$NODE_B_DATA/client/known_hosts"

nb_say() { printf '[node-b] %s\n' "$*" >&2; }

nb_alive() {  # nb_alive PIDFILE: the process runs (a zombie left by a killed session does not count)
    local pid state
    [ -s "$1" ] || return 1
    pid="$(cat "$1")"
    state="$(sed -E 's/^.*\) ([A-Za-z]).*$/\1/' "/proc/$pid/stat" 2>/dev/null)" || return 1
    [ -n "$state" ] && [ "$state" != Z ] && [ "$state" != X ]
}

nb_packages() {
    local missing=()
    [ -x /usr/sbin/sshd ] || missing+=(openssh-server)
    command -v ssh-keygen >/dev/null 2>&1 || missing+=(openssh-client)
    command -v ip >/dev/null 2>&1 || missing+=(iproute2)
    command -v unshare >/dev/null 2>&1 && command -v nsenter >/dev/null 2>&1 || missing+=(util-linux)
    if [ "${#missing[@]}" -gt 0 ]; then
        nb_say "installing ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    fi
}

nb_keys() {
    install -d -m 0700 "$NODE_B_DATA" "$NODE_B_DATA/ssh" "$NODE_B_DATA/client"
    [ -s "$NODE_B_DATA/ssh/host_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C node-b -f "$NODE_B_DATA/ssh/host_ed25519"
    [ -s "$CLIENT_KEY" ] || ssh-keygen -q -t ed25519 -N '' -C coldsnap-provider -f "$CLIENT_KEY"
    install -m 0600 "$CLIENT_KEY.pub" "$NODE_B_DATA/ssh/authorized_keys"
    local host="$NODE_B_ADDRESS"
    [ "$NODE_B_PORT" = 22 ] || host="[$NODE_B_ADDRESS]:$NODE_B_PORT"
    printf '%s %s\n' "$host" "$(cut -d' ' -f1,2 "$NODE_B_DATA/ssh/host_ed25519.pub")" > "$KNOWN_HOSTS"
    chmod 0600 "$KNOWN_HOSTS"
    cat > "$NODE_B_DATA/ssh/sshd_config" <<EOF
ListenAddress $NODE_B_ADDRESS:$NODE_B_PORT
HostKey $NODE_B_DATA/ssh/host_ed25519
PidFile $SSHD_PID
AuthorizedKeysFile $NODE_B_DATA/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
AllowStreamLocalForwarding yes
AllowTcpForwarding local
X11Forwarding no
PrintMotd no
MaxSessions 256
MaxStartups 64:30:128
Subsystem sftp internal-sftp
EOF
}

nb_sshd() {
    nb_alive "$SSHD_PID" && return
    install -d -m 0755 /run/sshd
    /usr/sbin/sshd -t -f "$NODE_B_DATA/ssh/sshd_config"
    nb_say "starting sshd on $NODE_B_ADDRESS:$NODE_B_PORT (hostname node-b, own /tmp; log $NODE_B_DIR/sshd.log)"
    # The inner shell makes node-b's namespaces, then becomes sshd (which writes its own pid file).
    setsid unshare --mount --uts --propagation private -- sh -c '
        hostname node-b
        mount -t tmpfs -o mode=1777 node-b-tmp /tmp
        exec /usr/sbin/sshd -D -e -f "$1"
    ' node-b "$NODE_B_DATA/ssh/sshd_config" >>"$NODE_B_DIR/sshd.log" 2>&1 < /dev/null 9>&- &
    for _ in $(seq 1 100); do
        nb_alive "$SSHD_PID" && return
        sleep 0.1
    done
    nb_say "sshd did not start:"; cat "$NODE_B_DIR/sshd.log" >&2; exit 1
}

nb_dockerd() {
    if nb_alive "$DOCKERD_PID" && docker -H "unix://$DOCKER_SOCKET" version >/dev/null 2>&1; then return; fi
    if nb_alive "$DOCKERD_PID"; then
        :  # starting up (or restarting): wait below
    else
        local sshd_pid
        sshd_pid="$(cat "$SSHD_PID")"
        nb_say "starting node-b's dockerd (socket $DOCKER_SOCKET; log $NODE_B_DIR/dockerd.log)"
        install -d -m 0700 "$NODE_B_DATA/docker" "$NODE_B_DIR/exec"
        # Pid files of a node-b that was killed (its processes may linger as zombies, which dockerd
        # and its containerd would take for live ones).
        rm -f "$DOCKER_SOCKET" "$DOCKERD_PID"
        nb_alive "$NODE_B_DIR/exec/containerd/containerd.pid" || rm -f "$NODE_B_DIR/exec/containerd/containerd.pid"
        # node-b's mount namespace (same /tmp as its sshd), a network namespace of its own.
        setsid nsenter --target "$sshd_pid" --mount --uts -- unshare --net -- sh -c '
            ip link set lo up
            exec dockerd --data-root "$1/docker" --exec-root "$2/exec" --pidfile "$2/dockerd.pid" \
                -H "unix://$2/docker.sock"
        ' node-b "$NODE_B_DATA" "$NODE_B_DIR" >>"$NODE_B_DIR/dockerd.log" 2>&1 < /dev/null 9>&- &
    fi
    for _ in $(seq 1 300); do
        docker -H "unix://$DOCKER_SOCKET" version >/dev/null 2>&1 && return
        sleep 0.2
    done
    nb_say "node-b's dockerd did not start:"; tail -n 50 "$NODE_B_DIR/dockerd.log" >&2; exit 1
}

nb_env() {
    cat <<EOF
NODE_B_DIR=$NODE_B_DIR
NODE_B_DATA=$NODE_B_DATA
NODE_B_ADDRESS=$NODE_B_ADDRESS
NODE_B_PORT=$NODE_B_PORT
NODE_B_SSHD_PID_FILE=$SSHD_PID
NODE_B_DOCKERD_PID_FILE=$DOCKERD_PID
NODE_B_DOCKER_SOCKET=$DOCKER_SOCKET
NODE_B_CLIENT_KEY=$CLIENT_KEY
NODE_B_KNOWN_HOSTS=$KNOWN_HOSTS
NODE_B_HOST_PUBLIC_KEY=$NODE_B_DATA/ssh/host_ed25519.pub
EOF
}

nb_down() {
    local f
    for f in "$DOCKERD_PID" "$SSHD_PID"; do
        if nb_alive "$f"; then
            kill "$(cat "$f")"
            for _ in $(seq 1 100); do nb_alive "$f" || break; sleep 0.1; done
        fi
    done
}

nb_up() {
    [ "$(id -u)" = 0 ] || { nb_say "node-b needs root (namespaces, a second dockerd)"; exit 1; }
    install -d -m 0700 "$NODE_B_DIR"
    exec 9>"$NODE_B_DIR/.lock"
    flock 9
    nb_packages
    nb_keys
    nb_sshd
    nb_dockerd
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    case "${1:-up}" in
        up) nb_up; nb_env ;;
        down) nb_down ;;
        env) nb_env ;;
        packages) nb_packages ;;
        *) echo "usage: $0 [up|down|env|packages]" >&2; exit 2 ;;
    esac
fi
