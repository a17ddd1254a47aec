"""Every engine setting is declared once (common/engine_args.py ``EngineArgs``): the `pagedserve serve`
flags, ``LLM``'s signature, the CRD's spec.engine and the operator's rendered engine arguments all come
from that declaration, and a setting added there shows up in all four."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from pagedserve.common.engine_args import (
    GIB,
    Arg,
    EngineArgs,
    add_cli_arguments,
    arg,
    from_cli,
    keyword_parameters,
    settings,
    to_cli,
    value_type,
)
from pagedserve.operator.crd import structural
from pagedserve.operator.resources import render
from pagedserve.operator.spec import engine_model
from pydantic import ValidationError
from pydantic.alias_generators import to_camel

from pagedserve.cli import build_parser

REPO = Path(__file__).resolve().parents[1]


def serve_parser() -> argparse.ArgumentParser:
    """The real `pagedserve serve` parser."""
    subcommands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subcommands.choices["serve"]


def other_value(cls: type, declared: dataclasses.Field, how: Arg) -> Any:
    """A value of the setting other than its default, within its choices and bounds."""
    kind, default = value_type(cls, declared.name), declared.default
    if how.choices:
        return next(choice for choice in how.choices if choice != default)
    if kind is bool:
        return not default
    if kind is int:
        return max(default or 0, how.ge or 0, how.gt or 0) + 3
    if kind is float:
        return 0.5 if how.le is not None else (default or 0) + 1.5
    if "list[" in str(typing.get_type_hints(cls)[declared.name]):
        return ["one=/a", "two=/b"]
    return f"text-of-{declared.name}"


def test_every_setting_is_a_serve_flag_and_comes_back_from_it() -> None:
    values = {d.name: other_value(EngineArgs, d, how) for d, how in settings()}
    parsed = from_cli(serve_parser().parse_args(to_cli(values)))
    assert parsed == values
    assert from_cli(serve_parser().parse_args([])) == {d.name: d.default for d, _ in settings()}


def test_other_spellings_and_the_positional_model() -> None:
    parser = serve_parser()
    assert from_cli(parser.parse_args(["--kv-offload-bytes", "512MiB"]))["kv_offloading_size"] == 0.5
    assert from_cli(parser.parse_args(["some/model"]))["model"] == "some/model"
    assert from_cli(parser.parse_args(["--model", "some/model"]))["model"] == "some/model"
    assert from_cli(parser.parse_args(["-tp", "2", "-q", "int8"]))["tensor_parallel_size"] == 2
    with pytest.raises(SystemExit):  # one tier size, not two
        parser.parse_args(["--kv-offloading-size", "1", "--kv-offload-bytes", "1G"])


def test_llm_takes_every_setting_by_name() -> None:
    from pagedserve.server.entrypoints.llm import LLM

    parameters = inspect.signature(LLM).parameters
    assert list(parameters)[:2] == ["model", "core_process"]
    declared = {d.name: d.default for d, _ in settings()}
    assert {name: p.default for name, p in parameters.items() if name != "core_process"} == declared


def test_the_crd_engine_fields_are_the_operator_settings() -> None:
    crd = yaml.safe_load((REPO / "crds/modeldeployment.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    engine = spec["properties"]["engine"]["properties"]
    operator_settings = {d.name: (d, how) for d, how in settings() if how.operator}
    assert set(engine) == {to_camel(n) for n in operator_settings} | {"startupTimeoutSeconds", "extraArgs"}
    for name, (declared, how) in operator_settings.items():
        field = engine[to_camel(name)]
        assert field.get("default") == declared.default, name
        assert field.get("enum") == (list(how.choices) if how.choices else None), name
        assert field.get("maximum") == how.le, name
        assert field["description"].startswith("--" + name.replace("_", "-") + ": "), name


def operator_spec_values() -> dict[str, Any]:
    """A non-default value for every operator setting, consistent with one another."""
    values = {d.name: other_value(EngineArgs, d, how) for d, how in settings() if how.operator}
    values["enable_prefix_caching"] = True  # the host tier (kv_offloading_size) keeps cached blocks
    values["max_num_batched_tokens"] = 4096  # at least max_num_seqs
    return values


def test_the_operator_renders_spec_engine_into_serve_flags() -> None:
    values = operator_spec_values()
    spec = {"model": "org/model", "engine": {to_camel(name): value for name, value in values.items()}}
    manifest = {
        "apiVersion": "pagedserve.io/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "m", "namespace": "ns", "uid": "u", "generation": 1},
        "spec": spec,
    }
    deployment = next(c for c in render(manifest) if c["metadata"]["name"] == "m-engine")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    parsed = from_cli(serve_parser().parse_args(args))
    assert {name: parsed[name] for name in values} == values
    assert parsed["model"] == "org/model" and parsed["device"] == "cuda"


def test_spec_engine_is_refused_as_the_engine_would_refuse_it() -> None:
    manifest_spec = {"model": "m", "engine": {"calculateKvScales": True}}
    with pytest.raises(ValidationError, match="calculate_kv_scales needs an fp8 kv_cache_dtype"):
        render({"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": manifest_spec})
    with pytest.raises(ValueError, match="calculate_kv_scales needs an fp8 kv_cache_dtype"):
        EngineArgs(calculate_kv_scales=True)


def test_the_declared_checks() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be an integer >= 1, got 0"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_seqs must be an integer, got '4'"):
        EngineArgs(max_num_seqs="4")
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number <= 1, got 1\.5"):
        EngineArgs(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32, got 12"):
        EngineArgs(block_size=12)
    assert EngineArgs(dtype="half", quantization="INT8").dtype == "float16"
    assert EngineArgs(kv_offloading_size=2).kv_offloading_size * GIB == 2 * GIB


@dataclasses.dataclass
class WithADummy(EngineArgs):
    dummy_knob: int = arg(3, "a setting that exists only in this test", ge=1, operator=True)


def test_a_new_setting_shows_up_in_all_four() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser, WithADummy)
    assert from_cli(parser.parse_args(["--dummy-knob", "5"]), WithADummy)["dummy_knob"] == 5
    assert "dummy_knob" in {p.name for p in keyword_parameters(WithADummy)}
    engine = engine_model(WithADummy)
    schema = engine.model_json_schema()
    field = structural(schema, schema.get("$defs", {}))["properties"]["dummyKnob"]
    assert (field["type"], field["minimum"], field["default"]) == ("integer", 1, 3)
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        engine.model_validate({"dummyKnob": 0})
    rendered = to_cli(engine.model_validate({"dummyKnob": 5}).engine_settings(), WithADummy)
    assert rendered == ["--dummy-knob", "5"]
    with pytest.raises(ValueError, match="dummy_knob must be an integer >= 1"):
        WithADummy(dummy_knob=0)
