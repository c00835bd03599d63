"""What the completion, chat, embedding and tokenization handlers share: parsing a body
(screened first: body_checks), checking the model name, the task the server runs, the
context length, the token ids and the number of prompts, building SamplingParams, starting
engine requests (all of a request's prompts at once, so that the engine batches them; all or
none), and answering in server-sent events. Reading the streams back is streams.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from fleetllm.engine.async_engine import AsyncLLMEngine, RequestStream
from fleetllm.engine.llm_engine import PromptType
from fleetllm.entrypoints.openai.body_checks import (
    TextBound,
    screen_json,
)
from fleetllm.entrypoints.openai.chat_tools import template_message
from fleetllm.entrypoints.openai.errors import (
    APIError,
    api_error_from,
    error_body,
    truncate,
    validation_error,
)
from fleetllm.entrypoints.openai.gate import MAX_REQUEST_ID_CHARS, valid_request_id
from fleetllm.entrypoints.openai.protocol import (
    ChatCompletionTool,
    ChatMessage,
    SamplingRequest,
)
from fleetllm.entrypoints.openai.serving_models import ServingModels
from fleetllm.errors import ConfigurationError
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams, StructuredOutputsParams

M = TypeVar("M", bound=BaseModel)
MAX_BODY_BYTES = 16 << 20
# The request fields an output constraint comes from (structured_outputs_for allows one).
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                      "guided_choice", "guided_grammar")
# prompts x n per request (--max-prompts-per-request): past any batch a client sends
DEFAULT_MAX_PROMPTS_PER_REQUEST = 4096
# What each task serves, for the 400 an endpoint of the other task gets.
TASK_ENDPOINTS = {"generate": "/v1/completions and /v1/chat/completions",
                  "embed": "/v1/embeddings"}


class SSEResponse(StreamingResponse):
    """Server-sent events. Closing the body iterator when the response ends, however it ends
    (a disconnect cancels the send loop mid-stream), aborts the requests behind it now rather
    than whenever the generator is garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def sse(data: BaseModel | dict[str, Any] | str) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump_json(exclude_unset=False)
    elif isinstance(data, dict):
        data = json.dumps(data)
    return f"data: {data}\n\n"


def sse_error(e: BaseException) -> str:
    err = api_error_from(e)
    return sse(error_body(err.status, err.message, err.param, err.type))


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def request_ids(raw: Request | None, prefix: str) -> tuple[str, str]:
    """(the response's id, the base of its engine request ids). The response id is built
    from the client's X-Request-Id when it sent one (as vLLM), else random; engine ids stay
    unique even when clients reuse theirs."""
    given = raw.headers.get("x-request-id") if raw is not None else None
    if not given:
        rid = random_id(prefix)
        return rid, rid
    if not valid_request_id(given):
        raise APIError(400, f"X-Request-Id: must be 1 to {MAX_REQUEST_ID_CHARS} printable "
                       "ASCII characters", "X-Request-Id")
    rid = f"{prefix}-{given}"
    return rid, f"{rid}-{uuid.uuid4().hex[:8]}"


