"""``load_model``: build our torch model from a Hugging Face folder and load its weights."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from pagedserve.server.backend import Backend
    from pagedserve.server.distributed.parallel_state import PipelineStage, TensorParallel

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """``"auto"``: float32 on CPU, bfloat16 on CUDA; otherwise a torch dtype or its name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype.lower().removeprefix("torch.")
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


def load_config(path: str | Path) -> Any:
    """The folder's ``config.json`` as a ``transformers`` config object."""
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model folder {str(path)!r} has no config.json")
    return AutoConfig.from_pretrained(str(path))


def load_model(
    path: str | Path,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    *,
    backend: Backend,
    load_format: str = "auto",
    quantization: str | None = None,
    tp: TensorParallel | None = None,
    stage: PipelineStage | None = None,
    runner: str = "generate",
) -> tuple[nn.Module, Any]:
    """Build the model for the folder's config on ``device``, running ``backend``'s kernels
    (server/backend.py), and load its weights: ``(model, hf_config)``.

    ``quantization`` (server/layers/quantization/, e.g. "int8") switches the projections to that weight
    format before loading, so each checkpoint tensor is quantized as it is read (no fp32 copy of the
    model). ``tp``: this rank's place under tensor parallelism (server/distributed/): the model holds
    only its shard, cut from each checkpoint tensor as it is read. ``stage``: its pipeline stage: the model
    holds only that stage's layers, and the other tensors are not read. ``load_format="dummy"`` skips the
    checkpoint and fills the weights with small random values (for benchmarks of large shapes from a
    config.json alone). ``runner="pooling"``: the model without its LM head, whose weights an embedding
    checkpoint may not ship and which no pooled vector reads. The model is in eval mode; call it under
    ``torch.inference_mode()``.
    """
    from pagedserve.server.distributed.parallel_state import ONE_STAGE, SINGLE, building
    from pagedserve.server.layers.quantization import process_weights_after_loading, quantize_linears
    from pagedserve.server.models.registry import build_model, check_tensor_parallel

    device = torch.device(device)
    hf_config = load_config(path)
    tp, stage = tp or SINGLE, stage or ONE_STAGE
    check_tensor_parallel(hf_config, tp.size)
    with building(tp, stage):
        model = build_model(hf_config, resolve_dtype(dtype, device), device, backend)
    if runner == "pooling":
        model.lm_head = None  # its checkpoint tensor, if any, is skipped as a tied model's is
    quantize_linears(model, quantization, backend.kernels)
    if load_format == "dummy":
        initialize_dummy_weights(model)
    elif load_format == "auto":
        # --quantization gguf: the projections' blocks from the GGUF file, the rest from the folder.
        blocks = checkpoint_blocks(path, hf_config, tp.size) if quantization == "gguf" else {}
        # Under tensor parallelism each rank reads only its piece of each split tensor, and under pipeline
        # parallelism only its stage's tensors.
        def skipped(name: str) -> bool:
            return name in blocks or (stage.size > 1 and model.route_weight(name) is None)

        weights = iterate_weights(path, model.checkpoint_piece if tp.size > 1 else None, skip=skipped)
        model.load_weights(itertools.chain(blocks.items(), weights))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    process_weights_after_loading(model)
    return model.eval(), hf_config


def checkpoint_blocks(path: str | Path, hf_config: Any, tp_size: int) -> dict[str, torch.Tensor]:
    """The GGUF blocks of the file the folder ``path`` was converted from (server/loader/gguf.py)."""
    from pagedserve.server.loader.default_model import source_gguf
    from pagedserve.server.loader.gguf import gguf_blocks

    source = source_gguf(path)
    if source is None:
        raise ValueError(
            f"quantization='gguf' needs a .gguf model (or the embedded default model); {str(path)!r} was not "
            "converted from a GGUF file by this version (an older conversion: delete the folder to redo it)"
        )
    if tp_size > 1:
        raise ValueError("quantization='gguf' runs on one rank (its blocks are not cut per rank)")
    return gguf_blocks(source, hf_config)


def weight_files(path: str | Path) -> list[Path]:
    """The checkpoint files: the shards named by ``model.safetensors.index.json``, else every
    ``*.safetensors``, else ``pytorch_model*.bin``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise FileNotFoundError(f"model folder {str(path)!r} has no *.safetensors or pytorch_model*.bin")
    return files


def iterate_weights(
    path: str | Path,
    piece_of: Callable[[str], tuple[int, int, int] | None] | None = None,
    skip: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, cpu tensor)`` for every tensor of the checkpoint but those ``skip`` says, with a progress
    bar. ``piece_of(name)``: (dim, start, size) to read of that tensor, None for all of it (safetensors
    only: a ``.bin`` is read whole, and the layer cuts it)."""
    from safetensors import safe_open
    from tqdm.auto import tqdm

    files = weight_files(path)
    if files[0].suffix != ".safetensors":
        for file in tqdm(files, desc="Loading weights", unit="file"):
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from ((name, tensor) for name, tensor in tensors.items() if not (skip and skip(name)))
        return
    total = 0
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            total += len(handle.keys())
    with tqdm(total=total, desc="Loading weights", unit="tensor") as bar:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if skip is not None and skip(name):
                        bar.update()
                        continue
                    piece = piece_of(name) if piece_of is not None else None
                    yield name, handle.get_tensor(name) if piece is None else _read_piece(handle, name, piece)
                    bar.update()


def _read_piece(handle: Any, name: str, piece: tuple[int, int, int]) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) ``start:start+size`` of a safetensors tensor, reading only those."""
    dim, start, size = piece
    index = (slice(None),) * dim + (slice(start, start + size),)
    return handle.get_slice(name)[index]


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 0, scale: float = 0.02) -> None:
    """Fill every matrix with ``N(0, scale)``, on its own device; vectors (norms, biases) stay 1 / 0.
    A quantized projection gets its ``N(0, scale)`` matrix through its method, quantized."""
    from pagedserve.server.layers.linear import Linear

    generators: dict[torch.device, torch.Generator] = {}
    for module in model.modules():
        if isinstance(module, Linear) and not module.weight.is_floating_point():
            generator = torch.Generator(device=module.device).manual_seed(seed)
            # the layer's shape, not its weight's: a gguf layer's is a placeholder until a tensor arrives
            fp_weight = torch.empty(module.out_features, module.in_features, device=module.device)
            module.load("weight", fp_weight.normal_(0.0, scale, generator=generator))
    for param in model.parameters():
        if param.dim() >= 2 and param.is_floating_point():
            if param.device not in generators:
                generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, scale, generator=generators[param.device])
