"""The HTTP boundary: pydantic models of the OpenAI-compatible requests and responses.

Owns: the shapes and field-level rules (types, ranges, unknown fields) of `/v1/completions` and
`/v1/chat/completions` requests and of every response and stream chunk. This is the only module in
the project that uses pydantic. Does not own: turning a request into `SamplingParams` or running it
(serving.py), or how a validation error becomes an HTTP response (errors.py).

Requests are validated strictly from the raw JSON bytes (`model_validate_json`): no string-to-number
coercion, no NaN or infinity, unknown fields rejected (a typo never silently does nothing). Fields
beyond OpenAI's are the engine's own sampling parameters (top_k, min_p, ...), as vLLM accepts them.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_TOP_LOGPROBS = 20
MAX_N = 16
MAX_STOP = 16
log = logging.getLogger("workbench.server")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


# --- request parts ------------------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: no obfuscation padding is sent


class JsonSchemaFormat(_Strict):
    name: str = Field("response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is 'json_schema'")
        return self


class FunctionDef(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v: Any) -> str | None:
        """A string, null, or a list of text parts (joined): images and audio are refused."""
        if v is None or isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(p, dict) for p in v):
            texts = []
            for p in v:
                if p.get("type") != "text" or not isinstance(p.get("text"), str) or set(p) - {"type", "text"}:
                    raise ValueError("content parts must be {'type': 'text', 'text': <string>}: only text is supported")
                texts.append(p["text"])
            return "".join(texts)
        raise ValueError("content must be a string, null or a list of text parts")

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"content is required for a {self.role!r} message")
        return self


# --- requests -----------------------------------------------------------------------------------


class _SamplingFields(_Strict):
    """Fields both endpoints share: OpenAI's sampling knobs, then the engine's own."""

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Any = Field(None, validate_default=True)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    user: str | None = None
    response_format: ResponseFormat | None = None
    # the engine's own parameters (vLLM/SGLang names)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    ebnf: str | None = None
    store: bool | None = None  # these five: OpenAI fields accepted and ignored, noted in the log (_note_ignored)
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Any) -> list[str]:
        if v is None:
            return []
        items = [v] if isinstance(v, str) else v
        if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
            raise ValueError("stop must be a string or a list of strings")
        if len(items) > MAX_STOP:
            raise ValueError(f"stop must have at most {MAX_STOP} strings, got {len(items)}")
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        return items

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @model_validator(mode="after")
    def _note_ignored(self) -> _SamplingFields:
        given = sorted(IGNORED_FIELDS & self.model_fields_set) + ["stream_options.include_obfuscation"] * (
            self.stream_options is not None and self.stream_options.include_obfuscation is not None)
        if given:
            log.info("request fields accepted and ignored (no effect on this server): %s", ", ".join(given))
        return self


IGNORED_FIELDS = frozenset("store metadata service_tier prompt_cache_key safety_identifier reasoning_effort user".split())


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> list[str | list[int]]:
        """Normalised to a list of prompts, each a string or a list of token ids."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            out: list[Any] = [v]
        elif ids(v):
            out = [v]
        elif isinstance(v, list) and v and all(isinstance(p, str) or ids(p) for p in v):
            out = list(v)
        else:
            raise ValueError("prompt must be a non-empty string, a list of strings, a list of token ids "
                             "or a list of lists of token ids")
        if any(isinstance(p, str) and not p for p in out):
            raise ValueError("prompt must not be empty")
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None  # ignored: no reasoning

    @model_validator(mode="before")  # `functions` / `function_call` (OpenAI's older names): `tools` / `tool_choice`
    @classmethod
    def _legacy_functions(cls, data: Any) -> Any:
        if not isinstance(data, dict) or ("functions" not in data and "function_call" not in data):
            return data
        if "tools" in data or "tool_choice" in data:
            raise ValueError("functions/function_call are the legacy form of tools/tool_choice; give one form")
        data = dict(data)
        functions, call = data.pop("functions", None), data.pop("function_call", None)
        if functions is not None:
            data["tools"] = [{"type": "function", "function": f} for f in functions] if isinstance(
                functions, list) else functions  # not a list: refused as `tools`
        named = isinstance(call, dict) and set(call) == {"name"}  # {"name": f} is tool_choice's function form
        return {**data, "tool_choice": {"type": "function", "function": call} if named else call} if call else data

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if v is None or v in ("none", "auto", "required"):
            return v
        if (isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict)
                and isinstance(v["function"].get("name"), str)):
            return v
        raise ValueError("tool_choice must be 'none', 'auto', 'required' or "
                         "{'type': 'function', 'function': {'name': ...}}")

    @model_validator(mode="after")
    def _logprob_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


# --- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV was copied (prefix cache, or a shared prefill), not computed


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # only when some prompt KV was reused


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _DropNone(BaseModel):
    """Fields that carry nothing are left out of the JSON, as OpenAI's stream deltas do."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_DropNone):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_DropNone):  # the first delta of a call: id, type, name, arguments ""; then arguments
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_DropNone):
    """A stream delta: fields that carry nothing are left out, as OpenAI does."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "workbench"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
