"""The OpenAI API's request and response bodies, as pydantic models.

Every bound that protects the engine (a huge top_k or seed would fail inside the sampler and
take every request down with it) is checked here. Fields past OpenAI's are vLLM's extensions,
with vLLM's names. The rules every body follows (strict validation, no field silently dropped:
IGNORED_FIELDS, UNSUPPORTED_FIELDS) are protocol_base's, re-exported here.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field

from fleetllm.entrypoints.openai.protocol_base import (  # noqa: F401 - re-exported
    IGNORED_FIELDS,
    UNSUPPORTED_FIELDS,
    OmitWhenNone,
    RequestModel,
    ResponseModel,
)

NonNegInt = Annotated[int, Field(ge=0)]
StopString = Annotated[str, Field(min_length=1)]
MAX_LOGPROBS = 20
MAX_N = 128
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request

class StreamOptions(RequestModel):
    include_usage: bool = False


class JsonSchemaFormat(RequestModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" is a BaseModel attribute: the field takes OpenAI's name as its alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` field: StructuredOutputsParams' fields."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(RequestModel):  # in a replayed assistant message, and in responses
    name: str
    arguments: str


class ToolCallParam(RequestModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SamplingRequest(RequestModel):
    """What completions and chat completions share."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, le=1 << 31)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: StopString | list[StopString] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: logprob tokens as "token_id:123", for clients that need the ids exactly.
    return_tokens_as_token_ids: bool = False
    # Structured outputs (structured_outputs.py): at most one of these constrains a request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None  # vLLM's older fields
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # KV transfer between a prefill and a decode instance (vLLM's; docs/kv_transfer.md).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    # 0 only with echo: score the prompt, generate nothing (checked by the handler)
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant's calls (replayed history)
    tool_call_id: str | None = None  # a tool message's answer to that call

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # False: only the first call (as vLLM)


class TokenizeRequest(RequestModel):
    """POST /tokenize: a prompt, or chat messages rendered through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = None  # passed to the chat template
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[NonNegInt]


class EmbeddingRequest(RequestModel):
    """POST /v1/embeddings: OpenAI's fields (`user` is ignored, as everywhere), then vLLM's
    extensions. One engine request per input."""

    model: str | None = None
    input: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka truncation (checked by the engine)
    # vLLM: per request, whether to scale to unit length (None: the model's pooler config).
    normalize: bool | None = None
    # vLLM: keep only the last k tokens of each input (-1: the model's max_model_len).
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    add_special_tokens: bool = True  # vLLM: for text inputs


# ------------------------------------------------------------------ responses


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OmitWhenNone):  # a stream chunk too
    omit_when_none = ("usage", "kv_transfer_params")
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill leg's answer (vLLM's)


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class ToolCall(ResponseModel):
    id: str
    type: str = "function"
    function: FunctionCall


class AssistantMessage(OmitWhenNone):
    omit_when_none = ("tool_calls",)
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class DeltaFunctionCall(OmitWhenNone):
    omit_when_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitWhenNone):
    """A streamed call: the first delta has its id, type and name; the rest argument text."""

    omit_when_none = ("id", "type")
    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OmitWhenNone):
    omit_when_none = ("kv_transfer_params",)
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill leg's answer (vLLM's)


class DeltaMessage(OmitWhenNone):
    omit_when_none = ("role", "content", "tool_calls")
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OmitWhenNone):
    omit_when_none = ("usage",)
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class EmbeddingData(ResponseModel):
    index: int
    object: str = "embedding"
    # floats, or base64 of their little-endian float32 bytes (encoding_format "base64")
    embedding: list[float] | str


class EmbeddingUsage(ResponseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(ResponseModel):
    id: str
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ModelCard(ResponseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "fleetllm"
    root: str | None = None  # the checkpoint's path, or a LoRA adapter's
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None
    task: str | None = None  # "generate" (completions, chat) or "embed" (embeddings)


class ModelList(ResponseModel):
    object: str = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(RequestModel):  # POST /v1/load_lora_adapter (vLLM's)
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(RequestModel):  # POST /v1/unload_lora_adapter (vLLM's)
    lora_name: str
    lora_int_id: int | None = None


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: Any = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo
