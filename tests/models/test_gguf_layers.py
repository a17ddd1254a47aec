"""server/layers/quantization/gguf.py and server/loader/gguf.py without a model: raw GGUF rows split into
the kernels' layout, merged shards, the float fallback for types the kernels do not take, the q/k row
order and the name map."""

from __future__ import annotations

import pytest
import torch
from pagedserve.kernels import cpu, reference
from pagedserve.server.layers.linear import Linear
from pagedserve.server.layers.quantization.gguf import FLOAT, GGUFLinearMethod, split_blocks
from pagedserve.server.loader.gguf import hf_name, unpermute_rows
from pagedserve.server.models.decoder import GatedMLP
from pagedserve.server.models.spec import DecoderSpec

from pagedserve.testing.kernels import GGUF_TYPES, random_gguf_blocks


def raw_rows(qs: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """The file's bytes for these blocks: d [, m], then the values, per block."""
    n, nb = scales.shape
    parts = [scales.view(torch.uint8).view(n, nb, 2)]
    if mins is not None:
        parts.append(mins.view(torch.uint8).view(n, nb, 2))
    parts.append(qs.view(n, nb, -1))
    return torch.cat(parts, dim=-1).reshape(n, -1)


def gguf_linear(sizes: list[int], k: int) -> Linear:
    layer = Linear(k, sizes, bias=False, dtype=torch.float32, device=torch.device("cpu"))
    layer.set_method(GGUFLinearMethod(reference.gguf_matmul))
    return layer


@pytest.mark.parametrize("name", GGUF_TYPES.keys())
def test_split_blocks_recovers_the_layout(name: str) -> None:
    qs, scales, mins = random_gguf_blocks(6, 96, GGUF_TYPES[name], torch.Generator().manual_seed(1))
    qtype, got_qs, got_scales, got_mins = split_blocks(raw_rows(qs, scales, mins), 96)
    assert qtype == GGUF_TYPES[name] and torch.equal(got_qs, qs) and torch.equal(got_scales, scales)
    assert (got_mins is None) == (mins is None) and (mins is None or torch.equal(got_mins, mins))


def test_merged_shards_fill_their_rows_and_multiply() -> None:
    gen = torch.Generator().manual_seed(2)
    layer = gguf_linear([8, 4], 64)
    shards = [random_gguf_blocks(rows, 64, GGUF_TYPES["Q4_1"], gen) for rows in (8, 4)]
    for index, blocks in enumerate(shards):
        layer.load("weight", raw_rows(*blocks), index)
    whole = torch.cat([reference.dequantize_gguf(*blocks, GGUF_TYPES["Q4_1"]) for blocks in shards])
    x = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(layer(x), x @ whole.T, atol=2e-2 * (x @ whole.T).abs().max().item(), rtol=0)


def test_mixed_block_types_in_one_layer_are_refused() -> None:
    gen = torch.Generator().manual_seed(3)
    layer = gguf_linear([8, 4], 64)
    layer.load("weight", raw_rows(*random_gguf_blocks(8, 64, GGUF_TYPES["Q4_1"], gen)), 0)
    with pytest.raises(ValueError, match="Q4_1 and Q8_0"):
        layer.load("weight", raw_rows(*random_gguf_blocks(4, 64, GGUF_TYPES["Q8_0"], gen)), 1)


def test_a_float_tensor_stays_float() -> None:
    layer = gguf_linear([8], 64)
    weight = torch.randn(8, 64)
    layer.load("weight", weight)
    assert layer.gguf_type == FLOAT and layer.weight.dtype == torch.float32
    x = torch.randn(2, 64)
    torch.testing.assert_close(layer(x), x @ weight.T)


def test_unpermute_rows_is_transformers_reverse_permute() -> None:
    heads, head_dim = 3, 8
    rows = torch.arange(heads * head_dim * 5).reshape(heads * head_dim, 5)
    # llama.cpp's converter: per head, rows viewed (2, half) and transposed; unpermute_rows must undo it.
    permuted = rows.reshape(heads, 2, head_dim // 2, 5).transpose(1, 2).reshape(rows.shape)
    assert torch.equal(unpermute_rows(permuted, heads), rows)


def test_hf_names() -> None:
    assert hf_name("blk.7.attn_q.weight", tied=True) == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight", tied=True) == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight", tied=True) == "model.embed_tokens.weight"
    assert hf_name("token_embd.weight", tied=False) is None  # untied: only looked up, stays float
    assert hf_name("output.weight", tied=False) == "lm_head.weight"
    assert hf_name("blk.0.attn_norm.weight", tied=True) is None


def test_dummy_weights_reach_a_gguf_layer_as_floats(default_model_path: str) -> None:
    """``load_format="dummy"`` has no file to take blocks from: the gguf layers hold the N(0, 0.02)
    matrices as floats (the layer's shape, not its empty placeholder's)."""
    from pagedserve.server.backend import select_backend
    from pagedserve.server.loader import load_model

    backend = select_backend(torch.device("cpu"), torch.float32)
    model, _ = load_model(default_model_path, "float32", "cpu", backend=backend, load_format="dummy",
                          quantization="gguf")
    down = model.model.layers[0].mlp.down_proj
    assert down.gguf_type == FLOAT and tuple(down.weight.shape) == (576, 1536)
    assert 0.015 < float(down.weight.std()) < 0.025


BF16_ROWS = cpu.GGUF_DENSE_ROWS[torch.bfloat16]


@pytest.mark.skipif(
    cpu.load_extension() is None or cpu.dense_dtype() != torch.bfloat16,
    reason="float32 copies on this CPU: it has no avx512_bf16 or amx_bf16 (kernels/cpu.py dense_dtype)",
)
@pytest.mark.parametrize("rows", [BF16_ROWS - 1, BF16_ROWS, 40])
def test_the_mlp_keeps_its_batched_rows_in_bfloat16_between_products(rows: int) -> None:
    """From GGUF_DENSE_ROWS rows the gate/up product's bfloat16 rows go through SiLU-and-mul in bfloat16 and
    on to the down product as they are, as a bfloat16 model computes its MLP (no float32 copy whose
    activation differs in the last bits); below it every product is the int8 kernel's, in float32."""
    spec = DecoderSpec(hidden_size=64, intermediate_size=96, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=64, vocab_size=8, rms_norm_eps=1e-6)
    mlp = GatedMLP(spec, cpu, torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(rows)
    for layer, sizes in ((mlp.gate_up_proj, (96, 96)), (mlp.down_proj, (64,))):
        layer.set_method(GGUFLinearMethod(cpu.gguf_matmul, cpu.gguf_dense_weight))
        for shard, size in enumerate(sizes):
            blocks = random_gguf_blocks(size, layer.in_features, GGUF_TYPES["Q4_1"], gen)
            layer.load("weight", raw_rows(*blocks), shard if len(sizes) > 1 else None)
        layer.method.process_weights_after_loading(layer)
    x = torch.randn(rows, 64, generator=gen)
    out = mlp(x)
    assert out.dtype == torch.float32
    if rows < BF16_ROWS:
        hidden = cpu.silu_and_mul(mlp.gate_up_proj(x))
        assert hidden.dtype == torch.float32 and torch.equal(out, mlp.down_proj(hidden))
        return
    hidden = cpu.silu_and_mul(cpu.dense_matmul(x, mlp.gate_up_proj.weight_dense))
    assert hidden.dtype == torch.bfloat16
    assert torch.equal(out, cpu.dense_matmul(hidden, mlp.down_proj.weight_dense).float())
