#!/usr/bin/env bash
# Installs what `make images` and `make image-test` need: Debian's podman with runc, and debootstrap for
# the local base image (no registry is reachable from CI). Idempotent; apt-get only for what is missing.
#
#   /etc/containers/containers.conf gets `default_ulimits = []` when it has no such key: podman's
#   default nofile ulimit is refused inside the CI machine's own container.
#   localhost/debian-base:bookworm: `debootstrap --variant=minbase bookworm` imported as an image;
#   `make images` builds every target on it (Python 3.11 from Debian).
# Exits non-zero with one line on stderr where podman cannot be had (no root to install it).
set -euo pipefail
LOCAL_BASE="${LOCAL_BASE:-localhost/debian-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"

missing=()
for tool in podman runc debootstrap; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo=""
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "images: ${missing[*]} missing and installing them needs root (apt-get install podman runc debootstrap)" >&2
      exit 1
    fi
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends podman runc debootstrap >/dev/null
fi

conf=/etc/containers/containers.conf
if ! grep -qs '^\s*default_ulimits' "$conf"; then
  if [ -w "$(dirname "$conf")" ]; then
    if grep -qs '^\s*\[containers\]' "$conf"; then
      sed -i 's/^\s*\[containers\].*/&\ndefault_ulimits = []/' "$conf"
    else
      printf '[containers]\ndefault_ulimits = []\n' >>"$conf"
    fi
  else
    echo "images: $conf needs [containers] default_ulimits = [] (needs root)" >&2
    exit 1
  fi
fi

if ! podman image exists "$LOCAL_BASE"; then
  root=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$root'" EXIT
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | podman import --quiet - "$LOCAL_BASE" >/dev/null
fi
echo "images: $(podman --version), runc $(runc --version | head -n 1 | awk '{print $3}'), base $LOCAL_BASE"
