"""The one decoder skeleton every family is built from: attention, gated MLP, decoder layer, model body.

What differs between families is data in a ``DecoderSpec`` (server/models/spec.py): where the norms sit,
how q/k are normalised, the attention scale and soft-cap, embedding and residual multipliers. The MLP is
whatever ``make_mlp`` returns (``DecoderForCausalLM.make_mlp`` in server/models/causal_lm.py), so a
mixture-of-experts family swaps it without touching this file.

The residual stream is carried between layers as ``(hidden, residual)``: ``hidden`` is the last branch's
output not yet added, so a pre-norm layer adds and normalises in one ``fused_add_rms_norm`` kernel call.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from pagedserve.server.distributed import parallel_state
from pagedserve.server.distributed.collectives import receive_from_stage, send_to_stage
from pagedserve.server.layers.activation import get_act_and_mul
from pagedserve.server.layers.attention import Attention, AttentionMetadata
from pagedserve.server.layers.linear import Linear, VocabEmbedding
from pagedserve.server.layers.norm import RMSNorm
from pagedserve.server.layers.rotary import RotaryEmbedding, rope_max_position
from pagedserve.server.models.spec import DecoderSpec
from torch import nn

# (layer index) -> the layer's MLP (or mixture of experts): ``forward(x [T, hidden]) -> [T, hidden]``.
MLPFactory = Callable[[int], nn.Module]

# Checkpoint names of each norm slot, by placement (see spec.NormPlacement).
NORM_NAMES: dict[str, dict[str, str]] = {
    "pre": {"pre_attn": "input_layernorm", "pre_mlp": "post_attention_layernorm"},
    "sandwich": {
        "pre_attn": "input_layernorm",
        "post_attn": "post_attention_layernorm",
        "pre_mlp": "pre_feedforward_layernorm",
        "post_mlp": "post_feedforward_layernorm",
    },
    "post": {"post_attn": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"},
}


def make_norm(
    spec: DecoderSpec, size: int, kernels: ModuleType, dtype: torch.dtype, device: torch.device
) -> RMSNorm:
    return RMSNorm(size, spec.rms_norm_eps, kernels, dtype, device, weight_offset=spec.norm_weight_offset)


class DecoderAttention(nn.Module):
    """qkv projection, optional q/k norm, rotary, paged attention, output projection."""

    def __init__(
        self,
        spec: DecoderSpec,
        layer_index: int,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        # This rank's heads (all of them on one rank): query heads split, KV heads split too or, when
        # there are fewer than ranks, each held by the ranks whose query heads read it.
        tp = parallel_state.current()
        kv_pieces = min(tp.size, spec.num_kv_heads)
        self.num_heads = spec.num_heads // tp.size
        self.num_kv_heads, self.head_dim = spec.num_kv_heads // kv_pieces, spec.head_dim
        self.q_size, self.kv_size = self.num_heads * spec.head_dim, self.num_kv_heads * spec.head_dim
        full_q, full_kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(
            spec.hidden_size, [full_q, full_kv, full_kv], spec.qkv_bias, dtype, device,
            parallel="column", part_pieces=[tp.size, kv_pieces, kv_pieces],
        )
        self.o_proj = Linear(full_q, spec.hidden_size, spec.o_bias, dtype, device, parallel="row")
        self.qk_norm = spec.qk_norm
        if spec.qk_norm is not None:
            q_norm_size, k_norm_size = (
                (spec.head_dim, spec.head_dim) if spec.qk_norm == "head" else (self.q_size, self.kv_size)
            )
            self.q_norm = make_norm(spec, q_norm_size, kernels, dtype, device)
            self.k_norm = make_norm(spec, k_norm_size, kernels, dtype, device)
        scale = spec.attn_scale if spec.attn_scale is not None else spec.head_dim**-0.5
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            spec.head_dim,
            scale,
            kernels,
            sliding_window=spec.layer_sliding_window(layer_index),
            logit_softcap=spec.attn_softcap,
            device=device,
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm == "full":
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q = self.q_norm(q.reshape(-1, self.head_dim)).view_as(q)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view_as(k)
        q, k = rotary(positions, q, k)
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, meta)
        return self.o_proj(out)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``, gate and up merged into one ``gate_up_proj``."""

    def __init__(
        self, spec: DecoderSpec, kernels: ModuleType, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = Linear(
            spec.hidden_size, [size, size], spec.mlp_bias, dtype, device, parallel="column"
        )
        self.down_proj = Linear(size, spec.hidden_size, spec.mlp_bias, dtype, device, parallel="row")
        self.act_fn = get_act_and_mul(spec.hidden_act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The activation runs in the gate/up product's own dtype: bfloat16 rows from the CPU's GGUF products
        # stay bfloat16 into the down projection's (server/layers/linear.py Linear.forward).
        return self.down_proj(self.act_fn(self.gate_up_proj(x, keep_product_dtype=True)))


def _add_and_norm(
    norm: RMSNorm | None, hidden: torch.Tensor, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add ``hidden`` into the residual stream; return (the branch input, the new residual)."""
    if norm is None:
        summed = hidden if residual is None else hidden + residual
        return summed, summed
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: DecoderSpec,
        layer_index: int,
        mlp: nn.Module,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.layer_type = spec.layer_types[layer_index]
        self.self_attn = DecoderAttention(spec, layer_index, kernels, dtype, device)
        self.mlp = mlp
        self.residual_multiplier = spec.residual_multiplier
        # Norm slots by role; registered under their checkpoint names so weights load by name.
        self.norm_names = NORM_NAMES[spec.norm_placement]
        for name in self.norm_names.values():
            setattr(self, name, make_norm(spec, spec.hidden_size, kernels, dtype, device))

    def _norm(self, role: str) -> RMSNorm | None:
        name = self.norm_names.get(role)
        return None if name is None else getattr(self, name)

    def _scaled(self, out: torch.Tensor, role: str) -> torch.Tensor:
        norm = self._norm(role)
        if norm is not None:
            out = norm(out)
        return out if self.residual_multiplier == 1.0 else out * self.residual_multiplier

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, residual)`` in and out; ``residual`` is None on the first layer."""
        x, residual = _add_and_norm(self._norm("pre_attn"), hidden, residual)
        out = self._scaled(self.self_attn(positions, x, meta, rotary), "post_attn")
        x, residual = _add_and_norm(self._norm("pre_mlp"), out, residual)
        return self._scaled(self.mlp(x), "post_mlp"), residual


class DecoderModel(nn.Module):
    """Embedding, layers, final norm; one rotary table per attention type (Gemma 3's local layers rotate
    with their own base). ``rotary_params``: the RoPE settings of each layer type (keys of
    ``spec.layer_types``), as ``rope_parameters`` reads them from ``hf_config``."""

    def __init__(
        self,
        spec: DecoderSpec,
        hf_config: Any,
        rotary_params: dict[str, dict[str, Any]],
        make_mlp: MLPFactory,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        # Under pipeline parallelism this stage's layers only; the first stage embeds, the last normalises
        # (server/distributed/parallel_state.py PipelineStage). The others are empty slots, so checkpoint
        # names keep their layer indices.
        self.stage = stage = parallel_state.current_stage()
        self.start_layer, self.end_layer = stage.layer_range(spec.num_layers)
        self.hidden_size, self.dtype, self.device = spec.hidden_size, dtype, device
        self.embed_tokens: VocabEmbedding | None = None
        if stage.is_first:
            self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.embed_scale = spec.embed_scale
        if spec.embed_scale_in_model_dtype:
            self.embed_scale = torch.tensor(spec.embed_scale, dtype=dtype).item()
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, make_mlp(i), kernels, dtype, device)
            if self.holds_layer(i) else nn.Identity()
            for i in range(spec.num_layers)
        )
        # A plain tuple for the forward loop: slicing the ModuleList would build a module every step.
        self.held_layers = tuple(self.layers[self.start_layer : self.end_layer])
        self.norm = make_norm(spec, spec.hidden_size, kernels, dtype, device) if stage.is_last else None
        # One table per distinct parameter set: Qwen2's sliding and full layers rotate alike, and share it.
        tables: dict[str, RotaryEmbedding] = {}
        for layer_type, params in rotary_params.items():
            if repr(params) not in tables:
                max_position = rope_max_position(hf_config, layer_type)
                tables[repr(params)] = RotaryEmbedding(
                    hf_config, spec.head_dim, max_position, kernels, device, layer_type
                )
        self.rotary_emb = nn.ModuleDict(
            {layer_type: tables[repr(params)] for layer_type, params in rotary_params.items()}
        )
        # Positions must stay below this: the shortest rotary table.
        self.max_position = min(table.cos_sin_cache.shape[0] for table in tables.values())

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        assert self.embed_tokens is not None, "only the first pipeline stage embeds"
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale if self.embed_scale != 1.0 else hidden

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs_embeds``: the step's embeddings when some rows are not tokens' (a multimodal model's
        image features, merged by the runner); else ``input_ids`` are embedded here."""
        stage = self.stage
        residual: torch.Tensor | None = None
        if stage.is_first:
            hidden = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        else:
            rows = torch.empty(input_ids.shape[0], self.hidden_size, dtype=self.dtype, device=self.device)
            hidden, residual = receive_from_stage([rows, torch.empty_like(rows)], stage, stage.index - 1)
        for layer in self.held_layers:
            hidden, residual = layer(positions, hidden, residual, meta, self.rotary_emb[layer.layer_type])
        if not stage.is_last:
            assert residual is not None  # every stage holds at least one layer
            send_to_stage([hidden, residual], stage, stage.index + 1)
        else:
            assert self.norm is not None
            hidden, _ = self.norm(hidden, residual)
        if stage.size > 1:
            hidden = self._final_to_first_stage(hidden)
        return hidden

    def holds_layer(self, index: int) -> bool:
        return self.start_layer <= index < self.end_layer

    def _final_to_first_stage(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's normalised rows, on the first stage too (its driver samples from them); a middle
        stage's return is not read."""
        stage = self.stage
        if stage.is_last:
            send_to_stage([hidden], stage, 0)
        elif stage.is_first:
            (hidden,) = receive_from_stage([torch.empty_like(hidden)], stage, stage.size - 1)
        return hidden
