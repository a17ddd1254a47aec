"""Helpers for the benchmark tests: the stand-in server (the fake OpenAI backend), argument parsing."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

from pagedserve.testing.processes import ServerProcess, fake_openai_process

STANDIN_MODEL = "standin-model"


@contextlib.contextmanager
def standin(log_path: Path, *flags: str) -> Iterator[ServerProcess]:
    """pagedserve/testing/fake_openai.py in its own process (so that ``--die-after`` can end it), ready."""
    with fake_openai_process(log_path, "--name", STANDIN_MODEL, *flags) as fake:
        fake.wait_ready(30)
        yield fake


def bench_args(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)
