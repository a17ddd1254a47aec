"""Tensor and pipeline parallelism in the offline engine (``LLM(tensor_parallel_size=2)``,
``pipeline_parallel_size``): greedy tokens, logprobs and prompt logprobs equal one rank's, with chunked
prefill and prefix-cache hits, on a random Llama whose 2 KV heads split (one per rank), on one whose single
KV head both ranks hold, on a Phi-3 whose fused projections are cut per part, and on a 5-layer Llama cut
into 2 stages (alone and with 2 tensor-parallel ranks each); which pieces of the checkpoint a rank reads;
and what is refused.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pagedserve.server.config import EngineConfig
from pagedserve.server.core.host_tier import KVTransfers
from pagedserve.server.models.registry import check_pipeline_parallel, check_tensor_parallel
from transformers import LlamaConfig, LlavaConfig, MixtralConfig

from pagedserve import LLM, SamplingParams
from pagedserve.testing.tiny_models import TINY

ENGINE = dict(dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16,  # chunked prefill
              kv_cache_memory_bytes=4 << 20, enable_prefix_caching=True)


def _prompts(seed: int) -> list[list[int]]:
    """Two rounds' worth: prompts sharing 16-token prefixes, so the second half hits the prefix cache."""
    generator = torch.Generator().manual_seed(seed)
    prefixes = [torch.randint(0, 256, (16,), generator=generator).tolist() for _ in range(3)]
    return [p + torch.randint(0, 256, (n,), generator=generator).tolist() for p in prefixes for n in (5, 19)]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list[float]]]:
    """Round one asks for prompt logprobs too (their rows' logits gathered in slices); round two, without
    them, reuses round one's prefixes from the cache."""
    answers = []
    for half, prompt_logprobs in ((prompts[::2], 0), (prompts[1::2], None)):
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0,
                                prompt_logprobs=prompt_logprobs)
        for out in llm.generate([{"prompt_token_ids": p} for p in half], params):
            done = out.outputs[0]
            chosen = [entry[t].logprob for t, entry in zip(done.token_ids, done.logprobs, strict=True)]
            prompt_lps = [next(iter(e.values())).logprob for e in (out.prompt_logprobs or [None])[1:]]
            answers.append((list(done.token_ids), chosen, prompt_lps))
    return answers


@pytest.mark.parametrize("checkpoint", ["llama_kv2", "llama_kv1", "phi3_fused"])
def test_two_ranks_equal_one(checkpoint: str, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(checkpoint)
    prompts = _prompts(seed=7)
    one = _run(LLM(str(path), **ENGINE), prompts)
    llm = LLM(str(path), tensor_parallel_size=2, **ENGINE)
    try:
        core = llm.engine.core
        (worker,) = core.executor.ranks.workers
        assert worker.is_alive()
        # Rank 0 holds half the query heads, its KV heads (2/2 or the one replicated) and half the vocab.
        attention = core.executor.model.model.layers[0].self_attn
        kv_heads = 1  # 2 KV heads: one each; 1 KV head: both hold it
        assert (attention.num_heads, attention.num_kv_heads) == (4, kv_heads)
        assert tuple(attention.qkv_proj.weight.shape) == ((4 + 2 * kv_heads) * 8, 64)
        assert tuple(core.executor.model.model.layers[0].mlp.gate_up_proj.weight.shape) == (2 * 48, 64)
        assert tuple(core.executor.model.model.layers[0].mlp.down_proj.weight.shape) == (64, 48)
        assert tuple(core.executor.model.model.embed_tokens.weight.shape) == (130, 64)  # ceil(259 / 2)
        assert core.executor.model.attention_layers()[0].k_cache.shape[2] == kv_heads
        two = _run(llm, prompts)
        assert core.kv.prefix_hits > 0
    finally:
        llm.shutdown()
    assert not worker.is_alive()
    _assert_same_answers(one, two)


def test_heads_that_do_not_split_are_refused_before_any_rank_starts() -> None:
    with pytest.raises(ValueError, match="9 query heads and 3 KV heads"):
        LLM(tensor_parallel_size=2, device="cpu")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"enable_lora": True}, "enable_lora"),
        ({"quantization": "int8"}, "quantization 'int8'"),
        ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
        ({"device": "cuda:1"}, "device 'cuda:1'"),
    ],
)
def test_features_without_tensor_parallel_are_refused(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=f"does not support {named}"):
        EngineConfig(tensor_parallel_size=2, **fields)


