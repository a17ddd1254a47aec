"""``DecoderForCausalLM``: the causal LM every family is, over one flattened, paged token batch.

The model runner calls, per engine step::

    hidden = model(input_ids, positions, meta)      # [T, hidden_size], one row per scheduled token
    logits = model.compute_logits(hidden[rows])     # float32 [N, vocab_size], only rows to sample

where ``input_ids``/``positions`` are ``LongTensor[T]`` (decodes first, then prefill chunks, as
``AttentionMetadata`` describes) and every ``Attention`` in ``model.attention_layers()`` has had its
``k_cache`` and ``v_cache`` bound by the runner. ``forward`` never synchronises with the device (no
``.item()``/``.tolist()``), so it can be captured in a CUDA graph as far as the attention kernels allow.

A family (server/models/<family>.py, registered in server/models/registry.py) is a subclass that says
how its config maps onto a ``DecoderSpec`` (``spec_from_config``) and, where it must, how its checkpoint
names map onto ours. Extension points, kept stable for the families built on them:

- ``spec_from_config(hf_config) -> DecoderSpec``: the family's numbers and choices.
- ``rotary_params(hf_config, spec) -> {layer type: RoPE parameters}``: one rotary table per attention type.
- ``make_mlp(layer_index) -> nn.Module``: the layer's MLP; a mixture-of-experts family returns its MoE.
- ``stacked_params``: checkpoint projections merged into one matmul (q/k/v into ``qkv_proj``, gate/up into
  ``gate_up_proj``); ``()`` where the checkpoint already ships them merged (Phi-3).
- ``checkpoint_renames``: checkpoint name fragments and ours (e.g. a ``block_sparse_moe`` to ``mlp``).
- ``route_weight(name)`` / ``expected_weights()``: where a checkpoint tensor goes, and what must arrive,
  for modules whose ``load(param_name, tensor, shard)`` takes shards other than a Linear's.

Weights: a module with parameters has ``load(param_name, tensor, shard)``; ``shard`` is the index of a
stacked checkpoint projection, or ``None`` for the whole parameter. The elementwise work (RMSNorm,
residual add, rotary, SiLU-and-mul) and attention go through ``backend.kernels``, the engine's choice
(server/backend.py), bound into every layer here, once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from pagedserve.server.backend import Backend
from pagedserve.server.distributed import parallel_state
from pagedserve.server.layers.attention import Attention, AttentionMetadata
from pagedserve.server.layers.linear import Linear, VocabEmbedding
from pagedserve.server.layers.rotary import rope_parameters
from pagedserve.server.models.decoder import DecoderModel, GatedMLP
from pagedserve.server.models.spec import DecoderSpec, llama_spec_fields
from torch import nn

# (merged module, checkpoint module, shard index): checkpoint projections stacked into one matmul.
STACKED_QKV_GATE_UP: tuple[tuple[str, str, int], ...] = (
    ("qkv_proj", "q_proj", 0),
    ("qkv_proj", "k_proj", 1),
    ("qkv_proj", "v_proj", 2),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)

WeightKey = tuple[str, str, int | None]  # (module path, parameter name, shard)


class DecoderForCausalLM(nn.Module):
    """A decoder-only causal LM for the paged engine.

    Args:
        hf_config: the checkpoint's Hugging Face config (a ``transformers.PretrainedConfig``).
        dtype: parameter and activation dtype. The rotary cache stays fp32; logits are returned fp32.
        device: where parameters live. Parameters are allocated uninitialised: fill them with
            ``load_weights`` (or ``pagedserve.server.loader.load_model``, which does).
        backend: the engine's kernel backend (``pagedserve.server.backend.select_backend``); its
            kernels run every attention and elementwise op of the model.

    Attributes useful to the model runner: ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``vocab_size``, ``max_position`` (the rotary cache's length: positions must be
    below it) and ``spec`` (everything else, per layer: each layer's window is on its ``Attention``, and
    ``sliding_windows`` lists every stage's for server/core/kv_cache_manager.py ``uniform_sliding_window``).
    """

    stacked_params: ClassVar[tuple[tuple[str, str, int], ...]] = STACKED_QKV_GATE_UP
    checkpoint_renames: ClassVar[tuple[tuple[str, str], ...]] = ()
    # The decoder layers' projections a LoRA adapter may change (server/lora/manager.py)
    lora_modules: ClassVar[tuple[str, ...]] = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    # Whether the model splits across tensor-parallel ranks (server/distributed/): heads, MLP, vocabulary.
    supports_tensor_parallel: ClassVar[bool] = True
    # Multimodal RoPE (Qwen2-VL): the runner hands the model [3, T] positions (server/models/qwen2_vl.py)
    uses_mrope: ClassVar[bool] = False
    # A vision-language model's encoder (its module ``encoder``, Transformers' own): the checkpoint-name
    # prefixes of its tensors, which ``load_weights`` hands to ``load_encoder`` whole (server/models/llava.py)
    encoder_prefixes: ClassVar[tuple[str, ...]] = ()

    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        device: torch.device | str,
        backend: Backend,
    ) -> None:
        super().__init__()
        device = torch.device(device)
        spec = self.spec_from_config(hf_config)
        self.config, self.spec = hf_config, spec
        self.backend = backend
        self.dtype, self.device = dtype, device
        self.num_layers, self.num_heads = spec.num_layers, spec.num_heads
        self.num_kv_heads, self.head_dim = spec.num_kv_heads, spec.head_dim
        self.vocab_size = spec.vocab_size
        self.tie_word_embeddings = spec.tie_word_embeddings
        self.model = DecoderModel(
            spec,
            hf_config,
            self.rotary_params(hf_config, spec),
            self.make_mlp,
            backend.kernels,
            dtype,
            device,
        )
        self.max_position = self.model.max_position
        # Untied: a projection, vocabulary-parallel under tensor parallelism as the tied embedding is.
        self.lm_head: Linear | VocabEmbedding | None = None
        # Under pipeline parallelism the head sits beside the embedding, on the first stage, whose driver
        # samples (server/distributed/parallel_state.py PipelineStage).
        if not spec.tie_word_embeddings and self.model.stage.is_first:
            self.lm_head = (
                Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
                if parallel_state.current().size == 1
                else VocabEmbedding(spec.vocab_size, spec.hidden_size, dtype, device)
            )

    # ---- what a family overrides -----------------------------------------------------------------

    @classmethod
    def spec_from_config(cls, hf_config: Any) -> DecoderSpec:
        return DecoderSpec(**llama_spec_fields(hf_config))

    @classmethod
    def rotary_params(cls, hf_config: Any, spec: DecoderSpec) -> dict[str, dict[str, Any]]:
        return {
            layer_type: rope_parameters(hf_config, layer_type) for layer_type in sorted(set(spec.layer_types))
        }

    def make_mlp(self, layer_index: int) -> nn.Module:
        return GatedMLP(self.spec, self.backend.kernels, self.dtype, self.device)

    # ---- running ---------------------------------------------------------------------------------

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the flattened batch: ``input_ids``, ``positions`` ``LongTensor[T]`` -> hidden ``[T, hidden]``.

        Every layer stores the batch's K/V at ``meta.slot_mapping`` before attending, so after the
        call the cache holds these tokens too. ``inputs_embeds`` ``[T, hidden]``: the rows' embeddings,
        given when some are not tokens' (``embed_input_ids`` and a vision encoder's features).
        """
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """``hidden`` ``[N, hidden_size]`` (the rows to sample) -> float32 logits ``[N, vocab_size]``.
        Under tensor parallelism every rank must call it; only rank 0 gets the logits, the others None."""
        head = self.lm_head if self.lm_head is not None else self.model.embed_tokens
        logits = head.as_head(hidden) if isinstance(head, VocabEmbedding) else head(hidden)
        if logits is None:
            return None
        logits = logits.float()
        if self.spec.logits_scaling != 1.0:
            logits = logits / self.spec.logits_scaling
        cap = self.spec.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        """The ``Attention`` module of every layer this rank holds (its pipeline stage's, else all), in
        order, for the runner to bind KV caches to."""
        return [layer.self_attn.attn for layer in self.model.held_layers]

    def sliding_windows(self) -> list[int | None]:
        """Every layer's attention window (None: full), this stage's or not: the KV cache manager frees
        blocks by the window all of them share (server/core/kv_cache_manager.py)."""
        return [self.spec.layer_sliding_window(i) for i in range(self.num_layers)]

    # ---- weights ---------------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face checkpoint tensors into the (merged) parameters.

        Accepts names with or without the ``model.`` prefix; skips ``rotary_emb.`` buffers and, with
        tied embeddings, ``lm_head.weight``. Raises ``ValueError`` on an unknown name, a shape
        mismatch, or parameters the checkpoint did not provide.
        """
        loaded: set[WeightKey] = set()
        encoder: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if self.encoder_prefixes and name.startswith(self.encoder_prefixes):
                encoder[name] = tensor
                continue
            key = self.route_weight(name)
            if key is None:
                continue
            module_path, param_name, shard = key
            try:
                self.get_submodule(module_path).load(param_name, tensor, shard)
            except AttributeError:  # no such module, or a module without weights
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model") from None
            except ValueError as error:
                raise ValueError(f"checkpoint tensor {name!r}: {error}") from None
            loaded.add(key)
        missing = [name for name, key in self.expected_weights().items() if key not in loaded]
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ValueError(f"the checkpoint lacks {len(missing)} weights: {shown}")
        if self.encoder_prefixes:
            self.load_encoder(encoder)

    def load_encoder(self, tensors: dict[str, torch.Tensor]) -> None:
        """The encoder's checkpoint tensors, by checkpoint name; a ValueError naming any that does not fit
        and any the encoder lacks. Only for a class that declares ``encoder_prefixes``."""
        raise NotImplementedError(f"{type(self).__name__} has no encoder")

    def checkpoint_piece(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, size) of checkpoint tensor ``name`` that this tensor-parallel rank holds, so the
        loader reads only that; None: the whole tensor (one rank, or a parameter every rank holds)."""
        key = self.route_weight(name)
        if key is None:
            return None
        module_path, param_name, shard = key
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None  # load_weights names the unknown tensor
        piece = getattr(module, "checkpoint_piece", None)
        return piece(param_name, shard) if piece is not None else None

    def route_weight(self, name: str) -> WeightKey | None:
        """Checkpoint tensor name -> (module path, parameter, shard), or None for a tensor to skip."""
        if "rotary_emb." in name:
            return None
        if name.startswith("lm_head."):
            if self.lm_head is None:
                return None  # tied (the embedding is the head), pooling, or another pipeline stage's
        elif not name.startswith("model."):
            name = "model." + name
        if not self.holds_weight(name):
            return None
        for theirs, ours in self.checkpoint_renames:
            name = name.replace(theirs, ours)
        module_path, _, param_name = name.rpartition(".")
        for merged, original, index in self.stacked_params:
            if module_path.endswith("." + original):
                return module_path[: -len(original)] + merged, param_name, index
        return module_path, param_name, None

    def holds_weight(self, name: str) -> bool:
        """Whether this pipeline stage holds checkpoint tensor ``name`` (``model.``-prefixed): its own
        layers', the embedding on the first stage, the final norm on the last (every one on one stage)."""
        stage = self.model.stage
        if stage.size == 1:
            return True
        if name.startswith("model.layers."):
            return self.model.holds_layer(int(name.split(".", 3)[2]))
        if name.startswith("model.embed_tokens."):
            return stage.is_first
        if name.startswith("model.norm."):
            return stage.is_last
        return True

    def expected_weights(self) -> dict[str, WeightKey]:
        """Checkpoint name -> (module path, parameter, shard) for every parameter to load."""
        expected: dict[str, WeightKey] = {}
        for full_name, _ in self.named_parameters():
            if full_name.startswith("encoder."):  # checked by load_encoder
                continue
            module_path, _, param_name = full_name.rpartition(".")
            stacked = [
                (original, index)
                for merged, original, index in self.stacked_params
                if module_path.endswith("." + merged)
            ]
            if not stacked:
                expected[full_name] = (module_path, param_name, None)
            for original, index in stacked:
                checkpoint_path = module_path[: -len(module_path.rpartition(".")[2])] + original
                expected[f"{checkpoint_path}.{param_name}"] = (module_path, param_name, index)
        return expected
