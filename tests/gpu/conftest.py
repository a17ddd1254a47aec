"""GPU tests: every module is marked ``gpu`` and skipped without CUDA (``pytestmark = GPU``)."""

import pytest
from pagedserve.benchmarks.gpu import random_model

from pagedserve.testing.gpu import MODELS


@pytest.fixture(scope="session", params=sorted(MODELS))
def random_model_path(request) -> str:
    """Each random-weight Llama-family test model, built once per machine (benchmarks/gpu/random_model.py)."""
    shape, overrides = MODELS[request.param]
    return str(random_model.cached_random_model(shape, **overrides))