def test_tensor_parallel_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_mixture_of_experts_is_refused() -> None:
    config = MixtralConfig(**TINY, num_attention_heads=4, num_key_value_heads=2)
    config.architectures = ["MixtralForCausalLM"]
    with pytest.raises(ValueError, match="MixtralForCausalLM does not support tensor parallelism"):
        check_tensor_parallel(config, 2)


def test_each_rank_reads_only_its_pieces_of_the_checkpoint(llama_kv2: Path) -> None:
    """Rank 1 of 2 (built without a group: loading runs no collective) reads half of each split tensor
    from the safetensors file, and holds exactly the whole model's second halves."""
    from pagedserve.server.backend import select_backend
    from pagedserve.server.distributed.parallel_state import TensorParallel
    from pagedserve.server.loader import load_model
    from pagedserve.server.loader.weights import iterate_weights, weight_files
    from safetensors.torch import load_file

    backend = select_backend(torch.device("cpu"), torch.float32, "torch")
    model, _ = load_model(llama_kv2, "float32", "cpu", backend=backend, tp=TensorParallel(rank=1, size=2))
    read = dict(iterate_weights(llama_kv2, model.checkpoint_piece))
    full = {k: v for file in weight_files(llama_kv2) for k, v in load_file(file).items()}
    prefix = "model.layers.0"
    assert read[f"{prefix}.self_attn.q_proj.weight"].shape == (32, 64)  # heads 4..7 of 8, head_dim 8
    assert read[f"{prefix}.self_attn.o_proj.weight"].shape == (64, 32)  # their input columns
    assert read["lm_head.weight"].shape == (259 - 130, 64)  # ids 130..258
    layer = model.model.layers[0]
    q, k, v = layer.self_attn.qkv_proj.weight.split([32, 8, 8])
    torch.testing.assert_close(q, full[f"{prefix}.self_attn.q_proj.weight"][32:])
    torch.testing.assert_close(k, full[f"{prefix}.self_attn.k_proj.weight"][8:])  # KV head 1 of 2
    torch.testing.assert_close(v, full[f"{prefix}.self_attn.v_proj.weight"][8:])
    torch.testing.assert_close(layer.mlp.down_proj.weight, full[f"{prefix}.mlp.down_proj.weight"][:, 48:])
    head = model.lm_head.weight
    torch.testing.assert_close(head[:129], full["lm_head.weight"][130:])
    assert not head[129:].any()  # the padding row past the vocabulary


def test_two_ranks_with_the_host_kv_tier_equal_one(llama_kv2: Path) -> None:
    """The host tier's copies go to every rank's connector worker before the step, so each rank stores and
    loads its own shard of a block: with a device pool too small for the prefixes, prefix hits come from
    the tier and the tokens and logprobs equal one rank's with a roomy pool."""
    prompts = _prompts(seed=11)
    one = _run(LLM(str(llama_kv2), **ENGINE), prompts)
    # One rank's shard of a block: 2 layers x K and V x 8 tokens x 1 KV head x head_dim 8 x 4 bytes.
    tiny_pool = {**ENGINE, "kv_cache_memory_bytes": 10 * 1024, "kv_offloading_size": (64 << 10) / (1 << 30)}
    llm = LLM(str(llama_kv2), tensor_parallel_size=2, **tiny_pool)
    try:
        core = llm.engine.core
        assert core.executor.num_blocks == 10 and core.executor.kv_workers["offloading"].host_caches
        two = _run(llm, prompts)
        tier = core.stats().kv_offload
        assert tier is not None and tier.hits > 0 and tier.load_bytes > 0, tier
        # Copies in a step that runs nothing reach the other rank too, which stays in lock step: the next
        # generate's collectives would fail on a rank that died of the command.
        copies = KVTransfers(stores=[(0, 0)], loads=[(0, 0)])
        results = core.executor.run_kv_connectors({"offloading": copies})
        assert results == {"offloading": [None, None]}
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2))
        core.executor.check_alive()
    finally:
        llm.shutdown()
    for (tokens_1, lps_1, _), (tokens_2, lps_2, _) in zip(one, two, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lps_2), torch.tensor(lps_1), atol=1e-4, rtol=0)


def test_two_ranks_pool_as_one(tmp_path: Path) -> None:
    """The pooling runner under tensor parallelism (issue 40): each rank builds its shard without the LM
    head (a base-model checkpoint has none), and the vectors equal one rank's."""
    from pagedserve.testing.tiny_models import tiny_embedding_checkpoint

    folder = str(tiny_embedding_checkpoint(tmp_path, pooling="mean_tokens", base_model=True))
    prompts = [{"prompt_token_ids": p} for p in _prompts(seed=5)]
    one = [o.outputs.embedding for o in LLM(folder, **ENGINE).embed(prompts)]
    llm = LLM(folder, tensor_parallel_size=2, **ENGINE)
    try:
        two = [o.outputs.embedding for o in llm.embed(prompts)]
    finally:
        llm.shutdown()
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), atol=1e-5, rtol=0)


