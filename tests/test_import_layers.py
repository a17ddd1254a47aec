"""The package's folders form layers: every import, ``TYPE_CHECKING`` and function-local ones included,
goes from a folder to itself or to one listed before it in ``LAYERS``, so no two folders import each
other and a lower folder never needs a higher one. A layer above that a lower one must call is declared
below as a Protocol (server/layers/linear.py ``OutputDelta``, server/worker/model_runner.py
``OtherRanks``). The walk reads the source with ``ast``: nothing is imported."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Lowest first. "server" is server/*.py: the engine's shared types (config, request, sampling
# parameters, outputs, errors). "pagedserve/base" is pagedserve/version.py and pagedserve/cache.py;
# "common" what the engine server, the router and the operator share, torch-free (common/__init__.py).
LAYERS = [
    "pagedserve/base",
    "common",
    "kernels",
    "server",
    "server/kv_transfer",
    "server/distributed",
    "server/layers",
    "server/lora",
    "server/models",
    "server/loader",
    "server/structured_output",
    "server/sample",
    "server/core",
    "server/spec_decode",
    "server/worker",
    "server/executor",
    "server/engine",
    "server/entrypoints",
    "server/api",
    "operator",
    "router",
    "pagedserve",
    "testing",
    "benchmarks",
]
SOURCE_FOLDERS = ["common", "kernels", "server", "router", "operator", "benchmarks", "pagedserve"]
# Modules (by import name) that name the folder each lives in, longest prefix first.
PACKAGE_FOLDERS = {
    "pagedserve.testing": "pagedserve/testing",
    "pagedserve.server": "server",
    "pagedserve.kernels": "kernels",
    "pagedserve.common": "common",
    "pagedserve.router": "router",
    "pagedserve.operator": "operator",
    "pagedserve.benchmarks": "benchmarks",
    "pagedserve": "pagedserve",
}
BASE_MODULES = {"pagedserve/version.py", "pagedserve/cache.py"}


@dataclass(frozen=True)
class Import:
    source: str  # the importing file, relative to the repository root
    module: str  # the imported module's full name


def layer_of_path(path: str) -> str:
    """The layer of a file or folder path relative to the root (``server/core/scheduler.py``)."""
    if path in BASE_MODULES:
        return "pagedserve/base"
    parts = path.split("/")
    if parts[0] == "pagedserve":
        return "testing" if len(parts) > 2 and parts[1] == "testing" else "pagedserve"
    if parts[0] == "server" and len(parts) > 2:
        return f"server/{parts[1]}"
    return parts[0]


def path_of_module(module: str) -> str | None:
    """Where an import of ours points (a folder or a ``.py`` path); None for other packages."""
    for package in sorted(PACKAGE_FOLDERS, key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            rest = module[len(package):].lstrip(".").split(".") if module != package else []
            folder = ROOT / PACKAGE_FOLDERS[package]
            for part in rest:
                if (folder / part).is_dir():
                    folder = folder / part
                    continue
                if (folder / f"{part}.py").is_file():
                    return str((folder / f"{part}.py").relative_to(ROOT))
                break
            return str(folder.relative_to(ROOT)) + ("/__init__.py" if folder.is_dir() else "")
    return None


def package_of_path(path: str) -> str:
    """The package a file of ours is in (``server/core/scheduler.py`` -> ``pagedserve.server.core``)."""
    folder = path.rsplit("/", 1)[0]
    for package, root in sorted(PACKAGE_FOLDERS.items(), key=lambda item: len(item[1]), reverse=True):
        if folder == root or folder.startswith(root + "/"):
            return ".".join([package, *folder[len(root):].strip("/").split("/")]).rstrip(".")
    raise ValueError(f"{path} is in none of PACKAGE_FOLDERS")


def absolute_module(source: str, module: str | None, level: int) -> str:
    """What ``from <dots><module> import ...`` in ``source`` names."""
    if level == 0:
        return module or ""
    parts = package_of_path(source).split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join([*base, *([module] if module else [])])


def imports_of(path: Path) -> list[Import]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    source = str(path.relative_to(ROOT))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(source, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = absolute_module(source, node.module, node.level)
            found.append(Import(source, module))
            # "from pagedserve.server import config": the names may be modules themselves.
            found += [Import(source, f"{module}.{alias.name}") for alias in node.names]
    return found


def all_imports() -> list[Import]:
    return [imp for folder in SOURCE_FOLDERS for path in sorted((ROOT / folder).rglob("*.py"))
            for imp in imports_of(path)]


def upward_imports(imports: list[Import]) -> list[str]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for imp in imports:
        target = path_of_module(imp.module)
        if target is None:
            continue
        source_layer, target_layer = layer_of_path(imp.source), layer_of_path(target)
        if rank[target_layer] > rank[source_layer]:
            bad.append(f"{imp.source} ({source_layer}) imports {imp.module} ({target_layer})")
    return sorted(set(bad))


def test_every_folder_has_a_layer():
    folders = {layer_of_path(str(p.relative_to(ROOT))) for folder in SOURCE_FOLDERS
               for p in (ROOT / folder).rglob("*.py")}
    assert folders <= set(LAYERS), f"folders without a place in LAYERS: {sorted(folders - set(LAYERS))}"


def test_no_folder_imports_a_higher_one():
    assert upward_imports(all_imports()) == []


@pytest.mark.parametrize(("folder", "peer"), [("router", "operator"), ("operator", "router")])
def test_router_and_operator_stay_off_torch_and_the_engine(folder, peer):
    """They share only common/ with the engine server and with each other: each ships in the slim image
    and neither reaches into the other."""
    heavy = ("torch", "triton", "pagedserve.server", "pagedserve.kernels", f"pagedserve.{peer}")
    found = sorted({f"{imp.source}: {imp.module}" for path in (ROOT / folder).rglob("*.py")
                    for imp in imports_of(path) if imp.module.startswith(heavy)})
    assert found == []


def test_the_walk_sees_an_upward_import():
    """The check itself: an import from a low folder into a high one is reported, a downward one is not."""
    assert path_of_module("pagedserve.server.engine.core") == "server/engine/core.py"
    assert path_of_module("pagedserve.server.core.scheduler.Scheduler") == "server/core/scheduler.py"
    assert path_of_module("pagedserve.version") == "pagedserve/version.py"
    assert path_of_module("torch") is None
    assert layer_of_path("server/config.py") == "server"
    assert layer_of_path("pagedserve/testing/kube.py") == "testing"
    up = Import("server/core/scheduler.py", "pagedserve.server.engine.core")
    down = Import("server/engine/core.py", "pagedserve.server.core.scheduler")
    assert upward_imports([up, down]) == [
        "server/core/scheduler.py (server/core) imports pagedserve.server.engine.core (server/engine)"
    ]
    assert any(imp.module == "pagedserve.server.config" for imp in imports_of(ROOT / "server/engine/core.py"))
    assert absolute_module("kernels/__init__.py", "reference", 1) == "pagedserve.kernels.reference"
    assert absolute_module("server/core/scheduler.py", "engine.core", 2) == "pagedserve.server.engine.core"
