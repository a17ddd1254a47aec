"""Seeded PEFT LoRA adapters for a base model, made with the ``peft`` library (tests and benchmarks).

PEFT starts B at zero, so a fresh adapter changes nothing; ``make_peft_adapter`` overwrites every A and
B with seeded values large enough that greedy outputs really change, then saves the adapter as PEFT
does (``adapter_config.json`` + ``adapter_model.safetensors``). Torch, transformers and peft are imported
inside the functions: importing this module imports none of them.
"""

from __future__ import annotations

from pathlib import Path

# PEFT's module names in a Llama-style checkpoint, by the sets the tests use.
QV = ["q_proj", "v_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL_LINEAR = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def make_peft_adapter(
    base_dir: str | Path,
    out_dir: str | Path,
    rank: int,
    target_modules: list[str],
    seed: int,
    alpha: float | None = None,
    use_rslora: bool = False,
) -> Path:
    """Save a seeded LoRA adapter of the model in ``base_dir`` to ``out_dir``; returns ``out_dir``.

    A is ~ N(0, 1/in) and B ~ N(0, 0.1/r) (before PEFT's ``alpha / r`` scaling, ``alpha`` defaulting to
    ``2 * rank``): each targeted projection moves by a few percent of its output, enough to change a
    greedy continuation of the embedded model after a few tokens.
    """
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(target_modules),
        lora_dropout=0.0,
        bias="none",
        use_rslora=use_rslora,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * (0.1 / rank) ** 0.5)
    out = Path(out_dir)
    model.save_pretrained(str(out))
    return out


def peft_greedy(
    base_dir: str | Path, adapter_dir: str | Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """HF Transformers (+ peft's ``PeftModel`` when ``adapter_dir`` is given) greedy continuations of each
    prompt's token ids, float32 on the CPU: the reference the engine must equal token for token."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), torch_dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                max_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(ids) :].tolist())
    return outputs
