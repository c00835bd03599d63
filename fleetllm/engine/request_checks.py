"""What LLMEngine.add_request checks before it queues anything: the prompt (tokenized, not
empty, within max_model_len and the vocabulary), the SamplingParams against the KV pool and
max_num_seqs, or the PoolingParams against the model's task and token budget. Each failure is
an InvalidRequestError that says why, its message led by the field at fault ("prompt: ...",
"stop_token_ids: ...": the error's `param`, which a server's 400 names), and nothing is
queued.

A mixin of LLMEngine (it reads the engine's tokenizer, config and scheduler): kept apart so
that the engine's request path reads on its own.
"""

from __future__ import annotations

import math
from typing import Any

from fleetllm.errors import InvalidRequestError
from fleetllm.pooling_params import PoolingParams
from fleetllm.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


class RequestChecksMixin:
    tokenizer: Any
    model_config: Any
    config: Any
    scheduler: Any

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise InvalidRequestError("a prompt is a string or {'prompt_token_ids': [...]}, "
                                      f"got {type(prompt).__name__}")
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.model_config.model} has no tokenizer: pass "
                                      "{'prompt_token_ids': [...]} instead of text")
        return prompt, self.tokenizer.encode(prompt)

    def _check_prompt(self, token_ids: list[int]) -> None:
        """What every request's prompt must be, generating or pooling."""
        n, limit = len(token_ids), self.model_config.max_model_len
        if n == 0:
            raise InvalidRequestError("prompt: the prompt is empty")
        if n > limit:
            raise InvalidRequestError(f"prompt: {n} tokens, more than max_model_len="
                                      f"{limit}; shorten it or raise max_model_len")
        self._check_in_vocab("prompt", token_ids)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        self._check_prompt(token_ids)
        n, limit = len(token_ids), self.model_config.max_model_len
        cc = self.config.cache_config
        if math.ceil(n / cc.block_size) > cc.num_gpu_blocks:
            raise InvalidRequestError(f"prompt: needs {math.ceil(n / cc.block_size)} KV "
                                      f"blocks but the whole pool has {cc.num_gpu_blocks}")
        if params.n > self.scheduler.config.max_num_seqs:
            raise InvalidRequestError(f"n: {params.n} samples can never run together with "
                                      f"max_num_seqs={self.scheduler.config.max_num_seqs}")
        # The n samples decode together, a token each per step: more than a step's token
        # budget could never be scheduled (the request would wait for ever).
        budget = self.config.scheduler_config.max_num_batched_tokens
        if params.n > budget:
            raise InvalidRequestError(f"n: {params.n} samples decode together, one token each "
                                      f"per step, but a step computes at most "
                                      f"max_num_batched_tokens={budget}: lower n or raise "
                                      f"max_num_batched_tokens")
        # Each sample, at the length it is certain to reach, holding its own blocks (as a
        # preempted group is recomputed): past the pool the scheduler would end it with
        # finish_reason "error" after it ran. Refused now instead, saying why.
        length = n + params.certain_tokens(limit - n)
        need = params.n * math.ceil(length / cc.block_size)
        if need > cc.num_gpu_blocks:
            raise InvalidRequestError(f"n: {params.n} samples of {length} tokens each need "
                                      f"{need} KV blocks of {cc.block_size} tokens, but the "
                                      f"whole pool has {cc.num_gpu_blocks}: lower n or "
                                      f"max_tokens")
        self._check_in_vocab("stop_token_ids", params.stop_token_ids)
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop: stop strings need a tokenizer; this model has "
                                      "none")

    def _pooling_params(self, params: SamplingParams | PoolingParams | None
                        ) -> PoolingParams | None:
        """The request's PoolingParams on a pooling model (default ones for None), None on a
        generating one; the other kind of params is refused, naming the task."""
        pooling_model = self.model_config.is_pooling
        if isinstance(params, PoolingParams) and not pooling_model:
            raise InvalidRequestError("this model generates (task='generate'): PoolingParams "
                                      "need a pooling model, loaded with task='embed'")
        if pooling_model and params is not None and not isinstance(params, PoolingParams):
            raise InvalidRequestError("this model is a pooling model (task='embed'): it "
                                      "embeds (PoolingParams, LLM.embed, /v1/embeddings) and "
                                      "cannot generate")
        return (params or PoolingParams()) if pooling_model else None

    def _validate_pooling(self, token_ids: list[int], params: PoolingParams) -> None:
        self._check_prompt(token_ids)
        n, budget = len(token_ids), self.config.scheduler_config.max_num_batched_tokens
        if n > budget:
            raise InvalidRequestError(f"prompt: {n} tokens; a pooling model runs each "
                                      f"input in one step, and max_num_batched_tokens={budget}")
        self.model_config.check_dimensions(params.dimensions)

    def _check_in_vocab(self, what: str, ids: list[int]) -> None:
        vocab = self.model_config.arch.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"{what}: token ids {bad[:5]} are outside the "
                                      f"vocabulary [0, {vocab})")
