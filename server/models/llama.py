"""The Llama family (Llama 1-3, Mistral, Qwen2, SmolLM) over one flattened, paged token batch.

The model runner calls, per engine step::

    hidden = model(input_ids, positions, meta)      # [T, hidden_size], one row per scheduled token
    logits = model.compute_logits(hidden[rows])     # float32 [N, vocab_size], only rows to sample

where ``input_ids``/``positions`` are ``LongTensor[T]`` (decodes first, then prefill chunks, as
``AttentionMetadata`` describes) and every ``Attention`` in ``model.attention_layers()`` has had its
``k_cache`` and ``v_cache`` bound by the runner. ``forward`` never synchronises with the
device (no ``.item()``/``.tolist()``), so it can be captured in a CUDA graph as far as the attention
kernels allow.

Weights: q/k/v are merged into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` at load time, so a
decoder layer is four matmuls. Attention and the elementwise work (RMSNorm, residual add, rotary,
SiLU-and-mul) go through ``backend.kernels``, the engine's choice (server/backend.py), bound into every
layer here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any, ClassVar

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.layers.activation import get_act_and_mul
from pagedserve.server.layers.attention import Attention, AttentionMetadata
from pagedserve.server.layers.linear import Linear, VocabEmbedding, linear
from pagedserve.server.layers.norm import RMSNorm
from pagedserve.server.layers.rotary import RotaryEmbedding, rope_parameters
from torch import nn

# (merged module, checkpoint module, shard index): checkpoint projections stacked into one matmul.
_STACKED = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qkv_bias: bool,
        o_bias: bool,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = Linear(
            hidden_size, [self.q_size, self.kv_size, self.kv_size], qkv_bias, dtype, device
        )
        self.o_proj = Linear(self.q_size, hidden_size, o_bias, dtype, device)
        self.attn = Attention(num_heads, num_kv_heads, head_dim, head_dim**-0.5, kernels)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = rotary(
            positions, q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        )
        out = self.attn(q.reshape(-1, self.q_size), k.reshape(-1, self.kv_size), v, meta)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        hidden_act: str,
        bias: bool,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, [intermediate_size, intermediate_size], bias, dtype, device)
        self.down_proj = Linear(intermediate_size, hidden_size, bias, dtype, device)
        self.act_fn = get_act_and_mul(hidden_act, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: _Spec, kernels: ModuleType, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
            spec.qkv_bias, spec.o_bias, kernels, dtype, device,
        )  # fmt: skip
        self.mlp = LlamaMLP(
            spec.hidden_size, spec.intermediate_size, spec.hidden_act, spec.mlp_bias, kernels, dtype, device
        )
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta, rotary)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class _Spec:
    """The architecture numbers read from a Hugging Face config (v4 and v5 attribute names)."""

    def __init__(self, cfg: Any, qkv_bias: bool | None, o_bias: bool | None) -> None:
        self.hidden_size: int = cfg.hidden_size
        self.intermediate_size: int = cfg.intermediate_size
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or self.hidden_size // self.num_heads
        self.vocab_size: int = cfg.vocab_size
        self.rms_norm_eps: float = cfg.rms_norm_eps
        self.max_position: int = cfg.max_position_embeddings
        self.hidden_act: str = getattr(cfg, "hidden_act", "silu")
        self.tie_word_embeddings: bool = bool(getattr(cfg, "tie_word_embeddings", False))
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        self.o_bias = attention_bias if o_bias is None else o_bias
        self.mlp_bias = bool(getattr(cfg, "mlp_bias", False))
        self.rope = rope_parameters(cfg)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )


class LlamaModel(nn.Module):
    def __init__(self, spec: _Spec, kernels: ModuleType, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, kernels, dtype, device) for _ in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, kernels, dtype, device)
        self.rotary_emb = RotaryEmbedding(spec.head_dim, spec.max_position, spec.rope, kernels, device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta, self.rotary_emb)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """A Llama-architecture causal LM for the paged engine.

    Args:
        hf_config: the checkpoint's Hugging Face config (``transformers.PretrainedConfig`` or any object
            with the same attributes).
        dtype: parameter and activation dtype. The rotary cache stays fp32; logits are returned fp32.
        device: where parameters live. Parameters are allocated uninitialised: fill them with
            ``load_weights`` (or ``pagedserve.server.loader.load_model``, which does).
        backend: the engine's kernel backend (``pagedserve.server.backend.select_backend``); its
            kernels run every attention and elementwise op of the model.

    Attributes useful to the model runner: ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``max_position`` (the rotary cache's length: positions must be
    below it), ``sliding_window`` (``None``, or the window the checkpoint was trained with; attention
    here is always full, so outputs are exact only while sequences fit in the window).
    """

    # Projection biases: None means "as the config's attention_bias says" (Llama); set per architecture.
    qkv_bias: ClassVar[bool | None] = None
    o_bias: ClassVar[bool | None] = None

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: Backend,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        spec = _Spec(hf_config, self.qkv_bias, self.o_bias)
        self.config = hf_config
        self.backend = backend
        self.dtype, self.device = dtype, device
        self.num_layers, self.num_heads = spec.num_layers, spec.num_heads
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.vocab_size, self.max_position = spec.vocab_size, spec.max_position
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.sliding_window: int | None = self._sliding_window(hf_config)
        self.model = LlamaModel(spec, backend.kernels, dtype, device)
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        )

    @staticmethod
    def _sliding_window(hf_config: Any) -> int | None:
        return getattr(hf_config, "sliding_window", None)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Run the flattened batch: ``input_ids``, ``positions`` ``LongTensor[T]`` -> hidden ``[T, hidden]``.

        Every layer stores the batch's K/V at ``meta.slot_mapping`` before attending, so after the
        call the cache holds these tokens too.
        """
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, hidden_size]`` (the rows to sample) -> float32 logits ``[N, vocab_size]``."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def attention_layers(self) -> list[Attention]:
        """The ``Attention`` module of every layer, in order, for the runner to bind KV caches to."""
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors into the merged parameters.

        Accepts names with or without the ``model.`` prefix; skips ``rotary_emb.inv_freq`` buffers and,
        with tied embeddings, ``lm_head.weight``. Raises ``ValueError`` on an unknown name, a shape
        mismatch, or parameters the checkpoint did not provide.
        """
        loaded: set[tuple[str, str, int]] = set()
        for name, tensor in weights:
            if "rotary_emb." in name:
                continue
            if name.startswith("lm_head."):
                if self.lm_head is None:
                    continue  # tied: the embedding is the head
            elif not name.startswith("model."):
                name = "model." + name
            module_path, _, param_name = name.rpartition(".")
            shard = 0
            for merged, original, index in _STACKED:
                if module_path.endswith("." + original):
                    module_path = module_path[: -len(original)] + merged
                    shard = index
                    break
            try:
                self.get_submodule(module_path).load(param_name, tensor, shard)
            except AttributeError:  # no such module, or a module without weights
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model") from None
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {name!r}: {error}") from None
            loaded.add((module_path, param_name, shard))
        missing = [name for name, key in self._expected_weights().items() if key not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} weights: {shown}")

    def _expected_weights(self) -> dict[str, tuple[str, str, int]]:
        """Checkpoint name -> (module path, parameter, shard) for every parameter to load."""
        expected = {}
        for full_name, _ in self.named_parameters():
            module_path, _, param_name = full_name.rpartition(".")
            module = self.get_submodule(module_path)
            shards = len(getattr(module, "output_sizes", [0]))
            for shard in range(shards):
                checkpoint_path = module_path
                for merged, original, index in _STACKED:
                    if module_path.endswith("." + merged) and index == shard:
                        checkpoint_path = module_path[: -len(merged)] + original
                expected[f"{checkpoint_path}.{param_name}"] = (module_path, param_name, shard)
        return expected


class MistralForCausalLM(LlamaForCausalLM):
    qkv_bias = False
    o_bias = False


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
    o_bias = False

    @staticmethod
    def _sliding_window(hf_config: Any) -> int | None:
        if not getattr(hf_config, "use_sliding_window", False):
            return None
        return getattr(hf_config, "sliding_window", None)
