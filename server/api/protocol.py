"""Pydantic schemas of the OpenAI-compatible API: OpenAI's fields plus vLLM's sampling extras.

Requests are validated here (a failure becomes a 400 in OpenAI's error shape); responses are declared here
so that /openapi.json describes what the server sends.

A request is taken as OpenAI takes it, and /openapi.json says exactly that (``RequestModel``):

- **Strict types.** ``"max_tokens": "2"`` or ``true`` where a number belongs is a 400, as at OpenAI; an
  integer is fine where a float belongs.
- **No unknown fields** (``additionalProperties: false``). OpenAI answers an unknown field with a 400
  ("Unrecognized request argument supplied"); vLLM ignores it with a warning. We answer as OpenAI does: a
  field ignored in silence (a typo, or a vLLM feature this server lacks, such as ``guided_json``) gives a
  200 that does not do what the client asked. The vLLM fields we lack get a 400 that says why
  (``UNSUPPORTED_FIELDS``). Messages are the exception: clients send back the assistant messages they
  were given, with whatever fields those had, so a message may carry fields the template does not read.
- **Null is unset.** ``null`` for any optional field is taken as not given, as OpenAI takes it: the field's
  default applies (``RequestModel._null_is_unset``), and /openapi.json lets every optional field be null.
  A field whose type takes null keeps vLLM's meaning of it (``max_tokens: null``: the model's default).
- **Valid Unicode.** A lone surrogate (JSON ``"\\ud83d"``) anywhere in the text is a 400 naming its
  field: no tokenizer or encoder downstream can take it.
"""

from __future__ import annotations

import functools
import json
import time
import typing
from typing import Annotated, Any, ClassVar, Literal

import jsonschema
from pagedserve.server.exceptions import InvalidRequestError
from pagedserve.server.sampling_params import (
    MAX_LOGPROBS,  # one bound for the API and the engine
    StructuredOutputsParams,
)
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

# torch.iinfo(torch.long): a seed must fit a 64-bit generator seed. Written out to keep torch out of here.
_LONG_MIN = -(2**63)
_LONG_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
# vLLM's name for llguidance, the grammar engine (server/structured_output/): the one
# guided_decoding_backend accepted.
GRAMMAR_BACKEND = "guidance"


# vLLM request fields this server does not implement, and why: each one is a 400 that names it.
UNSUPPORTED_FIELDS = {
    "structural_tag": "send it as structured_outputs.structural_tag",
    "length_penalty": "it applies to beam search, which is not implemented",
    "prompt_embeds": "prompts are text or token ids",
    "mm_processor_kwargs": "images are processed with the model's own image processor settings",
    "media_io_kwargs": "images are loaded with the server's settings (--allowed-media-domains...)",
    "logits_processors": "custom logits processors are not supported",
    "return_tokens_as_token_ids": "not implemented",
    "return_token_ids": "not implemented",
    "request_id": "the server names each request itself (the X-Request-Id header of the response)",
    "vllm_xargs": "extension arguments are not supported",
    # OpenAI's own fields for features this server lacks: named, not "unrecognized".
    "functions": "deprecated by OpenAI: send tools",
    "function_call": "deprecated by OpenAI: send tool_choice",
    "modalities": "only text output is supported",
    "audio": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "verbosity": "the model's verbosity cannot be set (OpenAI's GPT-5 models take it)",
    "moderation": "no moderation model runs here",
}


@functools.cache
def _nullable_names(model: type[BaseModel]) -> frozenset[str]:
    """The names whose ``null`` a request of ``model`` takes as unset: its optional fields whose type has
    no null of its own (and their aliases), and the refused fields of OpenAI and vLLM. Where a field takes
    null, null keeps the meaning it has there (``max_tokens: null``: the model's default, as in vLLM)."""
    optional = {
        name
        for field_name, info in model.model_fields.items()
        if not info.is_required() and not _type_takes_null(info.annotation)
        for name in (field_name, info.alias)
        if name
    }
    return frozenset(optional | set(getattr(model, "refused_fields", {})))


def _type_takes_null(annotation: Any) -> bool:
    return annotation is None or type(None) in typing.get_args(annotation)


