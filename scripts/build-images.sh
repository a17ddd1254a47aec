#!/usr/bin/env bash
# `make images`: every Dockerfile target built with podman (runc), tagged with the names the operator and
# the chart deploy by default (operator/resources.py: DEFAULT_IMAGE, DEFAULT_CPU_IMAGE, DEFAULT_ROUTER_IMAGE).
#
#   IMAGE_BASE=local (default): every stage on localhost/debian-base:bookworm (scripts/install-podman.sh
#     makes it with debootstrap; Python 3.11 from Debian), torch pinned to $TORCH_REQUIREMENT, and this
#     machine's pip configuration bind-mounted into the build (scripts/pip_build_mounts.py), not baked in.
#   IMAGE_BASE=upstream: the Dockerfile's default base images (pull access needed); the CPU flavour on
#     Debian with torch from the PyTorch CPU index.
# Prints each build's time and the images' sizes.
set -euo pipefail
cd "$(dirname "$0")/.."
# ./operator would shadow the standard library module for a Python started here.
export PYTHONSAFEPATH=1
PYTHON="${PYTHON:-.venv/bin/python}"
IMAGE_BASE="${IMAGE_BASE:-local}"
LOCAL_BASE="${LOCAL_BASE:-localhost/debian-base:bookworm}"
TORCH_REQUIREMENT="${TORCH_REQUIREMENT:-torch}"
CPU_TORCH_INDEX_URL="${CPU_TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
# The Dockerfile's pinned Debian base: one place for the digest.
UPSTREAM_DEBIAN="${UPSTREAM_DEBIAN:-$(sed -n 's/^ARG DEBIAN_IMAGE=//p' Dockerfile)}"

read -r SERVER_IMAGE CPU_IMAGE CONTROL_IMAGE < <("$PYTHON" -c '
from pagedserve.operator.resources import DEFAULT_CPU_IMAGE, DEFAULT_IMAGE, DEFAULT_ROUTER_IMAGE
print(DEFAULT_IMAGE, DEFAULT_CPU_IMAGE, DEFAULT_ROUTER_IMAGE)')

work=$(mktemp -d)
# shellcheck disable=SC2064
trap "rm -rf '$work'" EXIT
common=(--runtime runc --network host --layers)
server_args=() cpu_args=(--build-arg "CUDA_IMAGE=$UPSTREAM_DEBIAN" --build-arg "TORCH_INDEX_URL=$CPU_TORCH_INDEX_URL")
if [ "$IMAGE_BASE" = local ]; then
  # shellcheck disable=SC2207
  common+=($("$PYTHON" scripts/pip_build_mounts.py "$work") --build-arg "DEBIAN_IMAGE=$LOCAL_BASE")
  server_args=(--build-arg "CUDA_IMAGE=$LOCAL_BASE" --build-arg "TORCH_REQUIREMENT=$TORCH_REQUIREMENT")
  cpu_args=("${server_args[@]}")
fi

build() {  # build TAG TARGET [ARGS...]
  local tag=$1 target=$2 start=$SECONDS
  shift 2
  podman build "${common[@]}" "$@" --target "$target" -t "$tag" .
  echo "images: built $tag (target $target) in $((SECONDS - start)) s"
}
build "$CONTROL_IMAGE" control
build "$SERVER_IMAGE" server "${server_args[@]}"
build "$CPU_IMAGE" server "${cpu_args[@]}"
for tag in "$SERVER_IMAGE" "$CPU_IMAGE" "$CONTROL_IMAGE"; do
  echo "images: $tag $(podman image inspect --format '{{.Size}}' "$tag" | numfmt --to=iec --suffix=B)"
done
