"""Requests with one image against text-only requests of the same token count (issue 42).
``python -m pagedserve.benchmarks.images``.

One LLaVA-shaped engine, weights random (``load_format="dummy"``: no hub here): a CLIP ViT-B/16 tower at
224 pixels (196 image tokens a picture) and a SmolLM2-135M-shaped Llama decoder (its vocabulary cut to
the tiny tokenizer's, so the head costs little). Two workloads of ``--num-requests`` requests, each
``--output-len`` greedy tokens: every prompt with one distinct image, and every prompt text only with
exactly as many tokens (the same placeholder count of ordinary text tokens). Each workload runs all at
once through ``LLM.generate`` (continuous batching), after a warm-up; the two alternate for ``--rounds``
rounds so that load on a shared machine hits both alike.

Reports per workload: requests/s, output tokens/s, TTFT p50 and p90 (the engine's first-token time minus
arrival, all requests queued at once), and the image/text ratios; ``--json`` writes them too. The gap is
the vision tower: one encoder pass per image (its features are not cached across distinct images).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any


def build_checkpoint(folder: Path) -> None:
    """Config, tokenizer and processor of the LLaVA shape above; the weights come from ``dummy``."""
    from transformers import (
        AutoTokenizer,
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaProcessor,
    )

    from pagedserve.testing.tiny_models import LLAVA_IMAGE_TOKEN, LLAVA_TEMPLATE, TINY_VOCAB
    from pagedserve.testing.tiny_tokenizer import build_tiny_tokenizer

    vision = CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                              num_attention_heads=12, image_size=224, patch_size=16, projection_dim=512)
    text = LlamaConfig(vocab_size=TINY_VOCAB + 1, hidden_size=576, intermediate_size=1536,
                       num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                       max_position_embeddings=2048, tie_word_embeddings=True)
    LlavaConfig(vision_config=vision, text_config=text, image_token_index=LLAVA_IMAGE_TOKEN,
                architectures=["LlavaForConditionalGeneration"]).save_pretrained(folder)
    build_tiny_tokenizer(folder, ("<image>",), LLAVA_TEMPLATE)
    size = {"height": 224, "width": 224}
    image_processor = CLIPImageProcessor(size={"shortest_edge": 224}, crop_size=size)
    processor = LlavaProcessor(image_processor=image_processor,
                               tokenizer=AutoTokenizer.from_pretrained(str(folder)), patch_size=16,
                               vision_feature_select_strategy="default", image_token="<image>",
                               num_additional_image_tokens=1, chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(str(folder))


def workloads(llm: Any, num_requests: int, seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(image requests, text-only requests of the same token counts)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    images, texts = [], []
    for i in range(num_requests):
        prompt = f"<|im_start|>user\nrequest {i}: describe <image> briefly<|im_end|>\n<|im_start|>assistant\n"
        picture = Image.fromarray(rng.integers(0, 255, (256, 256, 3), dtype=np.uint8))
        image_request = {"prompt": prompt, "multi_modal_data": {"image": picture}}
        images.append(image_request)
        num_tokens = len(llm.engine.processor.process_images(dict(image_request))["prompt_token_ids"])
        texts.append({"prompt_token_ids": rng.integers(0, 256, num_tokens).tolist()})
    return images, texts


def run(llm: Any, requests: list[dict[str, Any]], output_len: int) -> dict[str, float]:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(requests, params)
    elapsed = time.perf_counter() - start
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    return {
        "seconds": elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "output_tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[min(len(ttfts) - 1, round(0.9 * (len(ttfts) - 1)))],
        "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs) / len(outputs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedserve.benchmarks.images", description=__doc__)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args(argv)

    from pagedserve import LLM

    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(Path(folder))
        llm = LLM(folder, load_format="dummy", dtype="float32", enable_prefix_caching=False)
        image_requests, text_requests = workloads(llm, args.num_requests, args.seed)
        run(llm, image_requests[:2], 2)  # warm-up: first calls of both paths
        run(llm, text_requests[:2], 2)
        rounds: dict[str, list[dict[str, float]]] = {"image": [], "text": []}
        for _ in range(args.rounds):
            rounds["image"].append(run(llm, image_requests, args.output_len))
            rounds["text"].append(run(llm, text_requests, args.output_len))
    report = {kind: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
              for kind, runs in rounds.items()}  # fmt: skip
    report["image_over_text"] = {
        "requests_per_s": report["image"]["requests_per_s"] / report["text"]["requests_per_s"],
        "ttft_p50": report["image"]["ttft_p50_s"] / report["text"]["ttft_p50_s"],
    }
    for kind in ("image", "text"):
        r = report[kind]
        print(f"{kind:>5}: {r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
              f"TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, p90 {r['ttft_p90_s'] * 1000:.0f} ms, "
              f"{r['prompt_tokens']:.0f} prompt tokens")
    ratio = report["image_over_text"]
    print(f"image / text: throughput x{ratio['requests_per_s']:.2f}, TTFT p50 x{ratio['ttft_p50']:.2f}")
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, **report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