def unknown_field_message(name: str, refused: dict[str, str] = UNSUPPORTED_FIELDS) -> str:
    """The 400 for a request field that is not in the schema (errors.py uses it); ``refused``: the fields
    its API defines that this server does not implement, with why."""
    reason = refused.get(name)
    if reason is not None:
        return f"{name} is not supported by this server: {reason}."
    return f"Unrecognized request argument supplied: {name}"


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text is not valid Unicode: a lone surrogate {text[exc.start]!r} at index {exc.start}"
        ) from None
    return text


def _valid_unicode_json(value: Any) -> Any:
    """Every string inside a JSON value (keys too) is valid Unicode."""
    if isinstance(value, str):
        _valid_unicode(value)
    elif isinstance(value, dict):
        for key, item in value.items():
            _valid_unicode_json(key)
            _valid_unicode_json(item)
    elif isinstance(value, list):
        for item in value:
            _valid_unicode_json(item)
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
JSONObject = Annotated[dict[str, Any], AfterValidator(_valid_unicode_json)]


class OpenAIBaseModel(BaseModel):
    # NaN or Infinity (which Python's json module accepts) would poison sampling: reject them.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


def _optional_fields_take_null(schema: dict[str, Any], model: type[BaseModel]) -> None:
    """/openapi.json says what ``RequestModel._null_is_unset`` takes: null for every optional field."""
    required = set(schema.get("required", []))
    for name, node in schema.get("properties", {}).items():
        if name in required or _takes_null(node):
            continue
        outer = {key: node.pop(key) for key in ("title", "description", "default") if key in node}
        schema["properties"][name] = {**outer, "anyOf": [node, {"type": "null"}]}


def _takes_null(node: dict[str, Any]) -> bool:
    return node.get("type") == "null" or any(_takes_null(choice) for choice in node.get("anyOf", []))


class RequestModel(OpenAIBaseModel):
    """A request body (see the module docstring): strict types, no unknown fields, null as unset."""

    model_config = ConfigDict(
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra=_optional_fields_take_null
    )
    # Its API's fields this server refuses by name, and why (their null is unset too).
    refused_fields: ClassVar[dict[str, str]] = UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """OpenAI takes ``null`` for any optional field as "not given": the field's default applies. So
        does a field OpenAI or vLLM defines that this server refuses (``UNSUPPORTED_FIELDS``): null asks
        for nothing. A required field's null still fails naming it, and an unknown name stays unknown."""
        if not isinstance(data, dict):
            return data
        unset = _nullable_names(cls)
        if not any(value is None and key in unset for key, value in data.items()):
            return data
        return {key: value for key, value in data.items() if value is not None or key not in unset}


# ---------------------------------------------------------------------------------------------- errors
class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- models
class ModelPermission(OpenAIBaseModel):
    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=list)


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


# ----------------------------------------------------------------------------------------------- usage
class PromptTokenUsageInfo(OpenAIBaseModel):
    cached_tokens: int | None = None


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int | None = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamOptions(RequestModel):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


# --------------------------------------------------------------------------------------------- sampling
class _SamplingFields(RequestModel):
    """Fields common to both generation endpoints: OpenAI's, then vLLM's extras. Their values are checked
    once, by the engine's SamplingParams and Processor (a 400 naming the field); the bounds here are
    the wire's (integers a kernel or a generator can hold)."""

    model: Text | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[Text, float] | None = None
    n: int = 1  # at most max_num_seqs (the Processor)
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: Text | None = None  # the caller's end-user id, for the caller's own logs: nothing to do here
    # vLLM extras
    best_of: int | None = Field(None, ge=1)
    use_beam_search: bool = False
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=1)
    priority: Literal[0] = Field(0, description="vLLM's; only 0: priority scheduling is not implemented")
    allowed_token_ids: list[int] | None = None
    bad_words: list[Text] | None = None
    prompt_logprobs: int | None = None
    cache_salt: Text | None = Field(None, min_length=1)  # only requests with the same salt share KV blocks
    # Prefill/decode disaggregation (vLLM's): the request's role in a P/D pair, checked by the engine
    # (server/kv_transfer_params.py); `pagedserve router --strategy pd` sets it
    kv_transfer_params: JSONObject | None = None


