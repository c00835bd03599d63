"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + sample.

`echo: true, max_tokens: 0` scores the prompt (as vLLM; lm-evaluation-harness's loglikelihood
asks exactly this): the choice is the prompt's text, with its logprobs when `logprobs` is set,
and nothing generated (the engine draws one token, which is dropped).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from fleetllm.engine.async_engine import RequestStream
from fleetllm.engine.llm_engine import PromptType
from fleetllm.engine.outputs import CompletionOutput, RequestOutput
from fleetllm.entrypoints.openai.body_checks import until_disconnected
from fleetllm.entrypoints.openai.errors import APIError
from fleetllm.entrypoints.openai.logprobs import LogprobFormatter
from fleetllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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
from fleetllm.entrypoints.openai.streams import ClientDisconnected, collect_final, merge_streams
from fleetllm.entrypoints.openai.structured_outputs import structured_outputs_for
from fleetllm.lora.request import LoRARequest
from fleetllm.sampling_params import SamplingParams, StructuredOutputsParams


class _Prompt:
    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids
        self.decoded: tuple[list[str], list] | None = None  # prompt_texts, once per prompt

    def engine_prompt(self) -> PromptType:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class _Choice:
    """What one choice shows: the generated part of an output (nothing when only scoring
    the prompt: it ends for its length, 0), and its echoed prompt."""

    def __init__(self, req: CompletionRequest, fmt: LogprobFormatter, prompt: _Prompt,
                 out: RequestOutput, c: CompletionOutput, score_only: bool):
        self.token_ids = [] if score_only else c.token_ids
        self.text = "" if score_only else c.text
        self.logprobs = [] if score_only else (c.logprobs or [])
        self.finish_reason = ("length" if c.finished() else None) if score_only else \
            c.finish_reason
        self.stop_reason = None if score_only else c.stop_reason
        self.echo = req.echo
        self._fmt, self._prompt, self._out = fmt, prompt, out

    def prompt_part(self, with_logprobs: bool) -> tuple[str, CompletionLogprobs]:
        """The echoed prompt: its text, and its tokens' logprobs from offset 0."""
        if not self.echo:
            return "", CompletionLogprobs()
        p = self._prompt
        if p.decoded is None:
            p.decoded = self._fmt.prompt_texts(p.token_ids, self._out.prompt_logprobs or [])
        texts, entries = p.decoded
        text = p.text if p.text is not None else "".join(texts)
        if not with_logprobs:
            return text, CompletionLogprobs()
        return text, self._fmt.completion(p.token_ids, entries, 0, texts)


