"""Projections and the token embedding, with shard-aware weight loading.

A ``Linear`` may merge several checkpoint projections along its output dimension (q/k/v into one
``qkv_proj``, gate/up into one ``gate_up_proj``), so each decoder layer runs a few big matmuls.
Parameters are allocated uninitialised on the target device; the loader fills them. How a ``Linear``
holds and multiplies its weight is its ``method`` (server/layers/quantization/): the model dtype
(``UnquantizedLinearMethod``), or a quantized format the loader switches it to before loading.

Tensor parallelism (Megatron's split, server/distributed/): a layer built inside
``parallel_state.building(tp)`` holds only this rank's shard: ``checkpoint_piece`` says which piece of a
checkpoint tensor that is (the loader reads only that from safetensors), and ``load`` takes that piece or
cuts it out of the whole tensor. A column-parallel ``Linear`` holds a slice of every merged projection's
output rows (its outputs stay split: the next layer takes them split); a row-parallel one a slice of the
input columns, and sums the ranks' partial outputs (all-reduce) before its bias. ``VocabEmbedding`` holds a
slice of the vocabulary: a lookup masks the ids it lacks and sums over the ranks; as the LM head its
logits slices are gathered to rank 0.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from pagedserve.server.distributed import parallel_state
from pagedserve.server.distributed.collectives import all_reduce, gather_to_driver
from pagedserve.server.layers.quantization.base import LinearMethod
from torch import nn

# How a Linear splits across tensor-parallel ranks: None (whole on every rank), "column" (output rows), "row"
# (input columns, outputs summed over the ranks).
Parallel = Literal["column", "row"] | None


class OutputDelta(Protocol):
    """What a layer above may attach to a Linear to add to its product (server/lora/layers.py
    LinearLoRA): declared here so that this layer does not import the one that extends it."""

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


# oneDNN's fp32 matmul is faster than the MKL sgemm behind F.linear at decode batch sizes on an AVX2 AMD
# EPYC (1.27x for a forward's projections at 1-8 rows) and on par at prefill sizes (within +-10%, either
# way from run to run); see benchmarks/cpu_kernels.py and benchmarks/README.md.
_ONEDNN_LINEAR = (
    getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN for float32 CPU matrices."""
    if _ONEDNN_LINEAR is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def copy_weight(
    module: nn.Module, name: str, tensor: torch.Tensor, offset: int = 0, size: int | None = None
) -> None:
    """Copy a checkpoint tensor into ``module.<name>`` (its rows ``offset:offset+size`` if given)."""
    param = getattr(module, name, None)
    if not isinstance(param, torch.Tensor):
        raise ValueError(f"{type(module).__name__} has no {name!r} parameter")
    target = param.data if size is None else param.data.narrow(0, offset, size)
    if target.shape != tensor.shape:
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not match {tuple(target.shape)}")
    target.copy_(tensor)


class UnquantizedLinearMethod(LinearMethod):
    """The weight in the model dtype, multiplied by ``linear`` (oneDNN for float32 on the CPU)."""

    def create_weights(
        self, layer: nn.Module, in_features: int, out_features: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        layer.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )

    def load_weight(
        self, layer: nn.Module, tensor: torch.Tensor, offset: int = 0, size: int | None = None
    ) -> None:
        copy_weight(layer, "weight", tensor, offset, size)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, layer.weight)


class Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` ``[sum(output_sizes), in_features]``.

    ``output_sizes`` lists the checkpoint projections merged into this one, in order; ``load(name,
    tensor, shard)`` copies checkpoint projection ``shard`` into its rows; ``shard=None`` loads the whole
    merged matrix at once (checkpoints that ship it fused, as Phi-3's ``qkv_proj`` and ``gate_up_proj``).
    The weight's format and the matmul are ``self.method``'s; the bias stays in the model dtype.

    ``parallel`` (see the module docstring): "column" cuts each projection into ``part_pieces[i]``
    pieces (default one per rank; fewer, and neighbouring ranks hold the same piece: replicated KV heads);
    "row" cuts the input. ``output_sizes`` and ``in_features`` are the full checkpoint's; the layer's own
    ``output_sizes``, ``in_features`` and ``out_features`` are this rank's.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: int | list[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        parallel: Parallel = None,
        part_pieces: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.tp = parallel_state.current() if parallel is not None else parallel_state.SINGLE
        self.parallel = parallel if self.tp.size > 1 else None
        full_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.full_sizes, self.full_in_features = full_sizes, in_features
        # (start, size) of this rank's rows of each projection, or of its input columns
        self.row_pieces = [(0, size) for size in full_sizes]
        self.input_piece = (0, in_features)
        if self.parallel == "column":
            pieces = part_pieces or [self.tp.size] * len(full_sizes)
            self.row_pieces = [self.tp.piece(size, n) for size, n in zip(full_sizes, pieces, strict=True)]
        elif self.parallel == "row":
            self.input_piece = self.tp.piece(in_features)
        self.output_sizes = [size for _, size in self.row_pieces]
        out_features = sum(self.output_sizes)
        in_features = self.input_piece[1]
        self.in_features, self.out_features = in_features, out_features
        self.dtype, self.device = dtype, torch.device(device)
        self.set_method(UnquantizedLinearMethod())
        # server/lora/layers.py LinearLoRA, attached by server/lora/manager.py when LoRA is enabled
        self.lora: OutputDelta | None = None
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def set_method(self, method: LinearMethod) -> None:
        """Hold the weight in ``method``'s format (before loading: the weight is created anew, empty)."""
        self.method = method
        method.create_weights(self, self.in_features, self.out_features, self.dtype, self.device)

    def forward(self, x: torch.Tensor, keep_product_dtype: bool = False) -> torch.Tensor:
        """``x @ W.T + b`` in the model dtype; with ``keep_product_dtype``, in the dtype the method computed
        it in (the CPU's GGUF products in bfloat16: kernels/cpu.py ``gguf_matmul``), for a caller whose
        next step takes it as it is and ends in another projection of the same method (GatedMLP in
        server/models/decoder.py): a float32 copy there would be rounded back to bfloat16 anyway."""
        if self.parallel == "row":
            # The bias once, after the sum (in the model dtype): each rank's partial product has none.
            y = all_reduce(self._in_model_dtype(self.method.apply(self, x, None)), self.tp)
            return y if self.bias is None else y + self.bias
        y = self.method.apply(self, x, self.bias)
        if self.lora is not None or not keep_product_dtype:
            y = self._in_model_dtype(y)  # LoRA's deltas add to the model dtype's output, as peft's do
        return y if self.lora is None else self.lora.apply(x, y)

    def _in_model_dtype(self, y: torch.Tensor) -> torch.Tensor:
        # Checked here, not left to .to(): most products already are, and this runs per layer per step.
        return y if y.dtype == self.dtype else y.to(self.dtype)

    def checkpoint_piece(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """(dim, start, size) of checkpoint tensor ``name`` of projection ``shard`` that this rank holds,
        for the loader to read only that (None: all of it)."""
        if self.parallel == "column" and shard is not None:
            return (0, *self.row_pieces[shard])
        if self.parallel == "row" and name == "weight":
            return (1, *self.input_piece)
        return None

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """Load checkpoint tensor ``name`` ("weight" or "bias") of projection ``shard`` into place: the
        whole checkpoint tensor, or already this rank's piece of it (``checkpoint_piece``)."""
        if shard is None and self.parallel == "column":  # a fused checkpoint matrix: cut it per projection
            for index, part in enumerate(tensor.split(self.full_sizes, dim=0)):
                self.load(name, part, index)
            return
        piece = self.checkpoint_piece(name, shard)
        if piece is not None and tensor.shape[piece[0]] != piece[2]:  # whole: cut this rank's piece
            tensor = tensor.narrow(*piece)
        offset = 0 if shard is None else sum(self.output_sizes[:shard])
        size = None if shard is None else self.output_sizes[shard]
        if name == "weight":
            self.method.load_weight(self, tensor, offset, size)
        else:
            copy_weight(self, name, tensor, offset, size)


class VocabEmbedding(nn.Module):
    """Token embedding ``[vocab_size, hidden_size]``; the LM head shares it when embeddings are tied.

    Its weight is a ``hidden -> vocab`` projection's, so it takes a ``LinearMethod`` as ``Linear`` does
    (the loader quantizes it when it is the tied head: each row is an output channel of the head);
    ``as_head(hidden)`` is that projection and ``forward(ids)`` looks rows up through the method.

    Vocabulary-parallel under tensor parallelism: each rank holds ``ceil(vocab / ranks)`` rows (the last
    rank's beyond the vocabulary are zeros); ``as_head`` returns whole logit rows on rank 0 and None on
    the others.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tp = parallel_state.current()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.rows = -(-vocab_size // self.tp.size)  # this rank's rows, padded
        self.first_row = self.tp.rank * self.rows
        self.dtype, self.device = dtype, torch.device(device)
        self.set_method(UnquantizedLinearMethod())

    def set_method(self, method: LinearMethod) -> None:
        self.method = method
        method.create_weights(self, self.hidden_size, self.rows, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.method.embedding(self, input_ids)
        local = input_ids - self.first_row
        elsewhere = (local < 0) | (local >= self.rows)
        out = self.method.embedding(self, local.masked_fill(elsewhere, 0))
        return all_reduce(out.masked_fill(elsewhere.unsqueeze(-1), 0), self.tp)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden @ weight.T``: the LM head's logits, in the model dtype (None on ranks other than 0)."""
        logits = gather_to_driver(self.method.apply(self, hidden, None), self.tp)
        return logits if logits is None or self.tp.size == 1 else logits[:, : self.vocab_size]

    def checkpoint_piece(self, name: str, shard: int | None) -> tuple[int, int, int] | None:
        """(dim, start, size): this rank's rows of the checkpoint's vocabulary (None: all of them)."""
        if self.tp.size == 1:
            return None
        return 0, self.first_row, max(0, min(self.rows, self.vocab_size - self.first_row))

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """The whole checkpoint matrix, or already this rank's rows of it (``checkpoint_piece``)."""
        if name != "weight":
            raise ValueError(f"VocabEmbedding has no {name!r} parameter")
        if self.tp.size > 1:
            whole = len(tensor) == self.vocab_size
            mine = tensor[self.first_row : self.first_row + self.rows] if whole else tensor
            tensor = torch.zeros(self.rows, tensor.shape[1], dtype=tensor.dtype)
            tensor[: mine.shape[0]] = mine
        self.method.load_weight(self, tensor)
