"""Mixture-of-experts MLP: a softmax router picks each token's top-k experts, ``backend.kernels.fused_moe``
runs them (kernels/fused_moe.py on CUDA, a grouped torch path on the cpu backend: kernels/cpu.py).

Experts' weights are stacked, ``w13_weight`` ``[E, 2I, H]`` (each expert's gate rows, then its up rows)
and ``w2_weight`` ``[E, H, I]``, so one kernel launch serves every expert. Checkpoints ship them one
expert at a time (``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``; Mixtral's ``w1`` / ``w3`` /
``w2`` are renamed to those by its model, server/models/mixtral.py): ``FusedExperts.load`` takes one
such tensor as a slab of the stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
from pagedserve.server.layers.linear import Linear, copy_weight
from torch import nn


@dataclass(frozen=True)
class MoESpec:
    """The mixture of experts of a family, read from its Hugging Face config."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights rescaled to sum to 1 (Mixtral always; Qwen as norm_topk_prob says)
    sparse_layers: frozenset[int]  # layers with experts; the others keep the dense MLP
    shared_expert_size: int = 0  # an always-on expert beside the routed ones (Qwen2-MoE); 0: none
    shared_expert_gate: bool = False  # the shared expert's output times sigmoid(a [1, H] projection)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, then the top-k: (weights float32 ``[T, k]``, ids ``[T, k]``)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedExperts(nn.Module):
    """Every expert's SwiGLU MLP, stacked: ``forward(x, topk_weights, topk_ids) -> [T, H]``."""

    # Checkpoint projection -> (our stacked parameter, its slab within one expert's rows of that parameter).
    PROJECTIONS = {
        "gate_proj": ("w13_weight", 0),
        "up_proj": ("w13_weight", 1),
        "down_proj": ("w2_weight", 0),
    }
    SLABS_PER_EXPERT = {"w13_weight": 2, "w2_weight": 1}

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.kernels = kernels
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype, device=device),
            requires_grad=False,
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype, device=device),
            requires_grad=False,
        )

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return self.kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)

    @classmethod
    def slab(cls, projection: str, expert: int) -> tuple[str, int]:
        """(parameter, slab index) of expert ``expert``'s checkpoint ``projection``; KeyError if unknown."""
        param_name, index = cls.PROJECTIONS[projection]
        return param_name, expert * cls.SLABS_PER_EXPERT[param_name] + index

    def load(self, name: str, tensor: torch.Tensor, shard: int | None = None) -> None:
        """``shard`` indexes the parameter viewed as a stack of checkpoint-shaped slabs (``slab``);
        ``None`` copies the whole stacked parameter."""
        if shard is None:
            copy_weight(self, name, tensor)
            return
        param = getattr(self, name, None)
        if not isinstance(param, torch.Tensor):
            raise ValueError(f"{type(self).__name__} has no {name!r} parameter")
        slabs = param.data.view(-1, param.shape[1] // self.SLABS_PER_EXPERT[name], param.shape[2])
        if tuple(slabs.shape[1:]) != tuple(tensor.shape) or not 0 <= shard < slabs.shape[0]:
            raise ValueError(
                f"checkpoint shape {tuple(tensor.shape)} is not slab {shard} of {tuple(param.shape)}"
            )
        slabs[shard].copy_(tensor)

    def checkpoint_names(self, prefix: str) -> dict[str, tuple[str, int]]:
        """``{prefix}.{e}.{projection}.weight`` -> (parameter, slab) for every expert's projections."""
        return {
            f"{prefix}.{expert}.{projection}.weight": self.slab(projection, expert)
            for expert in range(self.num_experts)
            for projection in self.PROJECTIONS
        }


class FusedMoE(nn.Module):
    """Router (``gate``), routed experts (``experts``) and, for Qwen2-MoE, a gated shared expert.

    Submodule names follow the checkpoints' (``mlp.gate``, ``mlp.experts``, ``mlp.shared_expert``,
    ``mlp.shared_expert_gate``), so their tensors load by name.
    """

    def __init__(
        self,
        spec: MoESpec,
        hidden_size: int,
        shared_expert: nn.Module | None,
        kernels: ModuleType,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.top_k, self.renormalize = spec.top_k, spec.renormalize
        self.gate = Linear(hidden_size, spec.num_experts, False, dtype, device)
        self.experts = FusedExperts(
            spec.num_experts, hidden_size, spec.intermediate_size, kernels, dtype, device
        )
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            Linear(hidden_size, 1, False, dtype, device) if spec.shared_expert_gate else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, topk_weights, topk_ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out
