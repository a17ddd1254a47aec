"""The router ships in the slim image: importing and running it must never import torch."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest

# Hides torch the way a slim image without it would: find_spec says "not installed", imports fail.
BLOCK_TORCH = textwrap.dedent(
    """
    import importlib.util, sys

    _find_spec = importlib.util.find_spec

    def _find_spec_without_torch(name, package=None):
        if name == "torch" or name.startswith("torch."):
            return None
        return _find_spec(name, package)

    importlib.util.find_spec = _find_spec_without_torch

    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError("No module named 'torch'", name=name)
            return None

    sys.meta_path.insert(0, _NoTorch())
    """
)


def run_py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_router_modules_never_import_torch(tiny_tokenizer):
    code = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        import pagedserve.router as pkg
        names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__, "pagedserve.router."))
        for name in names:
            importlib.import_module(name)
        expected = {{"hashing", "balancer", "discovery", "proxy", "metrics", "cli", "upstream"}}
        assert {{"pagedserve.router." + n for n in expected}} <= set(names)

        # Build everything the running router builds, tokenizer and chat template included.
        from pagedserve.router.hashing import PromptHasher
        from pagedserve.router.proxy import RouterApp, RouterConfig
        h = PromptHasher({tiny_tokenizer!r}, "m", 16)
        msgs = [{{"role": "user", "content": "x" * 100}}]
        assert h.hashes_for("/v1/chat/completions", {{"messages": msgs}})[0]
        app = RouterApp(RouterConfig(backends=["http://127.0.0.1:1"], tokenizer={tiny_tokenizer!r}))
        import argparse
        from pagedserve.router import cli
        p = argparse.ArgumentParser(); cli.add_arguments(p)
        cli.config_from_args(p.parse_args(["--backend", "http://127.0.0.1:1"])).validate()
        print("torch" in sys.modules)
        """
    )
    out = run_py(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    # And with torch made unimportable, as in the slim image.
    out = run_py(BLOCK_TORCH + code)
    assert out.returncode == 0, out.stderr


def test_router_entry_points_start_without_torch():
    out = run_py(
        BLOCK_TORCH + "import sys; sys.argv = ['x', '--help']; import runpy; "
        "runpy.run_module('pagedserve.router', run_name='__main__')"
    )
    assert "--k8s-service" in out.stdout, out.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("pagedserve.server.api.cli") is None,
    reason="`pagedserve serve` (pagedserve.server.api.cli) does not exist yet",
)
def test_pagedserve_router_command_starts_without_torch():
    """`pagedserve router` goes through the root CLI, which must not import the engine eagerly."""
    out = run_py(
        BLOCK_TORCH + "import sys; from pagedserve.cli import main; sys.exit(main(['router', '--help']))"
    )
    assert out.returncode == 0 and "--k8s-service" in out.stdout, out.stderr
