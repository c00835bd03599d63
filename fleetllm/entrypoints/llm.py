"""LLM: the offline API. `LLM(model, **engine_kwargs).generate(prompts, sampling_params)`,
and `.chat(messages)` with the tokenizer's chat template, as in vLLM; for a pooling model
(task="embed"), `.embed(prompts)`, `.encode(prompts)` and `.score(text_1, text_2)`."""

from __future__ import annotations

import itertools
import logging
import re
import time
from collections.abc import Sequence
from typing import Any

from fleetllm.engine.llm_engine import LLMEngine, PromptType
from fleetllm.engine.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from fleetllm.errors import ConfigurationError, EngineShutdownError, InvalidRequestError
from fleetllm.lora.request import LoRARequest
from fleetllm.pooling_params import PoolingParams
from fleetllm.progress import ProgressBar
from fleetllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
Conversation = Sequence[dict[str, Any]]


class LLM:
    """Generate from a local Hugging Face checkpoint directory.

    Keyword arguments are EngineConfig.from_kwargs's, with vLLM's names:
    tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, dtype,
    block_size, seed, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory,
    swap_space, preemption_mode, load_format, device, ... vLLM arguments that mean nothing
    here (enforce_eager, trust_remote_code, ...) are accepted with a warning; unsupported ones
    that would change results (quantization, ...) raise ConfigurationError.
    """

    def __init__(self, model: str, **engine_kwargs: Any):
        self.llm_engine = LLMEngine.from_engine_args(str(model), **engine_kwargs)
        self._request_ids = itertools.count()
        self._is_shutdown = False

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None, *,
                 prompt_token_ids: list[int] | list[list[int]] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt the
        engine rejects (e.g. longer than max_model_len) gets an output with finish_reason
        "error" and the reason in `.error`; the others still complete.

        `prompt_token_ids` is vLLM's older keyword: one list of token ids, or a list of them;
        with `prompts` as well, those strings are the outputs' prompt text.

        `lora_request` (enable_lora): one LoRARequest for every prompt, or one per prompt
        (None: the base model)."""
        self._check_task(pooling=False)
        prompts = _prompt_list(prompts, prompt_token_ids)
        if isinstance(lora_request, list | tuple):
            if len(lora_request) != len(prompts):
                raise InvalidRequestError(f"{len(lora_request)} lora_requests for "
                                          f"{len(prompts)} prompts; pass one, or one each")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        return self._run_all(prompts, _params_list(sampling_params, SamplingParams, prompts),
                             use_tqdm, RequestOutput, loras)

    def encode(self, prompts: PromptType | Sequence[PromptType] | None = None,
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True, *,
               prompt_token_ids: list[int] | list[list[int]] | None = None
               ) -> list[PoolingRequestOutput]:
        """Pool every prompt (a pooling model, task="embed"): `.outputs.data` is the vector, a
        float32 tensor. Rejected prompts (too long, ...) get an output with `.error`, data
        None; the others still complete. Outputs come back in input order."""
        self._check_task(pooling=True)
        prompts = _prompt_list(prompts, prompt_token_ids)
        return self._run_all(prompts, _params_list(pooling_params, PoolingParams, prompts),
                             use_tqdm, PoolingRequestOutput)

    def embed(self, prompts: PromptType | Sequence[PromptType] | None = None,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = True, *,
              prompt_token_ids: list[int] | list[list[int]] | None = None
              ) -> list[EmbeddingRequestOutput]:
        """encode(), with each vector as a list of floats in `.outputs.embedding`."""
        return [EmbeddingRequestOutput.from_base(out) for out in self.encode(
            prompts, pooling_params, use_tqdm, prompt_token_ids=prompt_token_ids)]

    def score(self, text_1: PromptType | Sequence[PromptType],
              text_2: PromptType | Sequence[PromptType], use_tqdm: bool = True
              ) -> list[ScoringRequestOutput]:
        """Cosine similarity of embeddings: one text against each of text_2 (1:N), or pair by
        pair (N:N). Raises InvalidRequestError when an input cannot be embedded."""
        first, second = _prompt_list(text_1, None), _prompt_list(text_2, None)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second) or not second:
            raise InvalidRequestError(f"score: {len(first)} first texts for {len(second)} "
                                      "second texts; pass one, or as many as the second")
        outs = self.encode(first + second, use_tqdm=use_tqdm)
        for out in outs:
            if out.error:
                raise InvalidRequestError(f"score: {out.error}")
        results = []
        for i, (a, b) in enumerate(zip(outs[:len(first)], outs[len(first):], strict=True)):
            cosine = float(a.outputs.data.double().dot(b.outputs.data.double()) / (
                a.outputs.data.double().norm() * b.outputs.data.double().norm()))
            results.append(ScoringRequestOutput(str(i), ScoringOutput(cosine),
                                                a.prompt_token_ids + b.prompt_token_ids))
        return results

    def _check_task(self, pooling: bool) -> None:
        self._check_not_shut_down()
        if self.llm_engine.model_config.is_pooling != pooling:
            raise InvalidRequestError(
                "this model is a pooling model (task='embed'): use embed(), encode() or "
                "score()" if not pooling else "this model generates (task='generate'): "
                "embed(), encode() and score() need a pooling model, loaded with task='embed'")

    def _run_all(self, prompts: list[PromptType], params_list: list[Any], use_tqdm: bool,
                 kind: type, loras: list[LoRARequest | None] | None = None) -> list[Any]:
        """Add every request (a rejected one gets kind.rejected(...)), run them to the end,
        return the outputs in input order."""
        engine = self.llm_engine
        results: dict[str, Any] = {}
        order = []
        loras = loras or [None] * len(prompts)
        for prompt, params, lora in zip(prompts, params_list, loras, strict=True):
            request_id = str(next(self._request_ids))
            order.append(request_id)
            try:
                engine.add_request(request_id, prompt, params, lora_request=lora)
            except InvalidRequestError as e:
                # Reported in the output's .error (the CLI prints it): logging it as well
                # would show the same error twice.
                logger.debug("request %s rejected: %s", request_id, e)
                text = prompt.get("prompt") if isinstance(prompt, dict) else (
                    prompt if isinstance(prompt, str) else None)
                ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else []
                results[request_id] = kind.rejected(request_id, text, list(ids), str(e))
        try:
            self._run(results, len(order), use_tqdm)
        except BaseException:
            engine.abort_request([r for r in order if r not in results])
            raise
        return [results[r] for r in order]

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations ([{"role": ..., "content": ...}, ...]) rendered
        with the tokenizer's chat template, or `chat_template` (a Jinja string); vLLM's
        arguments, in vLLM's order. One conversation gives a list of one output; a list of
        them, one output each. `lora_request` as for generate(). A message's content is a
        string or a list of {"type": "text", "text": ...} parts; the template sees a string
        (parts joined by newlines: chat_template_content_format "string") or a list of parts
        ("openai"); "auto" picks "openai" for a template that loops over a message's
        content. `continue_final_message` continues the last (assistant) message instead of
        starting a reply; `tools` and `chat_template_kwargs` reach the template."""
        self._check_not_shut_down()
        tokenizer = self.get_tokenizer()
        model = self.llm_engine.model_config.model
        if tokenizer is None:
            raise InvalidRequestError(f"chat needs a tokenizer and {model} has none")
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigurationError(f"chat_template: the tokenizer of {model} has none; pass "
                                     "chat_template=<a Jinja template string>")
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message: continuing the final message "
                                      "and add_generation_prompt cannot both be True")
        if mm_processor_kwargs:
            raise InvalidRequestError("mm_processor_kwargs: fleetllm serves text-only models")
        content_format = _content_format(chat_template_content_format, template)
        one = not messages or not isinstance(messages[0], list | tuple)
        conversations = [messages] if one else list(messages)
        from jinja2 import TemplateError

        prompts: list[PromptType] = []
        for conversation in conversations:
            try:
                text = tokenizer.apply_chat_template(
                    [_template_message(m, content_format) for m in conversation],
                    chat_template=chat_template, tokenize=False, tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    continue_final_message=continue_final_message,
                    **(chat_template_kwargs or {}))
            except (TemplateError, ValueError, TypeError, KeyError) as e:
                raise InvalidRequestError(f"the chat template cannot render this "
                                          f"conversation: {e}") from e
            # The template writes the special tokens it wants (BOS, role markers): encoding
            # must not add a second BOS, as vLLM's chat does not.
            prompts.append({"prompt": text, "prompt_token_ids":
                            tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, results: dict[str, Any], total: int, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = ProgressBar(total=total, desc="Processed prompts", dynamic_ncols=True,
                          disable=not use_tqdm)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        bar.update(len(results))
        while engine.has_unfinished_requests():
            for output in engine.step(finished_only=True):  # no per-step copies of histories
                if output.finished and output.request_id not in results:
                    results[output.request_id] = output
                    in_tokens += len(output.prompt_token_ids)
                    elapsed = time.perf_counter() - start
                    if isinstance(output, PoolingRequestOutput):
                        bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s")
                    else:
                        out_tokens += sum(len(o.token_ids) for o in output.outputs)
                        bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, "
                                            f"output: {out_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()

    # vLLM's LoRA management on LLM (its llm_engine's)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.llm_engine.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.llm_engine.remove_lora(lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return self.llm_engine.pin_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.llm_engine.list_loras()

    def shutdown(self) -> None:
        """Stop the workers now. Dropping the last reference to the LLM does the same (the
        executor, which owns the workers, cleans up when it is collected). Later calls raise
        EngineShutdownError."""
        self._is_shutdown = True
        self.llm_engine.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free memory until wake_up(): level 1 the KV cache (on an accelerator the weights
        move to host memory too), level 2 the KV cache and the weights. generate() raises
        EngineSleepingError meanwhile. A second sleep is a no-op."""
        self._check_not_shut_down()
        self.llm_engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore "weights", "kv_cache" or both (None, the default): the KV cache with the
        same number of blocks, level-2 weights loaded again from the checkpoint. Outputs are
        the same as before sleeping. Waking what is awake is a no-op."""
        self._check_not_shut_down()
        self.llm_engine.wake_up(tags)

    def _check_not_shut_down(self) -> None:
        if self._is_shutdown:
            raise EngineShutdownError("this LLM was shut down; create a new LLM to generate "
                                      "again")

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


CONTENT_FORMATS = ("auto", "string", "openai")
# A template that iterates over a message's content wants it as a list of parts.
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\S*?(\[\s*['\"]content['\"]\s*\]|"
                                 r"\.content\b)")


def _content_format(requested: str, template: str) -> str:
    if requested not in CONTENT_FORMATS:
        raise InvalidRequestError(f"chat_template_content_format: must be one of "
                                  f"{', '.join(CONTENT_FORMATS)}, got {requested!r}")
    if requested != "auto":
        return requested
    return "openai" if _LOOPS_OVER_CONTENT.search(template) else "string"


def _template_message(message: Any, content_format: str) -> dict[str, Any]:
    """A message as the template reads it: its content a string ("string": text parts joined
    by newlines, as vLLM does) or a list of text parts ("openai")."""
    if not isinstance(message, dict):
        raise InvalidRequestError(f"a chat message is a dict with 'role' and 'content', got "
                                  f"{type(message).__name__}")
    content = message.get("content")
    if isinstance(content, list | tuple):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise InvalidRequestError("a message's content parts must be {'type': "
                                          "'text', 'text': str} (fleetllm serves text-only "
                                          f"models), got {part!r:.80}")
            parts.append({"type": "text", "text": part["text"]})
        content = parts if content_format == "openai" else "\n".join(p["text"] for p in parts)
    elif isinstance(content, str) and content_format == "openai":
        content = [{"type": "text", "text": content}]
    return {**message, "content": content}


def _params_list(params: Any, kind: type, prompts: list[PromptType]) -> list[Any]:
    """One params object per prompt: the default, one for all, or a list of as many."""
    if params is None:
        params = kind()
    if isinstance(params, kind):
        return [params] * len(prompts)
    try:
        params_list = list(params)
    except TypeError:
        raise InvalidRequestError(f"expected {kind.__name__} or a list of them, got "
                                  f"{type(params).__name__}") from None
    if len(params_list) != len(prompts):
        raise InvalidRequestError(f"{len(params_list)} {kind.__name__} for {len(prompts)} "
                                  "prompts")
    return params_list


def _prompt_list(prompts: PromptType | Sequence[PromptType] | None,
                 prompt_token_ids: list[int] | list[list[int]] | None) -> list[PromptType]:
    """generate()'s prompts as a list, from `prompts`, vLLM's `prompt_token_ids`, or both."""
    if prompt_token_ids is None:
        if prompts is None:
            raise InvalidRequestError("generate() needs prompts or prompt_token_ids")
        return [prompts] if isinstance(prompts, str | dict) else list(prompts)
    ids = list(prompt_token_ids)
    if ids and not isinstance(ids[0], list | tuple):  # one prompt's ids
        ids = [ids]
    if prompts is None:
        return [{"prompt_token_ids": list(p)} for p in ids]
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    if len(texts) != len(ids) or not all(isinstance(t, str) for t in texts):
        raise InvalidRequestError(f"with prompt_token_ids, prompts must be as many strings "
                                  f"({len(ids)}); got {len(texts)} prompts")
    return [{"prompt": t, "prompt_token_ids": list(p)} for t, p in zip(texts, ids, strict=True)]
