"""The engine's configuration: the declared settings (common/engine_args.py) resolved for this machine."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from pagedserve.common.engine_args import GIB, EngineArgs, json_object
from pagedserve.server.kv_transfer_config import KVTransferConfig
from pagedserve.server.lora_request import LoRAModulePath
from pagedserve.server.multimodal import parse_mm_limits
from pagedserve.server.pooling_params import POOLER_CONFIG_KEYS
from pagedserve.server.speculative_config import SpeculativeConfig

CPU_DEFAULT_KV_BYTES = 1 << 30  # 1 GiB: ~23k tokens of the embedded model in fp32
CPU_DEFAULT_BATCHED_TOKENS = 2048
GPU_DEFAULT_BATCHED_TOKENS = 8192
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# The torch type of each of common/engine_args.py's KV_CACHE_DTYPES: None is the model's dtype.
KV_CACHE_TORCH_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass
class EngineConfig(EngineArgs):
    """The settings (common/engine_args.py ``EngineArgs``, whose fields and torch-free checks it takes
    as they are) resolved against torch, the machine and the model's files. The engine writes back
    what it resolves at start (``max_model_len``, ``served_model_name``, ``attention_backend``)."""

    # Why the weights run in ``quantization`` (set by __post_init__; /version reports it).
    quantization_reason: str = field(default="", init=False)
    # Every name of --served-model-name (served_model_name keeps the first, the one reported).
    served_model_names: list[str] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self._offloading_from_transfer_config()
        super().__post_init__()
        if isinstance(self.served_model_name, (list, tuple)):
            self.served_model_names = list(self.served_model_name) or None
            self.served_model_name = self.served_model_names[0] if self.served_model_names else None
        if self.kv_offloading_size is not None:
            self.kv_offloading_backend = "native"
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.kv_transfer_config = KVTransferConfig.parse(self.kv_transfer_config)
        self.pooler_config = json_object("pooler_config", self.pooler_config, POOLER_CONFIG_KEYS)
        self.limit_mm_per_prompt = parse_mm_limits(self.limit_mm_per_prompt)
        self._parse_lora_modules()
        self._check_draft_model()
        if self.quantization is None:
            self.quantization, self.quantization_reason = self.checkpoint_quantization()
        else:
            self.quantization_reason = "asked for (quantization / --quantization)"
        if self.generation_config not in ("auto", "vllm") and not (
            Path(self.generation_config).expanduser() / "generation_config.json"
        ).is_file():
            raise ValueError(
                "generation_config must be 'auto', 'vllm' or a folder holding generation_config.json, "
                f"got {self.generation_config!r}"
            )
        self._check_parallel()

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
        if self.world_size != 1:
            return None, "float weights: GGUF blocks are not split across ranks"
        if self.device not in ("auto", "cpu") or self.torch_device.type != "cpu":
            return None, "float weights: on a GPU the bfloat16 GEMM is faster than the GGUF kernel"
        return "gguf", ("the GGUF file's own blocks: on a CPU the fastest mode at equal quality, "
                        "single-stream and batched (benchmarks/README.md)")

    @property
    def world_size(self) -> int:
        """The engine's ranks: tensor_parallel_size in each of pipeline_parallel_size stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_nodes(self) -> None:
        """--nnodes: the ranks split evenly over the machines, the leader's port set, each node its place."""
        nodes, rank = self.nnodes, self.node_rank
        if rank >= nodes:
            raise ValueError(f"node_rank {rank} must be below nnodes {nodes}")
        if self.headless != (rank > 0):
            raise ValueError("headless runs every node but the leader (node_rank 0), which serves the API")
        if nodes == 1:
            return
        if self.world_size % nodes:
            raise ValueError(f"nnodes {nodes} does not divide the {self.world_size} ranks "
                             "(tensor_parallel_size x pipeline_parallel_size)")
        if not self.master_port:
            raise ValueError("nnodes > 1 needs master_port: the leader's port every node joins")

    def _check_parallel(self) -> None:
        """What does not run split across ranks yet is refused here, never run wrong."""
        self._check_nodes()
        if self.world_size == 1:
            return
        split = (f"tensor_parallel_size {self.tensor_parallel_size}" if self.pipeline_parallel_size == 1
                 else f"pipeline_parallel_size {self.pipeline_parallel_size}")
        refused = {
            "enable_lora (LoRA adapters)": self.enable_lora,
            f"quantization {self.quantization!r}": self.quantization is not None,
            f"kv_cache_dtype {self.kv_cache_dtype!r}": self.kv_cache_dtype != "auto",
            # Every rank registers its cache on kv_ip: one address, so one machine.
            "kv_transfer_config (prefill/decode disaggregation) across nodes":
                self.kv_transfer_config is not None and self.nnodes > 1,
            f"device {self.device!r} (rank r runs on cuda:r: use 'cuda' or 'auto')":
                self.device.startswith("cuda:"),
        }
        for name, requested in refused.items():
            if requested:
                raise ValueError(f"{split} does not support {name} yet")
        local_ranks = self.world_size // self.nnodes
        if self.torch_device.type == "cuda" and local_ranks > torch.cuda.device_count():
            raise ValueError(f"{split} needs {local_ranks} GPUs on each of {self.nnodes} nodes, "
                             f"{torch.cuda.device_count()} are visible")

    def _offloading_from_transfer_config(self) -> None:
        """vLLM's OffloadingConnector spelling of the CPU KV tier becomes ``kv_offloading_size`` before the
        settings are checked together, so the tier has one setting (server/kv_transfer_config.py)."""
        transfer = KVTransferConfig.parse(self.kv_transfer_config)
        if transfer is None or not transfer.offloads:
            return
        if self.kv_offloading_size is not None:
            raise ValueError("the CPU KV tier is asked for twice: kv_offloading_size and an "
                             "OffloadingConnector kv_transfer_config; give one")
        self.kv_offloading_size = transfer.kv_connector_extra_config["cpu_bytes_to_use"] / GIB
        self.kv_transfer_config = None

    def _check_draft_model(self) -> None:
        """A draft model's cache follows the target's blocks on one rank and in the device pool only."""
        spec = self.speculative_config
        if not isinstance(spec, SpeculativeConfig) or not spec.uses_draft_model:
            return
        if self.world_size > 1:
            raise ValueError("speculative_config: a draft model is not supported with tensor or pipeline "
                             "parallelism")
        if self.kv_offload_bytes:
            # The host tier copies the target's layers only: a loaded block would lack the draft's K/V.
            raise ValueError("speculative_config: a draft model is not supported with kv_offloading_size")
        if self.kv_transfer_config is not None:
            # A read prompt's blocks would hold the target's K/V only, not the drafter's.
            raise ValueError("speculative_config: a draft model is not supported with kv_transfer_config")

    @property
    def kv_offload_bytes(self) -> int:
        """The host tier's budget in bytes (0: off)."""
        return round(self.kv_offloading_size * GIB) if self.kv_offloading_size is not None else 0

    def _parse_lora_modules(self) -> None:
        modules = [LoRAModulePath.parse(m) for m in self.lora_modules or []]
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
        return KV_CACHE_TORCH_DTYPES[self.kv_cache_dtype] or self.torch_dtype

    @property
    def batched_tokens(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        on_gpu = self.torch_device.type == "cuda"
        return GPU_DEFAULT_BATCHED_TOKENS if on_gpu else CPU_DEFAULT_BATCHED_TOKENS
