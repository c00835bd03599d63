"""What both asyncio fronts of an engine share: AsyncLLMEngine (the engine on a thread) and
core_client.EngineCoreClient (the engine in a process of its own).

AsyncEngineFront holds the caller-side API that does not depend on where the engine runs:
generate() and encode() stream one request's outputs from add_request()'s RequestStream, and
prompts are tokenized on a thread of their own, so a huge one never stalls the event loop.
The errors: EngineUnhealthyError (cannot serve now), EngineDeadError (for good; its cause
chained), RequestAbortedError (someone else aborted the request). A subclass provides
add_request() and the fields __init__ would: tokenizer, _tokenizer_pool, model_config,
_fatal (the error the engine died of) and _stopped.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fleetllm.engine.llm_engine import PromptType
from fleetllm.engine.outputs import PoolingRequestOutput, RequestOutput
from fleetllm.errors import EngineShutdownError, InvalidRequestError
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams


class EngineUnhealthyError(RuntimeError):
    """The engine cannot serve requests now (dead, or no step has completed in time)."""


class EngineDeadError(EngineUnhealthyError):
    """The engine loop stopped on an error (its __cause__); every request fails with this."""


class RequestAbortedError(RuntimeError):
    """The request was aborted by someone other than its consumer."""


class AsyncEngineFront:
    # Set by a subclass, which also defines add_request() (generate and encode use it).
    tokenizer: Any
    model_config: Any
    _tokenizer_pool: concurrent.futures.ThreadPoolExecutor
    _fatal: BaseException | None
    _stopped: bool

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, lora_request: LoRARequest | None = None,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (see async_engine's docstring), through the LoRA
        adapter `lora_request` when given (vLLM's argument order). Raises
        InvalidRequestError for a request the engine rejects, EngineDeadError when the
        engine dies."""
        stream = await self.add_request(request_id, prompt, sampling_params, arrival_time,
                                        lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams | None,
                     request_id: str, lora_request: LoRARequest | None = None,
                     arrival_time: float | None = None) -> AsyncIterator[PoolingRequestOutput]:
        """A pooling model's vector for the prompt: yields one finished PoolingRequestOutput
        (vLLM's AsyncLLMEngine.encode). Raises as generate() does; InvalidRequestError
        (naming the task) on a generating model."""
        stream = await self.add_request(request_id, prompt, pooling_params or PoolingParams(),
                                        arrival_time, lora_request)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    @property
    def errored(self) -> bool:
        return self._fatal is not None

    async def run_in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any,
                                      **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_pool,
                                          functools.partial(fn, *args, **kwargs))

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_config.model} has no tokenizer: pass "
                                      "token ids instead of text")
        return await self.run_in_tokenizer_thread(self.tokenizer.encode, text,
                                                  add_special_tokens=add_special_tokens)

    async def _tokenized(self, prompt: PromptType) -> PromptType:
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict) and "prompt_token_ids" not in prompt:
            text = prompt.get("prompt")
        if isinstance(text, str) and self.tokenizer is not None:
            return {"prompt": text, "prompt_token_ids": await self.tokenize(text)}
        return prompt  # token ids, or something the engine will reject with its message

    def _raise_if_unusable(self) -> None:
        if self._fatal is not None:
            raise EngineDeadError(f"the engine died: {self._fatal}") from self._fatal
        if self._stopped:
            raise EngineShutdownError("the engine is shut down")


def raise_if_wedged(busy_since: float | None, step_timeout_s: float) -> None:
    """EngineUnhealthyError when the engine call that started at busy_since (monotonic; None:
    none under way) has run past step_timeout_s."""
    if busy_since is not None and time.monotonic() - busy_since > step_timeout_s:
        raise EngineUnhealthyError(
            f"no engine step has completed for {time.monotonic() - busy_since:.1f} s "
            f"(limit {step_timeout_s:g} s)")


def dead_error(cause: BaseException) -> EngineDeadError:
    """The EngineDeadError every request fails with once the engine died of `cause`."""
    if isinstance(cause, EngineDeadError):  # the core client's own report of a dead core
        return cause
    err = EngineDeadError(f"the engine died: {cause}")
    err.__cause__ = cause
    return err


def settle(future: concurrent.futures.Future, error: BaseException | None = None,
           result: Any = None) -> None:
    """Complete a caller's future, unless its caller cancelled it meanwhile."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:  # cancelled by its caller meanwhile
        pass
