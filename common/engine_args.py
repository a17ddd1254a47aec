"""The engine's settings, declared once: ``EngineArgs``, torch-free.

Each field carries its default, help, choices and bounds (``arg``); everything else is derived from it,
as vLLM derives its CLI from its ``EngineArgs``:

* the ``pagedserve serve`` flags (``add_cli_arguments``, ``from_cli``; server/api/cli.py);
* the offline ``LLM(...)`` keyword arguments (``keyword_parameters``; server/entrypoints/llm.py);
* the engine's ``EngineConfig``, a subclass that adds what needs torch or the model's files
  (server/config.py);
* ``/version``'s ``engine_args`` (``as_dict``; server/api/app.py);
* the ModelDeployment's ``spec.engine`` fields, and so the CRD, for the fields marked ``operator=True``
  (operator/spec.py), and the engine flags the operator renders (``to_cli``; operator/resources.py).

A new engine setting is one ``arg(...)`` line here; tests/test_engine_args.py fails when any of those
drifts from this declaration.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import operator
import re
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

GIB = 1 << 30
BLOCK_SIZES = (8, 16, 32)
DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16")
# Other spellings vLLM accepts for --dtype, normalised to DTYPE_CHOICES.
DTYPE_ALIASES = {
    "fp32": "float32", "float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16",
}  # fmt: skip
# Weight quantization, each a method of server/layers/quantization/. "gguf": the checkpoint's own GGUF
# blocks (a .gguf model, or the embedded one); server/loader/gguf.py reads them in place of float tensors.
QUANTIZATION_METHODS = ("int8", "fp8", "gguf")
# vLLM's --kv-cache-dtype values that exist here: "auto" is the model's dtype, "fp8" means fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# vLLM's --kv-offloading-backend values that exist here: "native", the CPU tier of server/core/host_tier.py.
KV_OFFLOADING_BACKENDS = ("native",)
# The kernel backends of server/backend.py.
ATTENTION_BACKENDS = ("triton", "cpu", "torch")
# vLLM's --runner values that exist here: generate samples tokens; pooling returns one vector per prompt
# (server/worker/pooler.py); auto picks by the checkpoint (server/loader/pooler_config.py resolve_runner).
RUNNERS = ("auto", "generate", "pooling")
# vLLM's older --task values and the runner each means
TASK_RUNNERS = {"auto": "auto", "generate": "generate", "embed": "pooling", "embedding": "pooling"}

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


def human_bytes(value: str) -> int:
    """`1073741824`, `1G`, `1GiB`, `512M`: decimal units for K/M/G/T, binary with an `i`."""
    match = _SIZE.match(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a byte size: {value!r}")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " kmgt".index(unit.lower() or " "))


def bytes_as_gib(value: str) -> float:
    return human_bytes(value) / GIB


def json_object(name: str, value: Any, keys: Collection[str]) -> dict[str, Any] | None:
    """A setting given as a JSON object: its text (as its flag gives it) or a dict (as ``LLM(...)`` takes
    it), checked to be an object of ``keys`` only; None stays None."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is not valid JSON: {exc}") from exc
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    if unknown := set(value) - set(keys):
        raise ValueError(f"{name} takes {', '.join(keys)}, not {', '.join(sorted(unknown))}")
    return value


def task_runner(value: str) -> str:
    """vLLM's older ``--task`` as the ``--runner`` it means."""
    if value not in TASK_RUNNERS:
        raise argparse.ArgumentTypeError(f"--task must be one of {', '.join(TASK_RUNNERS)}, got {value!r}")
    return TASK_RUNNERS[value]


@dataclass(frozen=True)
class OtherSpelling:
    """A second flag for the same setting in another unit (e.g. bytes for a size declared in GiB)."""

    flag: str
    parse: Callable[[str], Any]
    metavar: str
    help: str


@dataclass(frozen=True)
class Arg:
    """How one setting is written: on the command line, in the CRD, and what values it takes."""

    help: str
    short: tuple[str, ...] = ()  # more flag names: "-q", "-tp"
    metavar: str | None = None
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    parse: Callable[[str], Any] | None = None  # the flag's text -> value, where the type alone says not how
    positional: bool = False  # also taken as `pagedserve serve`'s positional argument
    operator: bool = False  # a field of the ModelDeployment's spec.engine
    other_spelling: OtherSpelling | None = None


def arg(default: Any = None, help: str = "", **how: Any) -> Any:
    return field(default=default, metadata={"arg": Arg(help=help, **how)})


