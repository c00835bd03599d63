"""POST /v1/completions: one engine request per prompt, choices numbered prompt * n + sample."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from starlette.responses import Response

from fleetllm.engine.llm_engine import PromptType
from fleetllm.engine.outputs import CompletionOutput, RequestOutput
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
    ClientDisconnected,
    OpenAIServing,
    SSEResponse,
    collect_final,
    json_response,
    merge_streams,
    random_id,
    sse,
    sse_error,
)
from fleetllm.sampling_params import SamplingParams


class _Prompt:
    def __init__(self, text: str | None, token_ids: list[int]):
        self.text = text
        self.token_ids = token_ids

    def engine_prompt(self) -> PromptType:
        return {"prompt": self.text, "prompt_token_ids": self.token_ids}


class ServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, "best_of is not supported (leave it out, or equal to n)",
                           "best_of")
        prompts = await self._prompts(req.prompt)
        requests: list[tuple[PromptType, SamplingParams]] = []
        for p in prompts:
            max_tokens = self.max_tokens_for(req.max_tokens, len(p.token_ids), "prompt")
            prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
            requests.append((p.engine_prompt(), self.sampling_params(
                req, max_tokens, req.logprobs, prompt_logprobs)))
        request_id = random_id("cmpl")
        streams = await self.start(request_id, requests, arrival)
        fmt = LogprobFormatter(self.decode, req.return_tokens_as_token_ids)
        if req.stream:
            return SSEResponse(self._stream(req, request_id, int(arrival), prompts, streams,
                                            fmt))
        try:
            finals = await collect_final(streams, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = [self._choice(req, i * req.n + c.index, prompts[i], out, c, fmt)
                   for i, out in enumerate(finals) for c in out.outputs]
        usage = _usage(prompts, [c for out in finals for c in out.outputs])
        return json_response(CompletionResponse(id=request_id, created=int(arrival),
                                                model=self.model_name, choices=choices,
                                                usage=usage))

    async def _prompts(self, prompt: str | list) -> list[_Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        for i, p in enumerate(prompt):
            param = "prompt" if len(prompt) == 1 else f"prompt.{i}"
            if isinstance(p, str):
                ids = await self.engine.encode(p)
                out.append(_Prompt(p, ids))
            else:
                out.append(_Prompt(None, list(p)))
            self.check_token_ids(out[-1].token_ids, param)
        return out

    def _echo_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.decode(prompt.token_ids)

    def _choice(self, req: CompletionRequest, index: int, prompt: _Prompt,
                out: RequestOutput, c: CompletionOutput, fmt: LogprobFormatter
                ) -> CompletionChoice:
        prefix = self._echo_text(prompt) if req.echo else ""
        logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobs()
            if req.echo:
                logprobs = fmt.completion(prompt.token_ids, _prompt_logprobs(out), 0)
            tail = fmt.completion(c.token_ids, c.logprobs or [], len(prefix))
            logprobs = _concat(logprobs, tail)
        return CompletionChoice(index=index, text=prefix + c.text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    async def _stream(self, req: CompletionRequest, request_id: str, created: int,
                      prompts: list[_Prompt], streams: list, fmt: LogprobFormatter
                      ) -> AsyncIterator[str]:
        offsets: dict[int, int] = {}  # choice -> characters sent
        finished: set[int] = set()
        last: dict[int, CompletionOutput] = {}
        try:
            async for i, out in merge_streams(streams):
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in finished:
                        continue
                    last[index] = c
                    text, logprobs = c.delta_text, None
                    if req.logprobs is not None:
                        logprobs = CompletionLogprobs()
                    if req.echo and index not in offsets:
                        text = self._echo_text(prompts[i]) + text
                        if logprobs is not None:
                            logprobs = fmt.completion(prompts[i].token_ids,
                                                      _prompt_logprobs(out), 0)
                    if logprobs is not None:
                        start = offsets.get(index, 0) + len(text) - len(c.delta_text)
                        logprobs = _concat(logprobs, fmt.completion(
                            c.delta_token_ids, c.delta_logprobs or [], start))
                    if not text and not c.delta_token_ids and not c.finished():
                        continue
                    offsets[index] = offsets.get(index, 0) + len(text)
                    if c.finished():
                        finished.add(index)
                    yield sse(CompletionResponse(
                        id=request_id, created=created, model=self.model_name,
                        choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                                  finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason)]))
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse(CompletionResponse(id=request_id, created=created,
                                             model=self.model_name, choices=[],
                                             usage=_usage(prompts, list(last.values()))))
        except Exception as e:  # the engine died or the server is draining: say so, in-band
            yield sse_error(e)
        yield "data: [DONE]\n\n"


def _prompt_logprobs(out: RequestOutput) -> list:
    lps = list(out.prompt_logprobs or [])
    return lps + [None] * (len(out.prompt_token_ids) - len(lps))


def _concat(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs,
                              tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)


def _usage(prompts: list[_Prompt], completions: list[CompletionOutput]) -> UsageInfo:
    prompt_tokens = sum(len(p.token_ids) for p in prompts)
    completion_tokens = sum(len(c.token_ids) for c in completions)
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)
