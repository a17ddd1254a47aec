"""Our Llama-family models against Hugging Face Transformers, through a paged KV cache.

Each case runs a few sequences the way the engine does: a first step of whole prompts and a partial
chunk, a mixed step (decodes first, then the rest of the chunked prompt and a late prompt), then
decode steps; every logit row is compared with HF's full-sequence forward at the same position.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pagedserve.server.backend import Backend, select_backend
from pagedserve.server.layers.attention import AttentionMetadata
from pagedserve.server.loader import load_model
from pagedserve.server.models.registry import build_model
from parity import random_hf_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

BLOCK_SIZE = 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def backend_on_cpu(name: str = "cpu") -> Backend:
    """The backend the engine picks on a CPU (or ``name``), for float32."""
    return select_backend(torch.device("cpu"), torch.float32, name)


class PagedSim:
    """A hand-built model runner: paged caches on shuffled blocks, decodes ordered first."""

    def __init__(self, model, num_seqs: int, max_len: int, seed: int = 0) -> None:
        self.model = model
        blocks_per_seq = math.ceil(max_len / BLOCK_SIZE)
        num_blocks = num_seqs * blocks_per_seq + 3
        generator = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=generator)[: num_seqs * blocks_per_seq]
        self.tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
        shape = (num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        for layer in model.attention_layers():
            layer.k_cache = torch.zeros(shape, dtype=model.dtype)
            layer.v_cache = torch.zeros(shape, dtype=model.dtype)
        self.computed = [0] * num_seqs

    @torch.inference_mode()
    def step(self, work: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """Run ``{seq: new token ids}`` as one batch; returns ``{seq: logits [n_new, vocab]}``."""
        decodes = [seq for seq, tokens in work.items() if len(tokens) == 1]
        prefills = [seq for seq, tokens in work.items() if len(tokens) > 1]
        ids, positions, slots, context_lens, q_lens = [], [], [], [], []
        for seq in decodes + prefills:
            start, tokens = self.computed[seq], work[seq]
            pos = torch.arange(start, start + len(tokens))
            ids += tokens
            positions.append(pos)
            slots.append(self.tables[seq][pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
            context_lens.append(start + len(tokens))
            q_lens.append(len(tokens))
            self.computed[seq] += len(tokens)
        n_dec = len(decodes)
        lens = torch.tensor(context_lens, dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            num_decode_tokens=n_dec,
            decode_block_tables=self.tables[decodes],
            decode_context_lens=lens[:n_dec],
            prefill_block_tables=self.tables[prefills],
            prefill_cu_seqlens_q=torch.tensor([0, *q_lens[n_dec:]]).cumsum(0).to(torch.int32),
            prefill_context_lens=lens[n_dec:],
        )
        hidden = self.model(torch.tensor(ids), torch.cat(positions), meta)
        assert hidden.shape == (len(ids), self.model.config.hidden_size)
        logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return dict(zip(decodes + prefills, logits.split(q_lens), strict=True))


def run_schedule(model, prompts: list[list[int]], decode_steps: int = 3):
    """Prompts 0-1 whole and prompt 2 in two chunks, prompt 3 joining late; then greedy decodes.

    Returns every sequence's tokens and the logits we produced for each of its positions.
    """
    assert len(prompts) == 4
    sim = PagedSim(model, len(prompts), max(map(len, prompts)) + decode_steps + 2)
    tokens = [list(p) for p in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]

    def record(out: dict[int, torch.Tensor]) -> None:
        for seq, rows in out.items():
            logits[seq].append(rows)

    split = len(prompts[2]) // 2 + 1
    record(sim.step({0: tokens[0], 1: tokens[1], 2: tokens[2][:split]}))
    for seq in (0, 1):
        tokens[seq].append(int(logits[seq][-1][-1].argmax()))
    record(sim.step({0: tokens[0][-1:], 1: tokens[1][-1:], 2: tokens[2][split:], 3: tokens[3]}))
    for _ in range(decode_steps):
        for seq in range(len(prompts)):
            tokens[seq].append(int(logits[seq][-1][-1].argmax()))
        record(sim.step({seq: tokens[seq][-1:] for seq in range(len(prompts))}))
    return tokens, [torch.cat(rows) for rows in logits]


@torch.inference_mode()
def assert_matches_hf(hf_model, model, prompts, atol: float) -> None:
    tokens, ours = run_schedule(model, prompts)
    for seq, seq_tokens in enumerate(tokens):
        expected = hf_model(torch.tensor([seq_tokens])).logits[0].float()
        torch.testing.assert_close(ours[seq], expected, atol=atol, rtol=1e-5)


def random_prompts(vocab: int, lengths=(5, 23, 40, 17), seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


# --- the default model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_pair(default_model_path):
    hf = AutoModelForCausalLM.from_pretrained(default_model_path, dtype=torch.float32).eval()
    ours, _ = load_model(default_model_path, "float32", "cpu", backend=backend_on_cpu())
    return hf, ours


def test_default_model_matches_hf(default_pair, default_model_path):
    hf, ours = default_pair
    assert ours.tie_word_embeddings and ours.lm_head is None
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (9, 3, 64)
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "Once upon a time, in a land far away, there lived a small dragon who loved to read books "
        "about the stars and the sea.",
        "1, 2, 3, 4, 5,",
    ]
    prompts = [tokenizer(text).input_ids for text in texts]
    assert_matches_hf(hf, ours, prompts, atol=2e-4)


@torch.inference_mode()
def test_default_model_greedy_answers_paris(default_pair, default_model_path):
    _, ours = default_pair
    tokenizer = AutoTokenizer.from_pretrained(default_model_path)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    sim = PagedSim(ours, 1, len(ids) + 12)
    out = sim.step({0: ids})[0]
    generated = []
    for _ in range(10):
        generated.append(int(out[-1].argmax()))
        out = sim.step({0: generated[-1:]})[0]
    assert "Paris" in tokenizer.decode(generated)


# --- tiny random-weight checkpoints --------------------------------------------------------------

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256
)

CASES = {
    "llama-gqa2-tied": LlamaConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "llama-mha-untied-bias-headdim": LlamaConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=4, head_dim=32, attention_bias=True, mlp_bias=True,
        tie_word_embeddings=False,
    ),
    "llama3-rope-scaling-mqa": LlamaConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "llama-linear-rope": LlamaConfig(
        **TINY, num_attention_heads=2, num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "qwen2-bias-gqa3-tied": Qwen2Config(
        **TINY, num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True,
    ),
    "qwen2-yarn": Qwen2Config(
        **TINY, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        },
    ),
    "gemma2-window-softcap": Gemma2Config(
        **TINY, num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=8, attn_logit_softcapping=2.0, final_logit_softcapping=5.0,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gemma3-qk-norm-local-rope": Gemma3TextConfig(
        **TINY, num_attention_heads=4, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
        sliding_window=8, rope_theta=1000000.0, rope_local_base_freq=100.0,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "mistral-gqa4": MistralConfig(
        **TINY, num_attention_heads=8, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_checkpoint(request, tmp_path_factory):
    hf = random_hf_model(_with_arch(CASES[request.param]))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_tiny_models_match_hf(tiny_checkpoint):
    _, hf, path = tiny_checkpoint
    ours, config = load_model(path, "float32", "cpu", backend=backend_on_cpu())
    expected_class = config.architectures[0]
    assert type(ours).__name__ == expected_class
    assert ours.tie_word_embeddings == bool(config.tie_word_embeddings)
    assert_matches_hf(hf, ours, random_prompts(config.vocab_size), atol=1e-4)


@pytest.mark.parametrize("case", ["qwen2-bias-gqa3-tied", "gemma2-window-softcap"])
def test_model_on_the_triton_kernels(case):
    """Every kernel from ``pagedserve.kernels`` (what CUDA gets), in Triton's CPU interpreter; the Gemma 2
    case's one layer is a sliding-window layer with soft-capped scores, prompts up to 18 > 8 tokens.

    The interpreter mode is fixed when triton is first imported, so unless this process already
    interprets, the case runs in a child pytest started with ``TRITON_INTERPRET=1``.
    """
    pytest.importorskip("triton")
    from pagedserve.kernels._triton_utils import interpreter_active

    if not interpreter_active():
        assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1 but triton was imported before"
        test_id = f"{Path(__file__).name}::test_model_on_the_triton_kernels[{case}]"
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_id],
            cwd=Path(__file__).parent,
            env={**os.environ, "TRITON_INTERPRET": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0 and "1 passed" in result.stdout, result.stdout[-10000:] + result.stderr
        return
    config = CASES[case].__class__.from_dict(CASES[case].to_dict())
    config.num_hidden_layers = 1
    hf = random_hf_model(_with_arch(config))
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu("triton"))
    ours.load_weights(hf.state_dict().items())
    assert_matches_hf(hf, ours, random_prompts(256, lengths=(3, 9, 18, 7)), atol=1e-4)


def test_tiny_bias_layout():
    """Qwen2 has q/k/v biases but no o_proj bias; Llama follows attention_bias; Mistral has none."""
    qwen = build_model(_with_arch(CASES["qwen2-bias-gqa3-tied"]), torch.float32, "cpu", backend_on_cpu())
    attn = qwen.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    llama_config = _with_arch(CASES["llama-mha-untied-bias-headdim"])
    llama = build_model(llama_config, torch.float32, "cpu", backend_on_cpu())
    attn = llama.model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
    assert llama.model.layers[0].mlp.gate_up_proj.weight.shape == (2 * 96, 64)
    mistral = build_model(_with_arch(CASES["mistral-gqa4"]), torch.float32, "cpu", backend_on_cpu())
    assert mistral.model.layers[0].self_attn.qkv_proj.bias is None


def _with_arch(config):
    names = {
        "llama": "LlamaForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "mistral": "MistralForCausalLM",
        "gemma2": "Gemma2ForCausalLM",
        "gemma3_text": "Gemma3ForCausalLM",
    }
    config.architectures = [names[config.model_type]]
    return config


def test_unsupported_architecture_lists_supported():
    config = LlamaConfig(**TINY, num_attention_heads=4)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(
        ValueError, match=r"GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM"
    ):
        build_model(config, torch.float32, "cpu", backend_on_cpu())


def test_unsupported_rope_type_is_named():
    config = _with_arch(
        LlamaConfig(
            **TINY, num_attention_heads=4, rope_parameters={"rope_type": "proportional", "factor": 2.0}
        )
    )
    with pytest.raises(ValueError, match="proportional"):
        build_model(config, torch.float32, "cpu", backend_on_cpu())


@torch.inference_mode()
def test_dynamic_ntk_past_max_position_matches_hf_generate():
    """Dynamic NTK scaling changes the frequencies once a sequence passes max_position_embeddings (32):
    decoding from a 24-token prompt to position 43 rotates every new token as HF's generate does (its
    ``dynamic_rope_update`` recomputes them for each longer sequence and keeps the cached keys)."""
    from parity import hf_greedy

    config = _with_arch(
        LlamaConfig(
            **{**TINY, "max_position_embeddings": 32},
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        )
    )
    hf = random_hf_model(config)
    ours = build_model(hf.config, torch.float32, "cpu", backend_on_cpu())
    ours.load_weights(hf.state_dict().items())
    assert ours.max_position == 64  # max_position_embeddings * factor
    prompt, steps = random_prompts(256, lengths=(24,))[0], 20
    expected = hf_greedy(hf, prompt, steps)
    sim = PagedSim(ours, 1, len(prompt) + steps)
    logits = sim.step({0: prompt})[0][-1]
    tokens, logprobs = [], []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, -1)[tokens[-1]]))
        logits = sim.step({0: tokens[-1:]})[0][-1]
    assert tokens == expected.tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(expected.logprobs), atol=1e-4, rtol=0)