@dataclass
class EngineArgs:
    model: str | None = arg(
        help="HF folder, hub id or .gguf file (default: the embedded SmolLM2-135M-Instruct)", positional=True
    )
    tokenizer: str | None = arg(help="tokenizer folder (default: the model's)")
    runner: str = arg(
        "auto", "generate (sample tokens) or pooling (one vector per prompt: /v1/embeddings, /pooling, "
        "/score, /rerank); auto: pooling for a base-model architecture (e.g. Qwen3Model) or a "
        "sentence-transformers folder (modules.json), else generate",
        choices=RUNNERS, operator=True,
        other_spelling=OtherSpelling("--task", task_runner, "TASK",
                                     "vLLM's older spelling: embed (--runner pooling) or generate"),
    )  # fmt: skip
    load_format: str = arg(
        "auto", "auto: the checkpoint's weights; dummy: random weights of the config's shape, for "
        "benchmarks of a shape with no weights at hand (vLLM's flag)",
        choices=("auto", "dummy"),
    )  # fmt: skip
    limit_mm_per_prompt: Any = arg(
        help='the most images one prompt may carry, vLLM\'s JSON: {"image": 2} (default: as many as fit '
        "max_model_len)",
        metavar="JSON", parse=str,
    )  # fmt: skip
    pooler_config: Any = arg(
        help='how the pooling runner makes its vector, over the checkpoint\'s sentence-transformers config: '
        'JSON {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": true | false} (vLLM\'s flag)',
        metavar="JSON", parse=str,
    )  # fmt: skip
    served_model_name: str | list[str] | None = arg(
        help="name(s) the API accepts; the first is reported (default: the model)"
    )
    dtype: str = arg(
        "auto", "the weights' and activations' type: auto (bfloat16 on a GPU, float32 on a CPU), "
        "float32, float16, bfloat16 (or vLLM's other spellings: half, fp16, bf16, float, fp32)",
        choices=(*DTYPE_CHOICES, *DTYPE_ALIASES), operator=True,
    )  # fmt: skip
    device: str = arg("auto", "auto, cpu, cuda or cuda:N")
    block_size: int = arg(16, "tokens per KV cache block", choices=BLOCK_SIZES, operator=True)
    max_num_seqs: int = arg(256, "sequences in one step at most", ge=1, operator=True)
    max_num_batched_tokens: int | None = arg(
        help="tokens in one step at most (default: 2048 on a CPU, 8192 on a GPU)", ge=1, operator=True
    )
    max_model_len: int | None = arg(
        help="prompt and output tokens of one request at most (default: the model's)", ge=2, operator=True
    )
    enable_prefix_caching: bool = arg(
        True, "reuse the KV blocks of prompts' shared prefixes (by block hash)", operator=True
    )
    seed: int = arg(0, "the random seed of sampling without a request seed", operator=True)
    kv_cache_memory_bytes: int | None = arg(
        help="KV cache budget in bytes (e.g. 2G, 512MiB)", metavar="BYTES", parse=human_bytes, gt=0
    )
    # vLLM's CPU KV offloading, all ranks together (server/core/offloading_connector.py); --kv-offload-bytes
    # in bytes.
    kv_offloading_size: float | None = arg(
        help="a CPU (host memory) KV tier of this many GiB behind the device pool: blocks evicted from the "
        "device go there, and prefix hits there are copied back instead of recomputed (vLLM's flag)",
        metavar="GIB", gt=0, operator=True,
        other_spelling=OtherSpelling(
            "--kv-offload-bytes", bytes_as_gib, "BYTES", "the same tier's size in bytes (e.g. 8G, 512MiB)"
        ),
    )  # fmt: skip
    kv_offloading_backend: str | None = arg(
        help="the tier's backend (vLLM's flag): native, the only one here and the default",
        choices=KV_OFFLOADING_BACKENDS,
    )
    num_gpu_blocks_override: int | None = arg(help="KV cache blocks, whatever the memory says", ge=1)
    gpu_memory_utilization: float = arg(
        0.9, "the share of the GPU's memory the engine may fill, KV cache included", gt=0, le=1, operator=True
    )
    enforce_eager: bool = arg(False, "no CUDA graphs", operator=True)
    # Where it leaves outputs unchanged (server/core/scheduler.py schedule_ahead); None: on a GPU only.
    async_scheduling: bool | None = arg(
        help="launch each decode step before the previous one's tokens are read back, hiding the host's "
        "work behind the device's (default: on a GPU); outputs are unchanged",
        operator=True,
    )
    # server/loader/generation_config.py reads it.
    generation_config: str = arg(
        "auto", "request defaults from generation_config.json: auto (the model's), vllm (none) or a folder"
    )
    attention_backend: str | None = arg(
        help="the kernels: triton, cpu (C++) or torch (default: $PAGEDSERVE_ATTENTION_BACKEND, else "
        "triton on a GPU and cpu on a CPU; server/backend.py)",
        choices=ATTENTION_BACKENDS,
    )
    # vLLM configures a ZMQ publisher with --kv-events-config; here it is one stream on the engine's own
    # port (server/core/kv_events.py), so a switch is all there is to say.
    enable_kv_events: bool = arg(
        False, "publish KV cache events (blocks stored, removed, cleared) on GET /v1/kv_events, for "
        "`pagedserve router --strategy kv-events`",
    )  # fmt: skip
    # fp8 halves a 16-bit cache's bytes per token, with per-layer scales (server/layers/attention.py).
    kv_cache_dtype: str = arg(
        "auto", "the KV cache's element type: auto (the model's dtype), fp8 or fp8_e4m3 (the same)",
        choices=KV_CACHE_DTYPES, operator=True,
    )  # fmt: skip
    calculate_kv_scales: bool = arg(False, "fp8 KV cache scales from the first prefill", operator=True)
    speculative_config: Any = arg(
        help='speculative decoding, vLLM\'s keys: e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (server/speculative_config.py)',
        metavar="JSON", parse=str,
    )  # fmt: skip
    # Prefill/decode disaggregation, or the CPU KV tier's other spelling (server/kv_transfer_config.py parses
    # and checks it; server/config.py turns the tier's into kv_offloading_size).
    kv_transfer_config: Any = arg(
        help='the KV connector of prefill/decode disaggregation, vLLM\'s keys: e.g. \'{"kv_connector": '
        '"MooncakeConnector", "kv_role": "kv_both", "kv_ip": "10.0.0.5", "kv_port": 14579}\' '
        '(server/kv_transfer_config.py); requests then carry kv_transfer_params (`pagedserve router '
        '--strategy pd`). vLLM\'s "OffloadingConnector" with kv_connector_extra_config.cpu_bytes_to_use is '
        'the CPU KV tier, as --kv-offloading-size',
        metavar="JSON", parse=str,
    )  # fmt: skip
    # Each a method of server/layers/quantization/; None: the checkpoint's own format, resolved by
    # server/config.py checkpoint_quantization.
    quantization: str | None = arg(
        help="weight format: int8 (weight-only, per output channel, quantized at load), fp8 (e4m3 weights "
        "per output channel and activations per token, FP8 tensor cores on a Hopper GPU) or gguf (a .gguf "
        "model's own Q8_0/Q4_0/Q4_1 blocks); default: gguf for a .gguf model, the embedded one included, on "
        "one CPU rank, else none (the weights' own float dtype)",
        short=("-q",), choices=QUANTIZATION_METHODS, operator=True,
    )  # fmt: skip
    # Megatron's split (server/distributed/); what does not run split yet is refused in server/config.py.
    tensor_parallel_size: int = arg(
        1, "split the model across N ranks, one process each (gloo on the CPU, NCCL on GPUs 0..N-1); "
        "N must divide the query heads, and divide or be divided by the KV heads",
        short=("-tp",), metavar="N", ge=1,
    )  # fmt: skip
    # The layers cut into stages, one process each (server/distributed/parallel_state.py PipelineStage);
    # with tensor parallelism, every stage is split across tensor_parallel_size ranks.
    pipeline_parallel_size: int = arg(
        1, "cut the model's layers into N stages, one rank (or tensor_parallel_size ranks) each, run in "
        "turn within a step: for a model larger than one rank's memory",
        short=("-pp",), metavar="N", ge=1,
    )  # fmt: skip
    # One engine across machines (server/executor/tp_driver.py, server/executor/headless.py): vLLM's flags.
    nnodes: int = arg(
        1, "machines the ranks (tensor x pipeline) are spread over, the same number on each; node 0 runs "
        "the API and rank 0, the others run `serve --headless`",
        metavar="N", ge=1,
    )  # fmt: skip
    node_rank: int = arg(0, "this machine's place among --nnodes (0: the leader)", metavar="R", ge=0)
    master_addr: str = arg(
        "127.0.0.1", "the leader's address, where every rank joins the group (port --master-port) and each "
        "other node keeps a link whose loss ends the engine (port --master-port + 1)", metavar="HOST",
    )  # fmt: skip
    master_port: int = arg(
        0, "the leader's port for the ranks' group; 0: any free port (one node only)", metavar="PORT",
        ge=0, le=65534,
    )  # fmt: skip
    headless: bool = arg(
        False, "run this node's ranks only, no API (every --node-rank but 0)",
    )  # fmt: skip
    # Many adapters on the base model (server/lora/).
    enable_lora: bool = arg(
        False, "serve LoRA adapters (PEFT folders or HF ids) on the base model: a request's model names one; "
        "with VLLM_ALLOW_RUNTIME_LORA_UPDATING=true, POST /v1/load_lora_adapter {lora_name, lora_path} "
        "and /v1/unload_lora_adapter {lora_name} change them at run time",
    )  # fmt: skip
    max_loras: int = arg(
        1, "distinct adapters in one batch (resident on the accelerator); more are served in turn",
        ge=1, operator=True,
    )  # fmt: skip
    max_lora_rank: int = arg(16, "the highest adapter rank served", ge=1, le=512, operator=True)
    max_cpu_loras: int | None = arg(
        help="adapters kept in CPU memory (default: max_loras)", ge=1, operator=True
    )
    lora_modules: list[Any] | None = arg(
        help='adapters loaded at start: name=path, or JSON {"name": ..., "path": ..., "base_model_name"}',
        metavar="NAME=PATH", parse=str,
    )

    def __post_init__(self) -> None:
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if isinstance(self.quantization, str):
            self.quantization = self.quantization.lower()
        for declared, how in settings(type(self)):
            name = declared.name
            check_value(name, getattr(self, name), how, value_type(type(self), name))
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self._check_together()

    def _check_together(self) -> None:
        """Settings that need one another."""
        if self.enable_kv_events and not self.enable_prefix_caching:
            raise ValueError("enable_kv_events needs enable_prefix_caching: without it no block is cached")
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError("calculate_kv_scales needs an fp8 kv_cache_dtype (the scales of an "
                             f"{self.kv_cache_dtype!r} cache do nothing)")
        if self.kv_offloading_size is None and self.kv_offloading_backend is not None:
            raise ValueError("kv_offloading_backend needs kv_offloading_size (GiB of host memory)")
        if self.kv_offloading_size is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offloading_size needs enable_prefix_caching: the tier keeps cached blocks")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        if self.pooler_config is not None and self.runner == "generate":
            raise ValueError("pooler_config needs the pooling runner (runner 'pooling' or 'auto')")


