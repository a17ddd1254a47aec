"""The operator ships in the slim image: importing it must never pull torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODULES = [
    "pagedserve.operator",
    "pagedserve.operator.spec",
    "pagedserve.operator.resources",
    "pagedserve.operator.status",
    "pagedserve.operator.kube",
    "pagedserve.operator.reconcile",
    "pagedserve.operator.handlers",
    "pagedserve.operator.main",
]


def test_no_torch_in_sys_modules(tmp_path: Path) -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {MODULES!r}: importlib.import_module(name)\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'transformers'))\n"
        "assert not heavy, heavy\n"
        "import pagedserve.operator.main as main, argparse\n"
        "main.add_arguments(argparse.ArgumentParser())\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    # Run outside the repository: its top-level folder `operator/` must not shadow the stdlib module.
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
