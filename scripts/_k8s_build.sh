#!/usr/bin/env bash
# Build the Kubernetes server binaries the Kubernetes tests run (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet) from Debian's source package, into a cache outside the repository:
#   scripts/_k8s_build.sh            # no-op when the cached binaries match their stamp
# Why this version and toolchain: these machines reach Debian's and PyPI's registries only (no Go module proxy,
# no release downloads, no container registry). Debian bookworm's kubernetes source package is the newest one
# that still carries the whole server tree (vendor/ included); newer Debian sources ship kubectl only.
# Kubernetes 1.20 needs Go 1.15 (a newer Go builds binaries that panic in json-iterator/reflect2 at run time),
# which Debian bullseye has. apt runs with a private configuration: /etc/apt is never touched.
# About 6 minutes from scratch on 2 cores; run under nice so it never starves the machine.
set -euo pipefail

K8S_VERSION=v1.20.2
K8S_COMMIT=faecb196815e248d3ecfb03c680a4507229c2a56
DEB_SOURCE_VERSION=1.20.5+really1.20.2-1.1+deb12u1
CACHE="${COLDSNAP_K8S_CACHE:-/var/cache/coldsnap-k8s}"
OUT="$CACHE/$K8S_VERSION/bin"
WORK="$CACHE/build"
WHAT=(kube-apiserver kube-controller-manager kube-scheduler kubelet)
STAMP="$OUT/.stamp"

say() { printf '[k8s-build] %s\n' "$*" >&2; }

# The stamp names the recipe (version, source package, toolchain) and each binary's digest: a binary that was
# truncated or replaced, or a recipe change, means a rebuild. Hashing 400 MB costs seconds, so a second file
# keeps sizes and mtimes: when they match the stamp's moment, the digests are not recomputed.
recipe() { printf '%s %s %s go1.15 %s\n' "$K8S_VERSION" "$K8S_COMMIT" "$DEB_SOURCE_VERSION" "${WHAT[*]}"; }
stamp_now() { recipe; (cd "$OUT" && sha256sum "${WHAT[@]}"); }
quick_now() { recipe; (cd "$OUT" && stat -c '%n %s %Y' "${WHAT[@]}"); }
if [ -s "$STAMP" ] && [ "$(quick_now 2>/dev/null)" = "$(cat "$STAMP.quick" 2>/dev/null)" ]; then
    exit 0
fi
if [ -s "$STAMP" ] && [ "$(stamp_now 2>/dev/null)" = "$(cat "$STAMP")" ]; then
    quick_now > "$STAMP.quick"
    exit 0
fi

mirror() {  # the machine's own Debian mirror, as its apt configuration names it
    local m
    m="$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1 | awk '{print $2}')"
    [ -n "$m" ] || m="$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | head -1 | awk '{print $2}')"
    printf '%s' "${m:-http://deb.debian.org/debian}"
}

for tool in make patch tar xz gcc; do
    command -v "$tool" >/dev/null || { say "installing build tools"; apt-get update -qq;
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq make patch tar xz-utils gcc >/dev/null; break; }
done

T0=$(date +%s)
mkdir -p "$OUT" "$WORK/src" "$WORK/apt/lists/partial" "$WORK/apt/cache" "$WORK/go"
MIRROR="$(mirror)"
printf 'deb-src %s bookworm main\ndeb %s bullseye main\n' "$MIRROR" "$MIRROR" > "$WORK/apt/sources.list"
APT=(-o "Dir::Etc::SourceList=$WORK/apt/sources.list" -o Dir::Etc::SourceParts=/dev/null
     -o "Dir::State::Lists=$WORK/apt/lists" -o "Dir::Cache=$WORK/apt/cache" -o Dir::State::status=/dev/null
     -o APT::Sandbox::User=root)
say "downloading the kubernetes $DEB_SOURCE_VERSION source package and Go 1.15 (Debian)"
apt-get "${APT[@]}" update -qq
cd "$WORK/src"
[ -s "kubernetes_${DEB_SOURCE_VERSION%-*}.orig.tar.gz" ] \
    || apt-get "${APT[@]}" source --download-only "kubernetes=$DEB_SOURCE_VERSION" -qq
if [ ! -x "$WORK/go/usr/lib/go-1.15/bin/go" ]; then
    apt-get "${APT[@]}" download golang-1.15-go golang-1.15-src -qq
    for d in golang-1.15-*.deb; do dpkg -x "$d" "$WORK/go"; done
fi

TREE="$WORK/src/kubernetes-1.20.2"
if [ ! -f "$TREE/.coldsnap-patched" ]; then
    say "unpacking and applying Debian's patches"
    rm -rf "$TREE"
    tar xzf "kubernetes_${DEB_SOURCE_VERSION%-*}.orig.tar.gz"
    tar xJf "kubernetes_${DEB_SOURCE_VERSION}.debian.tar.xz" -C "$TREE"
    (cd "$TREE" && while read -r p; do [ -n "$p" ] && patch -p1 -s < "debian/patches/$p"; done < debian/patches/series)
    touch "$TREE/.coldsnap-patched"
fi

export GOROOT="$WORK/go/usr/lib/go-1.15" GO111MODULE=off CGO_ENABLED=0 GOFLAGS= GOPROXY=off
export GOCACHE="$WORK/gocache" PATH="$WORK/go/usr/lib/go-1.15/bin:$WORK/shim:$PATH"
# hack/lib calls 'rsync -pc SRC DST' to place generated files; a copy does the same here.
mkdir -p "$WORK/shim"
printf '#!/bin/sh\nshift\nexec cp -p "$@"\n' > "$WORK/shim/rsync"
chmod +x "$WORK/shim/rsync"
if [ ! -f "$TREE/.coldsnap-openapi" ]; then
    say "generating the OpenAPI code (not shipped in the source tarball)"
    (cd "$TREE" && unset GOPATH && make gen_openapi >/dev/null)
    touch "$TREE/.coldsnap-openapi"
fi

# GOPATH mode: module mode refuses the vendored tree ("updates to go.mod needed").
export GOPATH="$WORK/gopath"
mkdir -p "$GOPATH/src/k8s.io"
ln -sfn "$TREE" "$GOPATH/src/k8s.io/kubernetes"
cd "$GOPATH/src/k8s.io/kubernetes"
LD="-s -w"
# The version variables live under vendor/ in GOPATH mode; set elsewhere the server reports v0.0.0-master.
for p in k8s.io/kubernetes/vendor/k8s.io/component-base/version k8s.io/kubernetes/vendor/k8s.io/client-go/pkg/version; do
    LD="$LD -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=20 -X $p.gitCommit=$K8S_COMMIT"
    LD="$LD -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
done
for c in "${WHAT[@]}"; do
    s=$(date +%s)
    go build -trimpath -ldflags "$LD" -o "$OUT/$c.tmp" "./cmd/$c"
    mv -f "$OUT/$c.tmp" "$OUT/$c"
    say "built $c in $(( $(date +%s) - s ))s"
done
stamp_now > "$STAMP"
quick_now > "$STAMP.quick"
say "done in $(( $(date +%s) - T0 ))s: $OUT"
