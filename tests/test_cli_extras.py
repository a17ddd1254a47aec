"""`pagedserve` where only some extras are installed, as in each image (the server image has no [router])."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_missing_extra_breaks_only_its_own_subcommand() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cachetools"] = None  # not installed: [router] only (router/segment_cache.py)
        from pagedserve.cli import build_parser, main

        args = build_parser().parse_args(["serve", "--port", "1"])
        assert args.port == 1 and args.command == "serve"
        assert main(["router", "--backend", "http://127.0.0.1:1"]) == 2
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "pagedserve router cannot run: " in done.stderr and "cachetools" in done.stderr, done.stderr
