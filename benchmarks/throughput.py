"""`pagedserve bench throughput`: the engine's offline throughput, optionally against HF Transformers.

The workload is a mixed one: ``--num-prompts`` prompts of random token ids, each with a prompt length
drawn uniformly from ``--input-len-range`` and an output length from ``--output-len-range`` (seeded).
Every request generates exactly its output length: greedy, ``ignore_eos``.

pagedserve: ``LLM(model).generate(all prompts, one SamplingParams per prompt)``: all requests are queued at
once and the engine batches them continuously.

Hugging Face Transformers (``--compare hf``), the same prompts in the same process: ``model.generate`` on
static batches of ``--hf-batch-size`` requests, taken in the workload's order, left-padded, greedy, with
``max_new_tokens = min_new_tokens =`` the largest output length in the batch (a static batch runs until
its longest request is done; ``min_new_tokens`` plays ``ignore_eos``). Counted fairly: only each request's
own requested output tokens count, not the extra tokens a shorter request is dragged along for, and not
the padding; prompt tokens are the real prompt lengths for both. Time for both: the wall time of the
generation calls only, after loading the model and after one small warm-up generation (not counted).
Dtype: float32 on CPU for both (``auto``); on CUDA the engine's ``auto`` is bfloat16 and HF uses the same.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from pagedserve.benchmarks import datasets


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder or hub id (default: the embedded model)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-range", default="20:400", help="prompt tokens, uniform in LO:HI")
    parser.add_argument("--output-len-range", default="16:256", help="output tokens, uniform in LO:HI")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compare", default="none", type=_sides,
        help="comma-separated: hf (also run HF Transformers), float-weights (also run the engine on the "
             "model's float weights, the converted folder: what the default mode must beat), or none",
    )
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the HF run")
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16 (both runs)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda (both runs)")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="engine: requests per step")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine: tokens per step")
    parser.add_argument("--kv-cache-dtype", default="auto", help="engine: auto | fp8 (the KV cache's dtype)")
    parser.add_argument(
        "--quantization", default=None,
        help="engine: int8 | gguf (default: the model's own, gguf for the embedded model on one CPU rank)",
    )
    parser.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the warm-up calls")
    parser.add_argument("--skip-engine", action="store_true", help="run only the HF side (with --compare hf)")
    parser.add_argument("--result-json", default=None, help="write the figures to this file")


COMPARE_SIDES = ("hf", "float-weights")


def _sides(text: str) -> frozenset[str]:
    sides = frozenset(part.strip() for part in text.split(",") if part.strip() not in ("", "none"))
    if not sides <= set(COMPARE_SIDES):
        raise argparse.ArgumentTypeError(f"--compare takes none or {', '.join(COMPARE_SIDES)}, got {text!r}")
    return sides


def _resolve(args: argparse.Namespace) -> tuple[str, Any, Any]:
    import torch

    if args.model:
        model_path = args.model
    else:
        from pagedserve import default_model

        model_path = default_model()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if device.startswith("cuda") else "float32"
    return model_path, torch.device(device), getattr(torch, dtype)


def build_workload(tokenizer: Any, args: argparse.Namespace) -> list[tuple[list[int], int]]:
    vocab = int(getattr(tokenizer, "vocab_size", None) or len(tokenizer))
    return datasets.random_token_prompts(
        args.num_prompts,
        datasets.parse_range(args.input_len_range),
        datasets.parse_range(args.output_len_range),
        vocab,
        special_ids=getattr(tokenizer, "all_special_ids", ()) or (),
        seed=args.seed,
    )


def hf_batches(workload: list[tuple[list[int], int]], batch_size: int) -> list[list[int]]:
    """Indices of the static HF batches: consecutive requests in workload order."""
    idx = list(range(len(workload)))
    return [idx[i : i + batch_size] for i in range(0, len(idx), batch_size)]


def hf_token_accounting(workload: list[tuple[list[int], int]], batch_size: int) -> dict[str, int]:
    """What the HF run generates vs. what it is credited with (only the requested output tokens)."""
    generated = counted = padded_prompt = 0
    for batch in hf_batches(workload, batch_size):
        max_out = max(workload[i][1] for i in batch)
        max_in = max(len(workload[i][0]) for i in batch)
        generated += max_out * len(batch)
        counted += sum(workload[i][1] for i in batch)
        padded_prompt += max_in * len(batch)
    return {
        "generated_tokens": generated,
        "counted_output_tokens": counted,
        "padded_prompt_tokens": padded_prompt,
    }


def run_engine(
    workload: list, args: argparse.Namespace, device: Any, dtype: Any, float_weights: str | None = None
) -> dict:
    """The engine on the model as the user named it, or on ``float_weights`` (a folder of float tensors:
    no quantization unless --quantization names one)."""
    from pagedserve import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "device": device.type}
    if args.max_num_seqs:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    kwargs["kv_cache_dtype"] = args.kv_cache_dtype
    if args.quantization and float_weights is None:
        kwargs["quantization"] = args.quantization
    t = time.perf_counter()
    # The model as the user named it (None: the embedded one), so its default mode is the server's; HF
    # reads the converted folder.
    llm = LLM(model=float_weights or args.model, **kwargs)
    load_s = time.perf_counter() - t
    if args.warmup:
        llm.generate(
            [{"prompt_token_ids": workload[0][0][:16]}],
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0),
        )
    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in workload]
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    requested = sum(n for _, n in workload)
    if produced != requested:
        print(f"warning: engine produced {produced} output tokens, {requested} asked", file=sys.stderr)
    kv_cache_tokens = llm.engine.core.executor.num_blocks * llm.engine.core.config.block_size
    quantization = llm.engine.core.config.quantization
    del llm, outputs
    gc.collect()
    figures = _figures("pagedserve", workload, elapsed, produced, load_s=load_s)
    return {**figures, "kv_cache_tokens": kv_cache_tokens, "quantization": quantization}


def run_hf(model_path: str, workload: list, args: argparse.Namespace, device: Any, dtype: Any) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pad_id = 0 if pad_id is None else int(pad_id)
    t = time.perf_counter()
    try:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=dtype)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t

    def generate(batch: list[tuple[list[int], int]]) -> int:
        max_in = max(len(ids) for ids, _ in batch)
        max_out = max(n for _, n in batch)
        input_ids = torch.full((len(batch), max_in), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), max_in), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):  # left padding
            input_ids[row, max_in - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, max_in - len(ids) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max_out,
                min_new_tokens=max_out,
                do_sample=False,
                pad_token_id=pad_id,
            )
        return int(out.shape[1] - max_in)

    if args.warmup:
        generate([(workload[0][0][:16], 4)])
    from tqdm.auto import tqdm

    batches = hf_batches(workload, args.hf_batch_size)
    t = time.perf_counter()
    for batch in tqdm(batches, desc="HF batches", file=sys.stderr):
        items = [workload[i] for i in batch]
        steps = generate(items)
        if steps != max(n for _, n in items):
            print(f"warning: HF generated {steps} steps, {max(n for _, n in items)} asked", file=sys.stderr)
    elapsed = time.perf_counter() - t
    acct = hf_token_accounting(workload, args.hf_batch_size)
    fig = _figures("hf", workload, elapsed, acct["counted_output_tokens"], load_s=load_s)
    fig.update(acct, batch_size=args.hf_batch_size)
    return fig


def _figures(name: str, workload: list, elapsed: float, output_tokens: int, **extra: Any) -> dict[str, Any]:
    prompt_tokens = sum(len(ids) for ids, _ in workload)
    return {
        "backend": name,
        "elapsed_time": elapsed,
        "num_requests": len(workload),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "requests_per_second": len(workload) / elapsed,
        "output_tokens_per_second": output_tokens / elapsed,
        "tokens_per_second": (prompt_tokens + output_tokens) / elapsed,
        **extra,
    }


def _line(label: str, f: dict[str, Any]) -> str:
    return (
        f"{label:<12} Throughput: {f['requests_per_second']:.2f} requests/s, "
        f"{f['tokens_per_second']:.2f} total tokens/s, {f['output_tokens_per_second']:.2f} output tokens/s "
        f"({f['num_requests']} requests, {f['output_tokens']} output tokens in {f['elapsed_time']:.1f} s)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        datasets.parse_range(args.input_len_range)
        datasets.parse_range(args.output_len_range)
        if args.num_prompts < 1 or args.hf_batch_size < 1:
            raise ValueError("--num-prompts and --hf-batch-size must be >= 1")
        if args.skip_engine and "hf" not in args.compare:
            raise ValueError("--skip-engine needs --compare hf")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoTokenizer

    model_path, device, dtype = _resolve(args)
    workload = build_workload(AutoTokenizer.from_pretrained(model_path), args)
    in_lens = [len(ids) for ids, _ in workload]
    out_lens = [n for _, n in workload]
    dtype_name = str(dtype).replace("torch.", "")
    print(
        f"Workload: {len(workload)} prompts, {sum(in_lens)} prompt tokens "
        f"({min(in_lens)}-{max(in_lens)} each), {sum(out_lens)} output tokens "
        f"({min(out_lens)}-{max(out_lens)} each), seed {args.seed}; "
        f"model {model_path}, {device}, {dtype_name}, {torch.get_num_threads()} threads",
        flush=True,
    )
    result: dict[str, Any] = {
        "model": model_path,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "num_threads": torch.get_num_threads(),
        "num_prompts": args.num_prompts,
        "input_len_range": args.input_len_range,
        "output_len_range": args.output_len_range,
        "seed": args.seed,
    }
    if not args.skip_engine:
        result["pagedserve"] = run_engine(workload, args, device, dtype)
        mode = result["pagedserve"]["quantization"]
        print(_line("pagedserve", result["pagedserve"]), f"[quantization: {mode}]", flush=True)
    if "float-weights" in args.compare:
        result["float_weights"] = run_engine(workload, args, device, dtype, float_weights=model_path)
        print(_line("float wts", result["float_weights"]), flush=True)
        if "pagedserve" in result:
            ratio = result["pagedserve"]["output_tokens_per_second"] / result["float_weights"][
                "output_tokens_per_second"]
            result["speedup_over_float_weights"] = ratio
            print(f"Speed-up of the default mode over the float weights (output tokens/s): {ratio:.2f}x")
    if "hf" in args.compare:
        result["hf"] = run_hf(model_path, workload, args, device, dtype)
        h = result["hf"]
        print(_line("HF", h), flush=True)
        print(
            f"{'':<12} (HF static batches of {h['batch_size']}: {h['generated_tokens']} tokens generated, "
            f"{h['counted_output_tokens']} requested tokens counted)"
        )
        if "pagedserve" in result:
            ratio = result["pagedserve"]["output_tokens_per_second"] / h["output_tokens_per_second"]
            result["speedup_output_tokens_per_second"] = ratio
            print(f"Speed-up of pagedserve over HF (output tokens/s): {ratio:.2f}x")
    if args.result_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.result_json)), exist_ok=True)
        with open(args.result_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0
