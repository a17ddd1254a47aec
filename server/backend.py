"""The kernel backend, chosen once per engine from (device, dtype, name) by ``select_backend``.

The engine (server/engine/llm_engine.py) calls ``select_backend`` once and hands the result to model
construction (server/loader/weights.py ``load_model``) and to the model runner
(server/worker/model_runner.py), which asks it whether decode steps may run in CUDA graphs
(server/worker/cuda_graphs.py). Nothing else picks kernels: the model binds ``backend.kernels`` into
every layer when it is built, and the quantized weight formats (server/layers/quantization/) run its
``w8a16_matmul`` (Triton on CUDA, kernels/csrc/w8a16_cpu.cpp on the CPU, the reference otherwise).

Backends (every one a module with the functions named in ``pagedserve.kernels.KERNELS``):

* ``triton``: ``pagedserve.kernels`` (kernels/), the default on CUDA. On a CPU only in a process that
  runs Triton's interpreter (``TRITON_INTERPRET=1``), which the tests use.
* ``cpu``: ``pagedserve.kernels.cpu`` (kernels/cpu.py), C++ kernels for float32 on the CPU, the default
  there. Its decode attention reads float32 and FP8 KV caches alike: with ``kv_cache_dtype="fp8"`` it
  stays the backend (the torch reference's FP8 decode measured 20-50x slower than the C++'s; the C++
  reads an FP8 cache 1.9x faster than a float32 one once contexts outgrow the CPU caches).
* ``torch``: ``pagedserve.kernels.reference`` (kernels/reference.py), pure torch, any device and dtype.

An FP8 KV cache needs Triton's e4m3 conversions, which exist on GPUs of compute capability 8.9 and
later: the ``triton`` backend refuses it on older ones at start-up.

Where ``cpu`` cannot run its C++ (another dtype, a CUDA device, or no compiler to build it), the torch
references would run behind its name, so the choice says so: it resolves to ``torch`` with a warning.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass
from types import ModuleType

import torch
from pagedserve.common.engine_args import ATTENTION_BACKENDS

BACKEND_ENV = "PAGEDSERVE_ATTENTION_BACKEND"
BACKEND_NAMES = ATTENTION_BACKENDS  # declared with the attention_backend setting

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backend:
    name: str  # one of BACKEND_NAMES: what actually runs, after any fallback
    kernels: ModuleType  # the functions of pagedserve.kernels.KERNELS
    # Only the Triton kernels on CUDA keep context lengths on the device; the references and the C++
    # kernels read them on the host, which a captured graph cannot do.
    supports_cuda_graphs: bool


def select_backend(
    device: torch.device,
    dtype: torch.dtype,
    name: str | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> Backend:
    """The backend for ``device``, ``dtype`` and a KV cache of ``kv_cache_dtype`` (default ``dtype``):
    ``name``, else ``$PAGEDSERVE_ATTENTION_BACKEND``, else triton on CUDA and cpu elsewhere.
    ``ValueError`` for an unknown name or triton where it cannot run."""
    requested = (name or os.environ.get(BACKEND_ENV) or "").lower()
    if requested and requested not in BACKEND_NAMES:
        raise ValueError(f"{BACKEND_ENV} (or attention_backend) must be one of {', '.join(BACKEND_NAMES)}, "
                         f"got {requested!r}")
    choice = requested or ("triton" if device.type == "cuda" else "cpu")
    if choice == "triton":
        return _triton(device, kv_cache_dtype)
    if choice == "cpu":
        return _cpu(device, dtype)
    return _torch()


def _triton(device: torch.device, kv_cache_dtype: torch.dtype | None) -> Backend:
    if importlib.util.find_spec("triton") is None:
        raise ValueError("the triton backend needs Triton installed; set "
                         f"{BACKEND_ENV}=torch to run the torch references instead")
    if device.type != "cuda":
        from pagedserve.kernels._triton_utils import interpreter_active

        if not interpreter_active():
            raise ValueError(f"the triton backend needs a CUDA device, got {device} (on a CPU it runs only "
                             "in a process started with TRITON_INTERPRET=1)")
    if kv_cache_dtype == torch.float8_e4m3fn and device.type == "cuda":
        # Triton converts to and from e4m3 (fp8e4nv) only on Ada, Hopper and later GPUs.
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or later for the "
                             f"triton backend, got {capability[0]}.{capability[1]}; use kv_cache_dtype auto")
    import pagedserve.kernels as triton_kernels

    return Backend("triton", triton_kernels, supports_cuda_graphs=device.type == "cuda")


def _cpu(device: torch.device, dtype: torch.dtype) -> Backend:
    from pagedserve.kernels import cpu

    if device.type != "cpu" or dtype != torch.float32:
        logger.warning("the cpu backend's C++ kernels take float32 on the CPU, not %s on %s: "
                       "using the torch references", dtype, device)
        return _torch()
    if cpu.load_extension() is None:  # compiles now, not inside the first request; it logged why not
        return _torch()
    return Backend("cpu", cpu, supports_cuda_graphs=False)


def _torch() -> Backend:
    from pagedserve.kernels import reference

    return Backend("torch", reference, supports_cuda_graphs=False)


def cpu_kernel_report(backend_name: str | None) -> dict[str, str] | None:
    """What /version says of the C++ CPU kernels (server/api/protocol.py ``CpuKernels``): which ISA level's
    build runs, where it came from, the CPU as the kernels see it and the dtype of batched GGUF rows'
    copies. None unless the ``cpu`` backend runs, whose choice loaded them already."""
    if backend_name != "cpu":
        return None
    from pagedserve.kernels import cpu

    library = cpu.loaded_library()
    if library is None:
        return None
    return {"level": library.level, "origin": library.origin, "cpu": cpu.cpu_features().describe(),
            "gguf_dense_dtype": str(cpu.dense_dtype()).removeprefix("torch.")}