def settings(cls: type = EngineArgs) -> Iterator[tuple[dataclasses.Field, Arg]]:
    """The declared settings of ``cls`` (EngineArgs or a subclass), in declaration order."""
    for declared in dataclasses.fields(cls):
        arg_of = declared.metadata.get("arg")
        if arg_of is not None:
            yield declared, arg_of


def check_value(name: str, value: Any, how: Arg, kind: Any) -> None:
    """The declared type (for numbers), choices and bounds; None is "unset" and always allowed."""
    if value is None:
        return
    if how.choices is not None and value not in how.choices:
        raise ValueError(f"{name} must be one of {', '.join(map(str, how.choices))}, got {value!r}")
    if kind not in (int, float):
        return
    number = (int,) if kind is int else (int, float)
    noun = "an integer " if kind is int else "a number "
    if isinstance(value, bool) or not isinstance(value, number):
        raise ValueError(f"{name} must be {noun.strip()}, got {value!r}")
    for bound, word, holds in ((how.ge, ">=", operator.ge), (how.gt, ">", operator.gt),
                               (how.le, "<=", operator.le)):  # fmt: skip
        if bound is not None and not holds(value, bound):
            raise ValueError(f"{name} must be {noun}{word} {bound:g}, got {value!r}")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, evaluated once (their annotations are text: ``from __future__``)."""
    return typing.get_type_hints(cls)


def value_type(cls: type, name: str) -> Any:
    """The field's type without ``None``: ``int | None`` -> int; ``list[str] | None`` -> list[str]."""
    hint = type_hints(cls)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        members = [m for m in typing.get_args(hint) if m is not type(None)]
        return members[0] if len(members) == 1 else hint
    return hint


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _takes_many(cls: type, name: str) -> bool:
    hint = type_hints(cls)[name]
    members = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    return any(typing.get_origin(m) is list for m in members)


