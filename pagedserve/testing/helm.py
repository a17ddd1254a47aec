"""Helm for the chart, operator and monitoring tests: find the tool, render and lint charts/pagedserve.

`make tools` (scripts/install-tools.sh) puts helm into .tools/bin; without it, helm from PATH is used.
The paths below are those of a source checkout (`pip install -e .`, as `make setup` does).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "pagedserve"
TOOLS_BIN = REPO / ".tools" / "bin"
NAMESPACE = "pagedserve-system"
RELEASE = "ps"


def find_tool(name: str) -> str | None:
    """A tool from .tools/bin (where `make tools` puts it), else from PATH."""
    local = TOOLS_BIN / name
    if local.exists() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    binary = find_tool("helm")
    if binary is None:
        raise FileNotFoundError("helm is not installed: run `make tools` (scripts/install-tools.sh)")
    with tempfile.TemporaryDirectory(prefix="helm-home-") as home:
        # Keep Helm's cache/config/data out of the user's home and independent between runs.
        env = {
            **os.environ,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
        }
        result = subprocess.run([binary, *args], capture_output=True, text=True, env=env, timeout=120)
    if check and result.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({result.returncode}):\n{result.stderr}")
    return result


def _values_args(values: dict[str, Any] | None, tmp: str) -> list[str]:
    if not values:
        return []
    path = Path(tmp) / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    return ["--values", str(path)]


def render(values: dict[str, Any] | None = None, *, include_crds: bool = True) -> list[dict[str, Any]]:
    """`helm template` the chart; returns the rendered objects (CRDs from crds/ included)."""
    with tempfile.TemporaryDirectory(prefix="chart-values-") as tmp:
        args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, *_values_args(values, tmp)]
        if include_crds:
            args.append("--include-crds")
        out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def lint(values: dict[str, Any] | None = None) -> str:
    with tempfile.TemporaryDirectory(prefix="chart-values-") as tmp:
        result = helm(
            "lint", "--strict", str(CHART), "--namespace", NAMESPACE, *_values_args(values, tmp), check=False
        )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def by_kind(objects: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o.get("kind") == kind]


def one(objects: Iterable[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(objects, kind)
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]