async def json_object(request: Request) -> dict[str, Any]:
    """The body, read up to MAX_BODY_BYTES (else a 413) and decoded: a JSON object, else a
    400 (parse_body's, and `fleetllm proxy`'s, which leaves the rest to the instances)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"malformed JSON body: {truncate(str(e), 200)}") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"the body must be a JSON object, got {type(obj).__name__}")
    return obj


async def parse_body(request: Request, model: type[M]) -> M:
    """The JSON body as `model`: a 400 for a missing or wrong content type, malformed JSON,
    a non-object, or a field that fails validation; 413 past MAX_BODY_BYTES."""
    ctype = request.headers.get("content-type")
    if not ctype:
        raise APIError(400, "missing Content-Type header: send the body as application/json")
    mime = ctype.split(";")[0].strip().lower()
    if mime != "application/json" and not mime.endswith("+json"):
        raise APIError(400, f"Content-Type must be application/json, got "
                       f"{truncate(ctype, 100)!r}")
    obj = await json_object(request)
    screen_json(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e.errors(include_input=False, include_url=False)) from None
    except RecursionError:
        raise APIError(400, "the body is nested too deeply") from None


def json_response(body: BaseModel, status: int = 200) -> Response:
    # pydantic's JSON writes a non-finite float as null; json.dumps would write bare Infinity.
    return Response(body.model_dump_json(), status_code=status, media_type="application/json")


class OpenAIServing:
    # The endpoint a handler serves and the task it needs the model to run (None: any).
    endpoint = ""
    needs_task: str | None = None

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 chat_template: str | None = None, models: ServingModels | None = None, *,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST):
        """`max_prompts_per_request`: engine requests (prompts x n) one HTTP request may
        start (--max-prompts-per-request)."""
        self.engine = engine
        self.max_prompts_per_request = max_prompts_per_request
        self.task = engine.model_config.task
        self.model_names = served_model_names
        # The base model's names and the LoRA adapters (shared by every handler of an app).
        self.models = models or ServingModels(engine, served_model_names)
        self.chat_template = chat_template
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.vocab_size = engine.model_config.arch.vocab_size
        self.text_bound = TextBound(self.tokenizer, self.max_model_len)
        self.max_num_seqs = engine.config.scheduler_config.max_num_seqs
        self.structured_outputs_backend = \
            engine.config.decoding_config.structured_outputs_backend

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); a 404 for an unknown
        name."""
        return self.models.lora_request(model)

    def check_token_ids(self, ids: Sequence[int], param: str, empty_ok: bool = False
                        ) -> None:
        """Every id in [0, vocab_size): a 400 naming `param` before anything reaches the
        engine (an id past 2**64 cannot even cross to the engine-core process)."""
        if not ids and not empty_ok:
            raise APIError(400, f"{param}: the prompt is empty", param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"{param}: token ids {[truncate(str(t), 30) for t in bad[:5]]}"
                           f" are outside the vocabulary [0, {self.vocab_size})", param)

    def check_prompt_count(self, prompts: int, n: int, param: str) -> None:
        """prompts x n engine requests at most max_prompts_per_request, checked before any
        is tokenized (one body of tiny prompts must not keep the server busy for minutes)."""
        if prompts * n > self.max_prompts_per_request:
            param = param if prompts > 1 else "n"
            raise APIError(400, f"{param}: {prompts} prompts x n={n} is more than the "
                           f"server's --max-prompts-per-request="
                           f"{self.max_prompts_per_request}; split the request", param)

    def check_task(self) -> None:
        """A 400 that names the server's task when this endpoint needs the other one."""
        if self.needs_task is not None and self.task != self.needs_task:
            raise APIError(400, f"{self.endpoint} needs a model served with --task "
                           f"{self.needs_task}, but this server runs {self.model_name} with "
                           f"task '{self.task}', which serves "
                           f"{TASK_ENDPOINTS.get(self.task, 'other endpoints')}")

    def check_request(self, req: SamplingRequest) -> LoRARequest | None:
        """What completions and chat check before anything else (vLLM's checks too); the
        LoRA adapter the request's model names (None: the base model)."""
        lora_request = self.check_model(req.model)
        self.check_task()
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options: only allowed with stream: true",
                           "stream_options")
        return lora_request

    def max_tokens_for(self, requested: int | None, prompt_len: int, what: str,
                       param: str = "max_tokens") -> int:
        """`requested`, or all the room left when None; a 400 (naming `param`, the field the
        client set) when it does not fit."""
        limit = self.max_model_len
        if requested is None:
            if prompt_len >= limit:
                raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                               f"However, your {what} has {prompt_len} tokens, which leaves "
                               f"no room for a completion. Please reduce the length of the "
                               f"{what}.", what)
            return limit - prompt_len
        if prompt_len + requested > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. "
                           f"However, you requested {prompt_len + requested} tokens "
                           f"({prompt_len} in the {what}, {requested} in the completion). "
                           f"Please reduce the length of the {what} or completion "
                           f"({param}).", param)
        return requested

    def sampling_params(self, req: SamplingRequest, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutputsParams | None = None,
                        skip_special_tokens: bool | None = None) -> SamplingParams:
        if req.n > self.max_num_seqs:
            raise APIError(400, f"n: {req.n} is more than the server's max_num_seqs="
                           f"{self.max_num_seqs}", "n")
        if req.stop_token_ids:
            self.check_token_ids(req.stop_token_ids, "stop_token_ids", empty_ok=True)
        given = {
            "temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k,
            "min_p": req.min_p, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty,
            "repetition_penalty": req.repetition_penalty}
        try:
            return SamplingParams(
                n=req.n, seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
                stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=req.skip_special_tokens if skip_special_tokens is None
                else skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
                structured_outputs=structured, kv_transfer_params=req.kv_transfer_params,
                **{k: v for k, v in given.items() if v is not None})
        except ConfigurationError as e:
            message = str(e).removeprefix(f"[{e.code}] ")
            raise APIError(400, message, message.split(":")[0]) from None

    async def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool,
                          tools: list[ChatCompletionTool] | None = None
                          ) -> tuple[str, list[int]]:
        """The chat template applied to the messages (and the tools, as transformers'
        apply_chat_template(tools=...) passes them), and its token ids."""
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer, so it cannot serve chat")
        template = self.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise APIError(400, "this model has no chat template: start the server with "
                           "--chat-template FILE, or use /v1/completions", "messages")
        for i, m in enumerate(messages):
            self.text_bound.check(m.text(), f"messages.{i}.content")
        conversation = [template_message(m) for m in messages]
        tool_dicts = None if not tools else [t.model_dump(exclude_none=True) for t in tools]
        try:
            text = await self.engine.run_in_tokenizer_thread(
                self.tokenizer.apply_chat_template, conversation, chat_template=template,
                add_generation_prompt=add_generation_prompt, tokenize=False, tools=tool_dicts)
        except Exception as e:  # jinja2 errors, raise_exception() in templates
            raise APIError(400, f"the chat template failed on these messages: "
                           f"{truncate(str(e), 300)}", "messages") from None
        self.text_bound.check(text, "messages")
        # The template writes any BOS itself: do not add special tokens again.
        return text, await self.engine.tokenize(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode(list(ids))
        except Exception:  # ids the tokenizer does not know (a padded embedding table)
            return ""

    async def start(self, engine_id: str,
                    requests: list[tuple[PromptType, SamplingParams | PoolingParams]],
                    arrival_time: float, lora_request: LoRARequest | None = None,
                    params: dict[str, str] | None = None) -> list[RequestStream]:
        """One engine request per prompt (`engine_id`-i), all added at once: queued in
        order before any is accepted, so the engine takes them into the same step rather than
        one per step. All accepted, or none (the first rejection, by index, raised as a
        4xx/503; the accepted ones are aborted). Each runs through `lora_request`'s adapter
        when given. `params`: the engine's name of a field -> the request's ("prompt" ->
        "messages"), for the `param` of a 400 the engine gives."""
        tasks = [asyncio.ensure_future(self.engine.add_request(
            f"{engine_id}-{i}", prompt, params, arrival_time, lora_request))
            for i, (prompt, params) in enumerate(requests)]
        try:
            await asyncio.wait(tasks)
        except BaseException:  # cancelled (the client went away): undo every add
            _undo(tasks)
            raise
        failures = [asyncio.CancelledError() if t.cancelled() else t.exception() for t in tasks]
        error = next((e for e in failures if e is not None), None)
        if error is not None:
            _undo(tasks)
            api_error = api_error_from(error)
            if api_error.param is not None and params:
                head, _, rest = api_error.param.partition(".")
                if head in params:
                    api_error.param = params[head] + (f".{rest}" if rest else "")
            raise api_error from None
        return [t.result() for t in tasks]


def engine_params(req: SamplingRequest, prompt_field: str) -> dict[str, str]:
    """The engine's field names -> this request's (OpenAIServing.start's `params`): the
    prompt's, the field its output constraint came from (tools, for a tool_choice), and
    `model` for its LoRA adapter."""
    given = [f for f in _STRUCTURED_FIELDS if getattr(req, f, None) is not None]
    source = given[0] if given else "tools"
    return {"prompt": prompt_field, "structured_outputs": source, "lora_request": "model"}


def _undo(tasks: list[asyncio.Future]) -> None:
    """Abort the requests of these adds: close the accepted ones' streams, cancel the rest
    (a cancelled add aborts its own request)."""
    for task in tasks:
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None:
            task.result().close()