def _parser_of(cls: type, name: str, how: Arg) -> Callable[[str], Any]:
    if how.parse is not None:
        return how.parse
    kind = value_type(cls, name)
    return kind if kind in (int, float, str) else str


def _positional_dest(name: str) -> str:
    return f"{name}_positional"


def _other_dest(name: str) -> str:
    return f"{name}_other_spelling"


def add_cli_arguments(parser: argparse.ArgumentParser | Any, cls: type = EngineArgs) -> None:
    """One flag per setting (vLLM's names: the field's, dashed), into ``parser`` (or an argument group)."""
    for declared, how in settings(cls):
        name, default = declared.name, declared.default
        if how.positional:
            parser.add_argument(_positional_dest(name), nargs="?", default=None,
                                metavar=name.upper(), help=how.help)  # fmt: skip
        names = (flag(name), *how.short)
        if value_type(cls, name) is bool:
            action = "store_true" if default is False else argparse.BooleanOptionalAction
            parser.add_argument(*names, dest=name, action=action, default=default, help=how.help)
            continue
        target = parser if how.other_spelling is None else parser.add_mutually_exclusive_group()
        target.add_argument(
            *names,
            dest=name,
            type=_parser_of(cls, name, how),
            default=default,
            choices=how.choices,
            nargs="+" if _takes_many(cls, name) else None,
            metavar=how.metavar,
            help=how.help if not how.positional else f"same as {name.upper()}",
        )
        if how.other_spelling is not None:
            other = how.other_spelling
            target.add_argument(other.flag, dest=_other_dest(name), type=other.parse, default=None,
                                metavar=other.metavar, help=other.help)  # fmt: skip


