"""Engine configuration, validated in one place so every entry point (LLM, CLI, server) agrees."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pagedserve.server.lora_request import LoRAModulePath
from pagedserve.server.speculative_config import SpeculativeConfig

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of the embedded model in fp32
CPU_DEFAULT_BATCHED_TOKENS = 2048
GPU_DEFAULT_BATCHED_TOKENS = 8192
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
# Weight quantization, each a method of server/layers/quantization/. "gguf": the checkpoint's own GGUF
# blocks (a .gguf model, or the embedded one); server/loader/gguf.py reads them in place of the converted
# folder's float tensors.
QUANTIZATION_METHODS = ("int8", "fp8", "gguf")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16",
}
# vLLM's --kv-cache-dtype values that exist here: "auto" is the model's dtype, "fp8" means fp8_e4m3.
KV_CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
# vLLM's --kv-offloading-backend values that exist here: "native", the CPU tier of server/core/host_tier.py.
KV_OFFLOADING_BACKENDS = ("native",)
GIB = 1 << 30


@dataclass
class EngineConfig:
    model: str | None = None
    tokenizer: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    kv_cache_memory_bytes: int | None = None
    # vLLM's CPU KV offloading: a host-memory tier of this many GiB (all ranks together, as vLLM's) behind
    # the device pool; evicted blocks go there and prefix hits there are copied back, not recomputed
    # (server/core/host_tier.py). None: off. The CLI's --kv-offload-bytes sets it from bytes.
    kv_offloading_size: float | None = None
    # vLLM's kv_offloading_backend: "native" (None means it too, once kv_offloading_size is set).
    kv_offloading_backend: str | None = None
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # vLLM's async scheduling: the next step launched before the last one's tokens are read back, where
    # that leaves outputs unchanged (server/core/scheduler.py schedule_ahead). None: on a GPU only.
    async_scheduling: bool | None = None
    # Request defaults from a generation_config.json: "auto" (the model's), "vllm" (none) or a folder
    # holding one (server/loader/generation_config.py).
    generation_config: str = "auto"
    # "triton" | "cpu" | "torch"; None: $PAGEDSERVE_ATTENTION_BACKEND, else by device (server/backend.py).
    # The engine sets it to the backend it runs.
    attention_backend: str | None = None
    # Publish KV cache events on GET /v1/kv_events (server/core/kv_events.py) for the router's
    # kv-events strategy. vLLM configures its ZMQ publisher with --kv-events-config; ours is one stream
    # on the engine's own port, so a switch is all there is to say.
    enable_kv_events: bool = False
    # The KV cache's element type (vLLM's kv_cache_dtype, KV_CACHE_DTYPES): "fp8" halves a 16-bit
    # cache's bytes per token, with per-layer scales (server/layers/attention.py).
    kv_cache_dtype: str = "auto"
    # vLLM's calculate_kv_scales: set an FP8 cache's scales from the first prefill's K/V (amax / 448)
    # instead of 1.0.
    calculate_kv_scales: bool = False
    # vLLM's dict (or its JSON text), parsed into server/speculative_config.py SpeculativeConfig; None: off
    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    # Weight quantization (server/layers/quantization/): "int8" (weight-only, per output channel, quantized
    # at load), "gguf" (a .gguf model's own Q8_0/Q4_0/Q4_1 blocks) or None: the checkpoint's own format, as
    # vLLM detects a checkpoint's quantization. That is "gguf" for a .gguf file, the embedded model
    # included, on one CPU rank (checkpoint_quantization); a model folder, or a converted .gguf's folder,
    # is its float tensors.
    quantization: str | None = None
    # Why the weights run in ``quantization`` (set by __post_init__; /version reports it).
    quantization_reason: str = field(default="", init=False)
    # Many LoRA adapters on the base model (server/lora/): max_loras device slots (distinct adapters per
    # step), adapters up to max_lora_rank, a CPU cache of max_cpu_loras (None: max_loras) read adapters,
    # and adapters registered at start (LoRAModulePath, or its "name=path" / JSON text).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[LoRAModulePath] | None = None
    # Ranks one model is split across (Megatron's tensor parallelism, server/distributed/): one process
    # per rank, rank 0 in the engine's; gloo between CPU ranks, NCCL between GPUs cuda:0 .. cuda:N-1.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self._check_lora()
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"block_size must be one of {SUPPORTED_BLOCK_SIZES}, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {self.num_gpu_blocks_override}")
        self._check_kv_offloading()
        self._check_draft_model()
        if self.enable_kv_events and not self.enable_prefix_caching:
            raise ValueError("enable_kv_events needs enable_prefix_caching: without it no block is cached")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.calculate_kv_scales and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            raise ValueError("calculate_kv_scales needs an fp8 kv_cache_dtype (the scales of an "
                             f"{self.kv_cache_dtype!r} cache do nothing)")
        if self.quantization is None:
            self.quantization, self.quantization_reason = self.checkpoint_quantization()
        else:
            self.quantization_reason = "asked for (quantization / --quantization)"
        if self.quantization is not None:
            self.quantization = self.quantization.lower()
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(
                    f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or None), "
                    f"got {self.quantization!r}"
                )
        if self.generation_config not in ("auto", "vllm") and not (
            Path(self.generation_config).expanduser() / "generation_config.json"
        ).is_file():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                f"got {self.generation_config!r}"
            )
        self._check_tensor_parallel()

    def checkpoint_quantization(self) -> tuple[str | None, str]:
        """The mode a model given without one runs in, and why: its GGUF blocks for a .gguf file (None: the
        embedded model's) on a CPU and one rank, as vLLM runs a GGUF file. gguf is the fastest mode there
        whose quality holds, on every CPU kind measured (benchmarks/README.md, "The embedded model's default
        mode"; tests/models/test_quantization.py): its batched rows go through a dense copy in the fastest
        dtype the CPU multiplies (kernels/cpu.py ``dense_dtype``). On a GPU the Triton GGUF kernel is slower
        than the bfloat16 GEMM (benchmarks/README.md, "On a GPU"), and under tensor parallelism the blocks
        are not split, so float weights there."""
        gguf_file = self.model is None or (self.model.endswith(".gguf") and Path(self.model).is_file())
        if not gguf_file:
            return None, "the checkpoint's float weights (no quantization asked for)"
        if self.tensor_parallel_size != 1:
            return None, "float weights: GGUF blocks are not split across tensor-parallel ranks"
        if self.device not in ("auto", "cpu") or self.torch_device.type != "cpu":
            return None, "float weights: on a GPU the bfloat16 GEMM is faster than the GGUF kernel"
        return "gguf", ("the GGUF file's own blocks: on a CPU the fastest mode at equal quality, "
                        "single-stream and batched (benchmarks/README.md)")

    def _check_tensor_parallel(self) -> None:
        """What does not run split across ranks yet is refused here, never run wrong."""
        size = self.tensor_parallel_size
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if size == 1:
            return
        refused = {
            "enable_lora (LoRA adapters)": self.enable_lora,
            f"quantization {self.quantization!r}": self.quantization is not None,
            f"kv_cache_dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype != "auto",
            f"device {self.device!r} (rank r runs on cuda:r: use 'cuda' or 'auto')":
                self.device.startswith("cuda:"),
        }
        for name, requested in refused.items():
            if requested:
                raise ValueError(f"tensor_parallel_size {size} does not support {name} yet")
        if self.torch_device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs, "
                             f"{torch.cuda.device_count()} are visible")

    def _check_kv_offloading(self) -> None:
        backend = self.kv_offloading_backend
        if backend is not None and backend not in KV_OFFLOADING_BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, "
                             f"got {backend!r}")
        if self.kv_offloading_size is None:
            if self.kv_offloading_backend is not None:
                raise ValueError("kv_offloading_backend needs kv_offloading_size (GiB of host memory)")
            return
        if not self.kv_offloading_size > 0:
            raise ValueError(f"kv_offloading_size must be > 0 GiB, got {self.kv_offloading_size}")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier keeps cached blocks")
        self.kv_offloading_backend = "native"

    def _check_draft_model(self) -> None:
        """A draft model's cache follows the target's blocks on one rank and in the device pool only."""
        spec = self.speculative_config
        if not isinstance(spec, SpeculativeConfig) or not spec.uses_draft_model:
            return
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model is not supported with tensor parallelism")
        if self.kv_offload_bytes:
            # The host tier copies the target's layers only: a loaded block would lack the draft's K/V.
            raise ValueError("speculative_config: a draft model is not supported with kv_offloading_size")

    @property
    def kv_offload_bytes(self) -> int:
        """The host tier's budget in bytes (0: off)."""
        return round(self.kv_offloading_size * GIB) if self.kv_offloading_size is not None else 0

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        modules = [LoRAModulePath.parse(m) for m in self.lora_modules or []]
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"lora_modules names must be unique, got {names}")
        self.lora_modules = modules or None

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            # fp32 on CPU: the embedded model's dequantized weights are exact only in fp32.
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @property
    def torch_kv_cache_dtype(self) -> torch.dtype:
        """The KV cache tensors' dtype: the model's for "auto"."""
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        on_gpu = self.torch_device.type == "cuda"
        return GPU_DEFAULT_BATCHED_TOKENS if on_gpu else CPU_DEFAULT_BATCHED_TOKENS