class ServingCompletion(OpenAIServing):
    endpoint = "/v1/completions"
    needs_task = "generate"

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        lora_request = self.check_request(req)
        model = self.models.model_name(lora_request)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it out, or equal to n)",
                           "best_of")
        score_only = req.max_tokens == 0
        if score_only and not req.echo:
            raise APIError(400, "max_tokens: must be at least 1 (0 only with echo: true, "
                           "which scores the prompt)", "max_tokens")
        structured = structured_outputs_for(req, self.structured_outputs_backend)
        response_id, engine_id = request_ids(raw, "cmpl")
        try:  # a client that leaves while its prompts are tokenized and added stops both
            prompts, streams = await until_disconnected(
                self._prepare(req, engine_id, arrival, lora_request, structured), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        fmt = LogprobFormatter(self.tokenizer, req.return_tokens_as_token_ids,
                               req.skip_special_tokens)
        if req.stream:
            return SSEResponse(self._stream(req, response_id, int(arrival), prompts, streams,
                                            fmt, score_only, model))
        try:
            finals = await collect_final(streams, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        generated: list[_Choice] = []
        for i, out in enumerate(finals):
            for c in out.outputs:
                part = _Choice(req, fmt, prompts[i], out, c, score_only)
                generated.append(part)
                choices.append(self._choice(req, i * req.n + c.index, part, fmt))
        return json_response(CompletionResponse(id=response_id, created=int(arrival),
                                                model=model, choices=choices,
                                                usage=_usage(prompts, generated),
                                                kv_transfer_params=finals[0].kv_transfer_params))

    async def _prepare(self, req: CompletionRequest, engine_id: str, arrival: float,
                       lora_request: LoRARequest | None,
                       structured: StructuredOutputsParams | None
                       ) -> tuple[list[_Prompt], list[RequestStream]]:
        """The prompts, tokenized and checked, and their engine requests, started."""
        prompts = await self._prompts(req.prompt, req.n)
        requests: list[tuple[PromptType, SamplingParams]] = []
        for p in prompts:
            max_tokens = self.max_tokens_for(req.max_tokens, len(p.token_ids), "prompt")
            prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            requests.append((p.engine_prompt(), self.sampling_params(
                req, max(max_tokens, 1), req.logprobs, prompt_logprobs, structured)))
        return prompts, await self.start(engine_id, requests, arrival, lora_request,
                                         engine_params(req, "prompt"))

    async def _prompts(self, prompt: str | list, n: int) -> list[_Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        self.check_prompt_count(len(prompt), n, "prompt")
        params = ["prompt"] if len(prompt) == 1 else [f"prompt.{i}" for i in range(len(prompt))]
        for p, param in zip(prompt, params, strict=True):  # all, before any is tokenized
            if isinstance(p, str):
                self.text_bound.check(p, param)
        out = []
        for p, param in zip(prompt, params, strict=True):
            if isinstance(p, str):
                ids = await self.engine.tokenize(p)
                out.append(_Prompt(p, ids))
            else:
                out.append(_Prompt(None, list(p)))
            self.check_token_ids(out[-1].token_ids, param)
        return out

    def _choice(self, req: CompletionRequest, index: int, part: _Choice,
                fmt: LogprobFormatter) -> CompletionChoice:
        with_logprobs = req.logprobs is not None
        prefix, logprobs = part.prompt_part(with_logprobs)
        if with_logprobs:
            logprobs = _concat(logprobs, fmt.completion(part.token_ids, part.logprobs,
                                                        len(prefix)))
        return CompletionChoice(index=index, text=prefix + part.text,
                                logprobs=logprobs if with_logprobs else None,
                                finish_reason=part.finish_reason,
                                stop_reason=part.stop_reason)

    async def _stream(self, req: CompletionRequest, request_id: str, created: int,
                      prompts: list[_Prompt], streams: list, fmt: LogprobFormatter,
                      score_only: bool, model: str) -> AsyncIterator[str]:
        with_logprobs = req.logprobs is not None
        offsets: dict[int, int] = {}  # choice -> where its next logprob token starts
        finished: set[int] = set()
        last: dict[int, _Choice] = {}
        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in finished:
                        continue
                    part = last[index] = _Choice(req, fmt, prompts[i], out, c, score_only)
                    text = "" if score_only else c.delta_text
                    ids = [] if score_only else c.delta_token_ids
                    logprobs = CompletionLogprobs()
                    if index not in offsets:  # the first chunk: the echoed prompt
                        prefix, logprobs = part.prompt_part(with_logprobs)
                        text = prefix + text
                        offsets[index] = len(prefix)
                    if with_logprobs:
                        tail = fmt.completion(ids, [] if score_only else
                                              c.delta_logprobs or [], offsets[index])
                        offsets[index] += sum(len(t) for t in tail.tokens)
                        logprobs = _concat(logprobs, tail)
                    if not text and not ids and not c.finished():
                        continue
                    if c.finished():
                        finished.add(index)
                    yield sse(CompletionResponse(
                        id=request_id, created=created, model=model,
                        choices=[CompletionChoice(
                            index=index, text=text,
                            logprobs=logprobs if with_logprobs else None,
                            finish_reason=part.finish_reason,
                            stop_reason=part.stop_reason)]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created,
                                             model=model, choices=[],
                                             usage=_usage(prompts, list(last.values()))))
        except Exception as e:  # the engine died or the server is draining: say so, in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def _usage(prompts: list[_Prompt], choices: list[_Choice]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
