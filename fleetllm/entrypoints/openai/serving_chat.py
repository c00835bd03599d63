"""POST /v1/chat/completions: the messages (and tools) through the chat template, then one
engine request with n samples; with tools, the answer is read back as tool calls
(chat_tools.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from fleetllm.engine.async_engine import AsyncLLMEngine, RequestStream
from fleetllm.engine.outputs import CompletionOutput
from fleetllm.entrypoints.openai.chat_tools import (
    ToolCallStreamer,
    ToolPlan,
    plan_tools,
    read_answer,
)
from fleetllm.entrypoints.openai.errors import APIError
from fleetllm.entrypoints.openai.logprobs import LogprobFormatter
from fleetllm.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    DeltaMessage,
    UsageInfo,
)
from fleetllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    SSEResponse,
    engine_params,
    json_response,
    request_ids,
    sse,
    sse_error,
)
from fleetllm.entrypoints.openai.serving_models import ServingModels
from fleetllm.entrypoints.openai.streams import ClientDisconnected, collect_final, merge_streams
from fleetllm.entrypoints.openai.structured_outputs import structured_outputs_for
from fleetllm.entrypoints.openai.tool_parsers import ToolParser


class ServingChat(OpenAIServing):
    endpoint = "/v1/chat/completions"
    needs_task = "generate"

    def __init__(self, engine: AsyncLLMEngine, served_model_names: list[str],
                 chat_template: str | None = None, tool_parser: ToolParser | None = None,
                 models: ServingModels | None = None, **options: Any):
        """`tool_parser`: reads tool_choice "auto" answers (--enable-auto-tool-choice
        --tool-call-parser); None refuses "auto". `options`: OpenAIServing's keywords."""
        super().__init__(engine, served_model_names, chat_template, models, **options)
        self.tool_parser = tool_parser
        # The parser reads tokens the tokenizer counts as special (Llama's <|python_tag|>):
        # "auto" answers keep them (vLLM's parsers turn skip_special_tokens off the same way).
        special = set(getattr(self.tokenizer, "all_special_tokens", None) or ())
        self.keep_special_tokens = tool_parser is not None and bool(
            special & set(tool_parser.special_tokens))

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        lora_request = self.check_request(req)
        model = self.models.model_name(lora_request)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs: only allowed with logprobs: true",
                           "top_logprobs")
        self.check_prompt_count(1, req.n, "n")
        plan = plan_tools(req, self.tool_parser)
        structured = structured_outputs_for(req, self.structured_outputs_backend, plan.schema)
        text, ids = await self.render_chat(req.messages, req.add_generation_prompt, req.tools)
        self.check_token_ids(ids, "messages")
        # max_completion_tokens is OpenAI's current name, max_tokens the deprecated one.
        param = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        max_tokens = self.max_tokens_for(getattr(req, param), len(ids), "messages", param)
        top_n = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(req, max_tokens, top_n, structured=structured,
                                      skip_special_tokens=False if plan.mode == "auto"
                                      and self.keep_special_tokens else None)
        request_id, engine_id = request_ids(raw, "chatcmpl")
        streams = await self.start(engine_id, [({"prompt": text, "prompt_token_ids": ids},
                                                 params)], arrival, lora_request,
                                   engine_params(req, "messages"))
        fmt = LogprobFormatter(self.tokenizer, req.return_tokens_as_token_ids,
                               req.skip_special_tokens)
        if req.stream:
            return SSEResponse(self._stream(req, request_id, int(arrival), len(ids), streams,
                                            fmt, plan, model))
        try:
            [final] = await collect_final(streams, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        for c in final.outputs:
            content, calls, reason = read_answer(plan, c.text, c.finish_reason)
            choices.append(ChatChoice(
                index=c.index, message=AssistantMessage(content=content, tool_calls=calls),
                logprobs=None if top_n is None else fmt.chat(c.token_ids, c.logprobs or [],
                                                              top_n),
                finish_reason=reason, stop_reason=c.stop_reason))
        return json_response(ChatCompletionResponse(
            id=request_id, created=int(arrival), model=model, choices=choices,
            usage=_usage(len(ids), final.outputs),
            kv_transfer_params=final.kv_transfer_params))

    async def _stream(self, req: ChatCompletionRequest, request_id: str, created: int,
                      prompt_tokens: int, streams: list[RequestStream],
                      fmt: LogprobFormatter, plan: ToolPlan, model: str
                      ) -> AsyncIterator[str]:
        top_n = (req.top_logprobs or 0) if req.logprobs else None

        def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
            return sse(ChatCompletionChunk(id=request_id, created=created,
                                           model=model, choices=choices,
                                           usage=usage))

        # As OpenAI does: every choice opens with the role, before any content.
        for index in range(req.n):
            yield chunk([ChatStreamChoice(index=index,
                                          delta=DeltaMessage(role="assistant", content=""))])
        finished: set[int] = set()
        last: dict[int, CompletionOutput] = {}
        tools = {index: ToolCallStreamer(plan) for index in range(req.n)}
        try:
            async for _, out in merge_streams(streams):
                for c in out.outputs:
                    if c.index in finished:
                        continue
                    last[c.index] = c
                    if not c.delta_text and not c.delta_token_ids and not c.finished():
                        continue
                    if c.finished():
                        finished.add(c.index)
                    logprobs = None if top_n is None else fmt.chat(
                        c.delta_token_ids, c.delta_logprobs or [], top_n)
                    reason = c.finish_reason
                    if plan.mode == "none":
                        delta = DeltaMessage(content=c.delta_text)
                    else:
                        content, calls = tools[c.index].feed(c.delta_text, c.finished())
                        if not content and not calls and not c.finished() and logprobs is None:
                            continue  # held back until it is clear what it is
                        delta = DeltaMessage(content=content or None, tool_calls=calls or None)
                        reason = tools[c.index].finish_reason(reason)
                    yield chunk([ChatStreamChoice(
                        index=c.index, delta=delta, logprobs=logprobs, finish_reason=reason,
                        stop_reason=c.stop_reason)])
            if req.stream_options is not None and req.stream_options.include_usage:
                yield chunk([], _usage(prompt_tokens, list(last.values())))
        except Exception as e:  # the engine died or the server is draining: say so, in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"

def _usage(prompt_tokens: int, completions: list[CompletionOutput]) -> UsageInfo:
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
