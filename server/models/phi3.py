"""Phi-3 / Phi-3.5 / Phi-4-mini: Mistral's decoder (no biases; ``sliding_window``, when set, in every
layer, as in Transformers' Phi3Model) whose checkpoints ship ``qkv_proj`` and ``gate_up_proj`` already
fused, loaded as they are. Its RoPE is LongRoPE (``longrope``, formerly ``su``) with short and long
factors, and an optional ``partial_rotary_factor`` (server/layers/rotary.py)."""

from __future__ import annotations

from pagedserve.server.models.llama import MistralForCausalLM


class Phi3ForCausalLM(MistralForCausalLM):
    stacked_params = ()