# --------------------------------------------------------------------------------- structured outputs
def _json_schema(value: str | dict[str, Any]) -> str | dict[str, Any]:
    """A JSON schema, as an object or as its JSON text: checked against its metaschema (the draft its
    ``$schema`` names, else 2020-12), so that "not a schema" is a 400 naming the field. Whether the
    grammar engine can compile it is the engine's check (server/engine/processor.py)."""
    schema = value
    if isinstance(value, str):
        try:
            schema = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema is an object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise ValueError(
            f"not a valid JSON schema: {exc.message}" + (f" (at /{where})" if where else "")
        ) from None
    return value


JSONSchema = Annotated[Text | JSONObject, AfterValidator(_json_schema)]


class JSONSchemaFormat(RequestModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    name: Text = Field(..., min_length=1)
    description: Text | None = None
    schema_: JSONSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON that matches a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's ``structured_outputs`` object (server/sampling_params.py ``StructuredOutputsParams``)."""

    json_: JSONSchema | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = None
    json_object: bool | None = None
    structural_tag: Text | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: Text | None = None


class _StructuredOutputFields(RequestModel):
    """The ways a request constrains its output, on both endpoints: OpenAI's ``response_format``, vLLM's
    ``structured_outputs`` and vLLM's older ``guided_*`` fields. ``structured_outputs_params`` maps
    them (and a chat request's forced tool calls) to the engine's one ``StructuredOutputsParams``."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JSONSchema | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    guided_whitespace_pattern: Text | None = None
    guided_decoding_backend: Text | None = Field(
        None,
        description=f"accepted and ignored if it names this server's grammar backend ({GRAMMAR_BACKEND})",
    )


class MultiModalData(RequestModel):
    """A completion prompt's images, by URL (data:, http(s), or a file under --allowed-local-media-path), in
    the order of the prompt's image placeholders: the offline LLM's ``multi_modal_data`` over HTTP."""

    image: Text | list[Text]


class CompletionRequest(_SamplingFields, _StructuredOutputFields):
    """POST /v1/completions (OpenAI's legacy completions)."""

    prompt: list[int] | list[list[int]] | Text | list[Text]
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = Field(16, ge=0, description="0 with echo: only the prompt (and its logprobs)")
    suffix: Text | None = None
    add_special_tokens: bool = True
    multi_modal_data: MultiModalData | None = Field(
        None, description="a vision-language model's images for a single text prompt, by URL"
    )

    @model_validator(mode="after")
    def _max_tokens_zero_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo, to score the prompt)")
        return self


class ImageURL(OpenAIBaseModel):
    """An ``image_url`` part's image: a data: URI or an http(s) URL (server/api/media.py)."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # see the module docstring

    url: Text
    detail: Literal["auto", "low", "high"] | None = Field(
        None, description="accepted and ignored: the model's image processor picks the resolution"
    )


class ChatMessageContentPart(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # see the module docstring

    type: Text
    text: Text | None = None
    image_url: ImageURL | None = None  # of a part of type "image_url"


class ChatCompletionMessageParam(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)  # see the module docstring

    role: Text
    content: Text | list[ChatMessageContentPart] | None = None
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[JSONObject] | None = None


class PromptCacheOptions(RequestModel):
    """OpenAI's ``prompt_cache_options``. Only its implicit mode: explicit breakpoints are not supported."""

    mode: Literal["implicit"] = "implicit"
    ttl: Literal["30m"] = "30m"


# -------------------------------------------------------------------------------------------- tools
class FunctionDefinition(RequestModel):
    name: Text = Field(..., min_length=1)
    description: Text | None = None
    parameters: JSONSchema | None = None  # a JSON schema of the arguments object; none: no arguments
    strict: bool | None = None  # accepted: arguments are always held to the schema when it is enforced


class ChatCompletionToolsParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: Text


class ChatCompletionNamedToolChoiceParam(RequestModel):
    """``tool_choice`` naming one function: the reply is a call of it."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatTemplateFields(RequestModel):
    """A conversation and how to render it with the chat template: /v1/chat/completions and /tokenize."""

    messages: list[ChatCompletionMessageParam] = Field(..., min_length=1)
    tools: list[ChatCompletionToolsParam] | None = None
    # vLLM extras
    documents: list[JSONObject] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: Text | None = Field(None, description="needs --trust-request-chat-template")
    chat_template_kwargs: JSONObject | None = None
    # OpenAI's effort values; the chat template reads it as ``reasoning_effort`` (gpt-oss's does), as vLLM
    # passes it: a template that does not read it ignores it, as such a model would.
    reasoning_effort: ReasoningEffort | None = None


class ChatCompletionRequest(_SamplingFields, _StructuredOutputFields, ChatTemplateFields):
    """POST /v1/chat/completions."""

    logprobs: bool | None = False
    top_logprobs: int | None = Field(0, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(None, ge=1, description="Deprecated by OpenAI: max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    # None: "auto" with tools, as at OpenAI; "auto" needs --enable-auto-tool-choice, as in vLLM.
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    # vLLM's: with --reasoning-parser, false leaves the reasoning out of the reply
    include_reasoning: bool = True
    echo: Literal[False] = Field(False, description="vLLM's; only false: echo on chat is not implemented")
    # OpenAI's bookkeeping fields: they change no generated token, OpenAI clients and SDKs send them, and
    # vLLM accepts them; refusing them would break drop-in use. /openapi.json says what each does here.
    store: bool | None = Field(None, description="accepted; nothing is stored")
    metadata: dict[str, Text] | None = Field(None, description="accepted; only meaningful with store")
    service_tier: Literal["auto", "default"] | None = Field(None, description="accepted; one tier")
    prompt_cache_key: Text | None = Field(None, description="accepted; prefix caching is automatic")
    # OpenAI's cache settings, as far as they describe this server's prefix cache: in memory, implicit
    # (every full block of a prompt is cached), kept at least until evicted. What it cannot honour is a 400.
    prompt_cache_retention: Literal["in_memory"] | None = Field(
        None, description="accepted: the prefix cache is in the engine's memory; '24h' is not supported"
    )
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: Text | None = None


# ----------------------------------------------------------- the one StructuredOutputsParams of a request
def structured_outputs_params(
    request: CompletionRequest | ChatCompletionRequest,
) -> StructuredOutputsParams | None:
    """The engine's one constraint for a request's output, from whichever form the request used; two
    forms in one request are a 400 (InvalidRequestError naming the second), as is a guided decoding
    backend other than this server's."""
    backend = request.guided_decoding_backend
    if backend is not None and backend not in (GRAMMAR_BACKEND, "auto"):
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not available: this server's one grammar backend is "
            f"{GRAMMAR_BACKEND!r}",
            param="guided_decoding_backend",
        )
    forms = _constraint_forms(request)
    if len(forms) > 1:
        (first, _), (second, _) = forms[:2]
        raise InvalidRequestError(
            f"{first} and {second} both constrain the output: send one of them", param=second
        )
    params = forms[0][1] if forms else None
    if request.guided_whitespace_pattern is not None:
        if params is None or params.kind not in ("json", "json_object"):
            raise InvalidRequestError(
                "guided_whitespace_pattern applies to JSON output: send it with a JSON schema",
                param="guided_whitespace_pattern",
            )
        params.whitespace_pattern = request.guided_whitespace_pattern
    return params