def from_cli(namespace: argparse.Namespace, cls: type = EngineArgs) -> dict[str, Any]:
    """The keyword arguments of ``cls`` that parsed ``namespace`` (of ``add_cli_arguments``) holds."""
    values: dict[str, Any] = {}
    for declared, how in settings(cls):
        name = declared.name
        value = getattr(namespace, name)
        if how.positional and getattr(namespace, _positional_dest(name)) is not None:
            value = getattr(namespace, _positional_dest(name))
        if how.other_spelling is not None and getattr(namespace, _other_dest(name)) is not None:
            value = getattr(namespace, _other_dest(name))
        values[name] = value
    return values


def to_cli(values: Mapping[str, Any], cls: type = EngineArgs) -> list[str]:
    """The `pagedserve serve` arguments that set ``values`` (settings by name); defaults are left out, so
    the engine's own defaults apply. ``from_cli`` of their parse gives ``values`` back."""
    out: list[str] = []
    declared_names = {declared.name for declared, _ in settings(cls)}
    unknown = set(values) - declared_names
    if unknown:
        raise ValueError(f"not engine settings: {', '.join(sorted(unknown))}")
    for declared, how in settings(cls):
        name = declared.name
        if name not in values or values[name] == declared.default:
            continue
        value = values[name]
        if how.positional:
            out.insert(0, str(value))
        elif isinstance(value, bool):
            out.append(flag(name) if value else "--no-" + flag(name)[2:])
        elif isinstance(value, (list, tuple)):
            out += [flag(name), *map(str, value)]
        else:
            out += [flag(name), str(value)]
    return out


def as_dict(config: Any, cls: type = EngineArgs) -> dict[str, Any]:
    """The settings ``config`` (EngineArgs, EngineConfig, or any object with their names) holds, as JSON
    values: what /version reports."""
    values = {}
    for declared, _ in settings(cls):
        value = getattr(config, declared.name, declared.default)
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, list):
            value = [dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for v in value]
        values[declared.name] = value
    return values


def keyword_parameters(cls: type = EngineArgs, skip: tuple[str, ...] = ()) -> list[Any]:
    """``inspect.Parameter``s, keyword-only, for each setting of ``cls`` but ``skip``: for the signature of
    a function that takes them as ``**engine_args`` (``LLM``)."""
    import inspect

    hints = type_hints(cls)
    return [
        inspect.Parameter(declared.name, inspect.Parameter.KEYWORD_ONLY, default=declared.default,
                          annotation=hints[declared.name])
        for declared, _ in settings(cls)
        if declared.name not in skip
    ]
