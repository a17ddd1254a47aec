"""Shared fixtures."""

from __future__ import annotations

import os

import pytest

# Before anything imports torch: spinning OpenMP threads slow torch several-fold when test servers
# share the two cores with pytest (see pagedserve/cli.py, which sets the same default).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def default_model_path() -> str:
    """The embedded default model's HF folder (converted into the user cache on first use, ~30 s once)."""
    import pagedserve

    return pagedserve.default_model()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Run a module's torch work on one thread (``pytestmark = pytest.mark.usefixtures(...)``).

    Small CPU ops stall badly when OpenMP threads share two busy cores with other test processes
    (a 20x slowdown seen with servers running beside pytest); one thread is faster there.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