def _constraint_forms(
    request: CompletionRequest | ChatCompletionRequest,
) -> list[tuple[str, StructuredOutputsParams]]:
    """(field, its constraint) for every form the request sent."""
    forms: list[tuple[str, StructuredOutputsParams]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        forms.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.json_schema is not None:
        schema = fmt.json_schema.schema_
        params = (
            StructuredOutputsParams(json=schema)
            if schema is not None
            else StructuredOutputsParams(json_object=True)
        )
        forms.append(("response_format", params))
    if request.structured_outputs is not None:
        fields = request.structured_outputs.model_dump(by_alias=True, exclude_unset=True)
        forms.append(("structured_outputs", StructuredOutputsParams(**fields)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(request, name)
        if value is not None:
            forms.append((name, StructuredOutputsParams(**{kind: value})))
    if isinstance(request, ChatCompletionRequest):
        schema = tool_calls_schema(request)
        if schema is not None:
            # Calls are written compactly, as OpenAI writes them: free whitespace is room for a small model
            # to pad a finished call until max_tokens.
            forms.append(("tool_choice", StructuredOutputsParams(json=schema, disable_any_whitespace=True)))
    return forms


def constraint_field(request: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The request field its constraint came in (forced tool calls: the tools' parameters), to name in
    a 400 when the grammar engine refuses it."""
    forms = _constraint_forms(request)
    if not forms:
        return None
    return "tools" if forms[0][0] == "tool_choice" else forms[0][0]


def tool_choice_of(request: ChatCompletionRequest) -> str | ChatCompletionNamedToolChoiceParam:
    """What the request asks of its tools: "none", "auto", "required" or one named function. A named
    function must be one of the tools; a tool_choice other than "none" needs tools."""
    choice = request.tool_choice
    if not request.tools:
        if choice is not None and choice != "none":
            raise InvalidRequestError("tool_choice needs tools: send the functions to choose from",
                                      param="tool_choice")  # fmt: skip
        return "none"
    if choice is None:
        return "auto"  # OpenAI's default when there are tools
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        names = [tool.function.name for tool in request.tools]
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names function {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})",
                param="tool_choice",
            )
    return choice


def tool_calls_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The JSON schema that forces the reply to be tool calls, as vLLM builds it: for a named function its
    parameters; for "required" an array of {name, parameters} objects, anyOf over the tools (one item at
    most without parallel tool calls), with the tools' $defs hoisted to the root where $ref finds them."""
    choice = tool_choice_of(request)
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in request.tools or [] if t.function.name == choice.function.name)
        return _parameters(tool)
    if choice != "required":
        return None
    defs: dict[str, Any] = {}
    variants = []
    for tool in request.tools or []:
        parameters = dict(_parameters(tool))
        for name, definition in parameters.pop("$defs", {}).items():
            if defs.setdefault(name, definition) != definition:
                raise InvalidRequestError(
                    f"tools define $defs/{name} twice, differently: one schema cannot hold both",
                    param="tools",
                )
        variants.append({
            "properties": {"name": {"enum": [tool.function.name]}, "parameters": parameters},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": variants}}
    if request.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    """The function's arguments schema, closed: a forced call has the arguments the function declares
    and no others (vLLM's default grammar backend holds schemas so too); no ``parameters`` is ``{}``."""
    parameters = tool.function.parameters
    if parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return closed_schema(json.loads(parameters) if isinstance(parameters, str) else parameters)


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMAS = ("items", "not", "if", "then", "else", "contains", "additionalItems")
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def closed_schema(schema: Any) -> Any:
    """``schema`` with every object that says nothing of extra properties closed to them
    (``additionalProperties: false``); one that does says so itself and is left as it is."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = closed_schema(out[key])
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and not any(key in out for key in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


# ------------------------------------------------------------------------------------------ completions
class PromptLogprob(OpenAIBaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token null (the first) or {token id: its logprob}
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogProbs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's, for its decode engine


class CompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamResponse(OpenAIBaseModel):
    """One `data:` event of a streamed completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# ------------------------------------------------------------------------------------------------ chat
class ChatCompletionLogProb(OpenAIBaseModel):
    token: str
    logprob: float = -9999.0
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(OpenAIBaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(OpenAIBaseModel):
    role: str
    # vLLM's: the reply's reasoning, split off by --reasoning-parser (server/api/reasoning_parsers/)
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = "stop"
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill engine's, for its decode engine
    prompt_logprobs: PromptLogprobs | None = None


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    reasoning_content: str | None = None
    content: str | None = None
    # {index, id, type, function: {name, arguments}} first, then {index, function: {arguments}} fragments
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionResponseStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBaseModel):
    """One `data:` event of a streamed chat completion (the stream ends with `data: [DONE]`)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -------------------------------------------------------------------------------------- tokenization
class TokenizeCompletionRequest(RequestModel):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatTemplateFields):
    model: Text | None = None
    return_token_strs: bool | None = False


TokenizeRequest = TokenizeCompletionRequest | TokenizeChatRequest


class TokenizeResponse(OpenAIBaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestModel):
    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str


# ------------------------------------------------------------------------------------------- pooling
# The pooling runner's endpoints (server/api/serving_pooling.py): OpenAI's /v1/embeddings, vLLM's /pooling,
# /score and /rerank. ``input`` takes what OpenAI's does: a text, texts, token ids, or lists of token ids.
PoolingInput = Text | list[Text] | list[int] | list[list[int]]


class _PoolingFields(RequestModel):
    model: Text | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = Field(
        None, description="vLLM's: keep each prompt's last N tokens (-1: max_model_len); longer is a 400"
    )
    add_special_tokens: bool = True
    user: Text | None = Field(None, description="accepted; not used")


class EmbeddingRequest(_PoolingFields):
    input: PoolingInput = Field(..., description="a text, texts, token ids, or lists of token ids")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: little-endian float32 bytes (the openai SDK's default)"
    )
    dimensions: Annotated[int, Field(ge=1)] | None = Field(
        None, description="the first N values, then normalized: only for a Matryoshka-trained model"
    )
    normalize: bool | None = Field(None, description="vLLM's: unit length or not; null: as the model says")


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling: the same input, the raw pooled vector as ``data``."""


class ScoreRequest(_PoolingFields):
    text_1: Text | list[Text] = Field(..., description="one text, scored against every text_2, or a list")
    text_2: Text | list[Text] = Field(..., description="as many texts as text_1, or any number after one")


class RerankRequest(_PoolingFields):
    query: Text
    documents: list[Text]
    top_n: Annotated[int, Field(ge=0)] | None = Field(
        None, description="the best N; null or 0: every document"
    )
    return_documents: bool = Field(True, description="each result carries its document's text")


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/load_lora_adapter body: a name for the API's ``model`` and a PEFT folder or HF id."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """vLLM's POST /v1/unload_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM accepts it; the name alone decides here


class CpuKernels(OpenAIBaseModel):
    """The C++ CPU kernels an engine with the cpu backend runs (kernels/cpu_build.py)."""

    level: str  # the ISA level of the build loaded: "avx512vnni" | "avx2" | "generic"
    origin: str  # "prebuilt" (built with the package or image) | "cache" (built at first start)
    cpu: str  # this CPU's best level and bfloat16 units, as the kernels see them
    gguf_dense_dtype: str  # the dtype of batched GGUF rows' dense copies: "bfloat16" | "float32"


class VersionResponse(OpenAIBaseModel):
    version: str
    backend: str | None = None  # the engine's kernel backend: "triton" | "cpu" | "torch"
    cpu_kernels: CpuKernels | None = None  # with the cpu backend: which build runs, and for which CPU
    quantization: str | None = None  # the weights' quantization mode ("int8", "fp8", "gguf"), None
    quantization_reason: str | None = None  # why that mode (asked for, or the checkpoint's default)
    kv_cache_dtype: str = "auto"  # the KV cache's element type: "auto" (the model's dtype) or "fp8"
    kv_offloading_size: float | None = None  # GiB of the CPU KV tier (--kv-offloading-size); None: off
    kv_offloading_backend: str | None = None  # "native" when the tier is on
    # the speculative decoding in force (server/speculative_config.py, vLLM's keys), None for none
    speculative_config: dict[str, Any] | None = None
    architectures: list[str] = []  # the model architectures this server can load (server/models/registry.py)
    enable_lora: bool = False  # LoRA adapters can be served (--enable-lora)
    max_loras: int | None = None  # adapters in one batch (--max-loras); None without LoRA
    tensor_parallel_size: int = 1  # ranks the model is split across (--tensor-parallel-size)
    pipeline_parallel_size: int = 1  # stages the layers are cut into (--pipeline-parallel-size)
    async_scheduling: bool = False  # steps launched before the last one is read back (--async-scheduling)
    # Every engine setting in force, by its name in common/engine_args.py (the flag, dashed).
    engine_args: dict[str, Any] = {}
