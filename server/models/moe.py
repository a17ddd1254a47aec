"""What every mixture-of-experts family adds to its dense family: ``MoEMixin``.

A MoE family is its dense family with some MLPs swapped for a ``FusedMoE`` (server/layers/fused_moe.py):
``class MixtralForCausalLM(MoEMixin, MistralForCausalLM)`` and a ``moe_spec`` classmethod. The mixin
overrides the skeleton's extension points (server/models/causal_lm.py): ``make_mlp`` builds the MoE on
the layers ``moe_spec`` names sparse; ``route_weight`` and ``expected_weights`` send each expert's
checkpoint projection to its slab of the stacked expert weights; ``load_weights`` also accepts the stacked
``experts.gate_up_proj`` / ``experts.down_proj`` tensors of a Transformers 5 model in memory (its
``save_pretrained`` writes per-expert names).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from pagedserve.server.layers.fused_moe import FusedExperts, FusedMoE, MoESpec
from pagedserve.server.models.causal_lm import WeightKey
from pagedserve.server.models.decoder import GatedMLP
from torch import nn

# A Transformers 5 in-memory state dict: every expert of a layer in one tensor.
_STACKED_EXPERTS = re.compile(r"(?P<prefix>.*\.experts)\.(?P<param>gate_up_proj|down_proj)")
# One expert's projection, once the skeleton has merged gate/up: ``...experts.{e}.gate_up_proj`` etc.
_ONE_EXPERT = re.compile(r"(?P<experts>.*\.experts)\.(?P<expert>\d+)\.(?P<module>\w+)")


def split_stacked_experts(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked ``experts.gate_up_proj`` ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]`` as per-expert
    ``experts.{e}.gate_proj.weight`` etc. (views); every other tensor as it comes."""
    for name, tensor in weights:
        match = _STACKED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix = match["prefix"]
        for expert, stacked in enumerate(tensor):
            if match["param"] == "down_proj":
                yield f"{prefix}.{expert}.down_proj.weight", stacked
            else:
                gate, up = stacked.chunk(2, dim=0)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up


class MoEMixin:
    """Put before a ``DecoderForCausalLM`` family in the bases; define ``moe_spec``."""

    supports_tensor_parallel = False  # the experts are not split across ranks yet

    @classmethod
    def moe_spec(cls, hf_config: Any, num_layers: int) -> MoESpec:
        raise NotImplementedError

    def make_mlp(self: Any, layer_index: int) -> nn.Module:
        moe = self.moe_spec(self.config, self.spec.num_layers)
        if layer_index not in moe.sparse_layers:
            return super().make_mlp(layer_index)
        kernels = self.backend.kernels
        shared = None
        if moe.shared_expert_size:
            shared_spec = dataclasses.replace(self.spec, intermediate_size=moe.shared_expert_size)
            shared = GatedMLP(shared_spec, kernels, self.dtype, self.device)
        return FusedMoE(moe, self.spec.hidden_size, shared, kernels, self.dtype, self.device)

    def load_weights(self: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(split_stacked_experts(weights))

    def route_weight(self: Any, name: str) -> WeightKey | None:
        key = super().route_weight(name)
        match = None if key is None else _ONE_EXPERT.fullmatch(key[0])
        if match is None:
            return key
        # Back from the skeleton's merged gate_up_proj (shard 0 or 1) to the checkpoint projection.
        module, shard = match["module"], key[2]
        unmerged = {(merged, index): original for merged, original, index in self.stacked_params}
        projection = unmerged.get((module, shard), module)
        try:
            param_name, slab = FusedExperts.slab(projection, int(match["expert"]))
        except KeyError:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of this model") from None
        return match["experts"], param_name, slab

    def expected_weights(self: Any) -> dict[str, WeightKey]:
        expected = {
            name: key
            for name, key in super().expected_weights().items()
            if not isinstance(self.get_submodule(key[0]), FusedExperts)
        }
        for path, module in self.named_modules():
            if isinstance(module, FusedExperts):
                for name, (param_name, slab) in module.checkpoint_names(path).items():
                    expected[name] = (path, param_name, slab)
        return expected
