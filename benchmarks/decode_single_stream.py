"""Single-stream decode speed, side by side in one run: pagedserve fp32, int8 and gguf, HF Transformers
and llama.cpp on the same GGUF.

Each side decodes ``--tokens`` tokens (greedy, end-of-sequence ignored) after the same short prompt,
with the same number of threads, after one untimed warm-up generation; the time of the best of
``--repeats`` generations counts, as tok/s = tokens / time (the prompt's prefill is a few ms of it).

- pagedserve: ``make_llm(None | "int8" | "gguf")``: fp32 and int8 on the fp32 folder converted from the
  GGUF by server/loader/default_model.py (named by path: the model left unnamed runs its GGUF blocks, the
  default mode), gguf on the GGUF's own Q4_1 / Q8_0 blocks.
- HF Transformers: ``model.generate`` on the same fp32 folder, ``min_new_tokens = max_new_tokens``.
- llama.cpp: llama-cpp-python (a benchmark-only peer, never a dependency) on the embedded model's own
  GGUF (Q4_1). In this interpreter when ``llama_cpp`` imports, else through ``--llama-python``, the
  interpreter of a separate venv that has it; skipped with a message when neither works.

``--profile`` instead prints where a decode step's time goes (torch.profiler over 32 decode steps of
pagedserve fp32, int8 and gguf, ops grouped by name and input shape).

    PYTHONSAFEPATH=1 python -m pagedserve.benchmarks.decode_single_stream [--threads 2] \
        [--llama-python /tmp/llama-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."

# Run in llama-cpp-python's interpreter (argv: gguf path, threads, tokens, repeats, prompt); prints JSON.
LLAMA_CPP_SCRIPT = """
import json, sys, time
from llama_cpp import Llama
path, prompt = sys.argv[1], sys.argv[5]
threads, tokens, repeats = (int(a) for a in sys.argv[2:5])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=1024, verbose=False)
ids = llm.tokenize(prompt.encode())
def run(n):
    llm.reset()
    out = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1):
        out += 1
        if out == n:
            break
    return out
run(8)
best = float("inf")
for _ in range(repeats):
    t = time.perf_counter(); got = run(tokens); best = min(best, time.perf_counter() - t)
print(json.dumps({"tokens": got, "seconds": best}))
"""


def make_llm(quantization: str | None):
    """The embedded model in mode ``quantization``; None: its float32 weights, not the default mode."""
    from pagedserve import LLM, default_model

    model = None if quantization == "gguf" else str(default_model())
    return LLM(model, quantization=quantization, max_model_len=1024, kv_cache_memory_bytes=256 << 20)


def pagedserve_side(quantization: str | None, args: argparse.Namespace) -> dict:
    from pagedserve import SamplingParams

    llm = make_llm(quantization)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        (output,) = llm.generate([PROMPT], params, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    return {"tokens": len(output.outputs[0].token_ids), "seconds": best}


def hf_side(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedserve import default_model

    path = default_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = tokenizer(PROMPT, return_tensors="pt")

    def run(n: int) -> int:
        with torch.inference_mode():
            out = model.generate(**ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return out.shape[1] - ids["input_ids"].shape[1]

    run(8)
    best = float("inf")
    for _ in range(args.repeats):
        t = time.perf_counter()
        got = run(args.tokens)
        best = min(best, time.perf_counter() - t)
    return {"tokens": got, "seconds": best}


def llama_cpp_side(args: argparse.Namespace) -> dict | str:
    """The llama.cpp figures, or why they are missing."""
    from pagedserve.server.loader.default_model import _bundled_gguf

    gguf = str(_bundled_gguf())
    argv = [gguf, str(args.threads), str(args.tokens), str(args.repeats), PROMPT]
    try:
        import llama_cpp  # noqa: F401

        python = sys.executable
    except ImportError:
        python = args.llama_python
        if not python:
            return "llama_cpp does not import here and no --llama-python was given"
    result = subprocess.run([python, "-c", LLAMA_CPP_SCRIPT, *argv], capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    if result.returncode != 0:
        return f"llama-cpp-python failed: {result.stderr.strip()[-500:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def profile(args: argparse.Namespace) -> None:
    """Top ops of 32 single-stream decode steps, fp32, int8 and gguf."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from pagedserve import SamplingParams

    for quantization in (None, "int8", "gguf"):
        llm = make_llm(quantization)
        llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        engine = llm.engine
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        engine.add_request("profiled", PROMPT, params)
        engine.step()  # the prefill, not profiled
        started = time.perf_counter()
        with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(32):
                engine.step()
        print(f"== pagedserve {quantization or 'fp32'}: 32 decode steps, "
              f"{(time.perf_counter() - started) / 32 * 1e3:.2f} ms a step under the profiler ==")
        table = prof.key_averages(group_by_input_shape=True)
        print(table.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows,
                          max_name_column_width=40, max_shapes_column_width=60))
        engine.abort_request("profiled")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python")
    parser.add_argument("--skip", default="", help="comma-separated sides: fp32,int8,gguf,hf,llama.cpp")
    parser.add_argument("--profile", action="store_true", help="print where a decode step's time goes")
    parser.add_argument("--profile-rows", type=int, default=25)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    if args.profile:
        profile(args)
        return
    skip = set(filter(None, args.skip.split(",")))
    sides = {
        "pagedserve fp32": lambda: pagedserve_side(None, args),
        "pagedserve int8": lambda: pagedserve_side("int8", args),
        "pagedserve gguf": lambda: pagedserve_side("gguf", args),
        "HF Transformers fp32": lambda: hf_side(args),
        "llama.cpp Q4_1": lambda: llama_cpp_side(args),
    }
    names = {"pagedserve fp32": "fp32", "pagedserve int8": "int8", "pagedserve gguf": "gguf",
             "HF Transformers fp32": "hf",
             "llama.cpp Q4_1": "llama.cpp"}
    results: dict[str, float] = {}
    print(f"single-stream decode, {args.tokens} tokens, {args.threads} threads, best of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name, run in sides.items():
        if names[name] in skip:
            continue
        got = run()
        if isinstance(got, str):
            print(f"{name:24s} skipped: {got}", flush=True)
            continue
        results[name] = got["tokens"] / got["seconds"]
        print(f"{name:24s} {results[name]:7.1f} tok/s ({got['tokens']} tokens in {got['seconds']:.2f} s)",
              flush=True)
    peer = results.get("llama.cpp Q4_1")
    for name, rate in results.items():
        others = [other for other in ("HF Transformers fp32", "llama.cpp Q4_1") if other in results]
        ratios = [f"{rate / results[other]:.2f}x {other}" for other in others if other != name]
        if ratios:
            print(f"{name:24s} " + ", ".join(ratios))
    if peer is None:
        print("no llama.cpp figure: ratios to it are missing")
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