def _assert_same_answers(expected: list, got: list) -> None:
    for (tokens_1, lps_1, prompt_1), (tokens_2, lps_2, prompt_2) in zip(expected, got, strict=True):
        assert tokens_2 == tokens_1
        torch.testing.assert_close(torch.tensor(lps_2), torch.tensor(lps_1), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(prompt_2), torch.tensor(prompt_1), atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp", [1, 2])
def test_two_stages_equal_one_rank(tp: int, llama_5_layers: Path) -> None:
    """Layers 0-2 on stage 0 (rank 0, with the embedding and the head), 3-4 on stage 1 (with the final
    norm); each stage's KV cache only for its layers; with tp 2, each stage's heads split too."""
    prompts = _prompts(seed=13)
    one = _run(LLM(str(llama_5_layers), **ENGINE), prompts)
    llm = LLM(str(llama_5_layers), pipeline_parallel_size=2, tensor_parallel_size=tp, **ENGINE)
    try:
        executor = llm.engine.core.executor
        workers = executor.ranks.workers
        assert len(workers) == 2 * tp - 1 and all(w.is_alive() for w in workers)
        body = executor.model.model
        assert [type(layer).__name__ for layer in body.layers] == ["DecoderLayer"] * 3 + ["Identity"] * 2
        assert len(executor.model.attention_layers()) == 3 and body.norm is None
        assert body.embed_tokens is not None
        assert body.layers[0].self_attn.num_heads == 8 // tp
        two = _run(llm, prompts)
        assert llm.engine.core.kv.prefix_hits > 0
    finally:
        llm.shutdown()
    assert not [w for w in workers if w.is_alive()], "a rank outlived its engine"
    _assert_same_answers(one, two)


def test_a_later_stage_reads_only_its_layers(llama_5_layers: Path) -> None:
    """Stage 1 of 2 (built without a group: loading runs no collective) holds layers 3 and 4 and the final
    norm, equal to the checkpoint's, and neither the embedding nor the head."""
    from pagedserve.server.backend import select_backend
    from pagedserve.server.distributed.parallel_state import PipelineStage
    from pagedserve.server.loader import load_model
    from pagedserve.server.loader.weights import weight_files
    from safetensors.torch import load_file

    backend = select_backend(torch.device("cpu"), torch.float32, "torch")
    model, _ = load_model(llama_5_layers, "float32", "cpu", backend=backend, stage=PipelineStage(1, 2))
    names = {name.split(".")[2] if name.startswith("model.layers.") else name.split(".")[1]
             for name, _ in model.named_parameters()}
    assert names == {"3", "4", "norm"} and model.lm_head is None
    full = {k: v for file in weight_files(llama_5_layers) for k, v in load_file(file).items()}
    down = full["model.layers.4.mlp.down_proj.weight"]
    torch.testing.assert_close(model.model.layers[4].mlp.down_proj.weight, down)
    torch.testing.assert_close(model.model.norm.weight, full["model.norm.weight"])


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"nnodes": 2, "pipeline_parallel_size": 3, "master_port": 29500}, "nnodes 2 does not divide the 3"),
        ({"nnodes": 2, "pipeline_parallel_size": 2}, "nnodes > 1 needs master_port"),
        ({"nnodes": 2, "node_rank": 2}, "node_rank 2 must be below nnodes 2"),
        ({"nnodes": 2, "node_rank": 1, "pipeline_parallel_size": 2, "master_port": 1}, "headless runs"),
        ({"headless": True}, "headless runs every node but the leader"),
    ],
)
def test_what_several_nodes_need(fields: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        EngineConfig(**fields)


def test_what_pipeline_parallelism_refuses() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 does not support enable_lora"):
        EngineConfig(pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer >= 1"):
        EngineConfig(pipeline_parallel_size=0)
    llama = LlamaConfig(**TINY)
    llama.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        check_pipeline_parallel(llama, 3)
    llava = LlavaConfig(text_config=llama.to_dict())
    llava.architectures = ["LlavaForConditionalGeneration"]
    with pytest.raises(ValueError, match="LlavaForConditionalGeneration does not support pipeline"):
        check_pipeline_parallel(llava, 2)
