"""LLM: the offline API. `LLM(model, **engine_kwargs).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from fleetllm.engine.llm_engine import LLMEngine, PromptType
from fleetllm.engine.outputs import RequestOutput
from fleetllm.errors import InvalidRequestError
from fleetllm.progress import ProgressBar
from fleetllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    """Generate from a local Hugging Face checkpoint directory.

    Keyword arguments are EngineConfig.from_kwargs's, with vLLM's names:
    tensor_parallel_size, pipeline_parallel_size, distributed_executor_backend, dtype,
    block_size, seed, max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory,
    swap_space, preemption_mode, load_format, device, ...
    """

    def __init__(self, model: str, **engine_kwargs: Any):
        self.llm_engine = LLMEngine.from_engine_args(str(model), **engine_kwargs)
        self._request_ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. A prompt the
        engine rejects (e.g. longer than max_model_len) gets an output with finish_reason
        "error" and the reason in `.error`; the others still complete."""
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"{len(params_list)} sampling_params for "
                                          f"{len(prompts)} prompts")
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, params in zip(prompts, params_list, strict=True):
            request_id = str(next(self._request_ids))
            order.append(request_id)
            try:
                engine.add_request(request_id, prompt, params)
            except InvalidRequestError as e:
                logger.warning("request %s rejected: %s", request_id, e)
                text = prompt if isinstance(prompt, str) else None
                ids = prompt.get("prompt_token_ids", []) if isinstance(prompt, dict) else []
                results[request_id] = RequestOutput.rejected(request_id, text, list(ids), str(e))
        try:
            self._run(results, len(order), use_tqdm)
        except BaseException:
            engine.abort_request([r for r in order if r not in results])
            raise
        return [results[r] for r in order]

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm: bool) -> None:
        engine = self.llm_engine
        bar = ProgressBar(total=total, desc="Processed prompts", dynamic_ncols=True,
                          disable=not use_tqdm)
        start, in_tokens, out_tokens = time.perf_counter(), 0, 0
        bar.update(len(results))
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished and output.request_id not in results:
                    results[output.request_id] = output
                    in_tokens += len(output.prompt_token_ids)
                    out_tokens += sum(len(o.token_ids) for o in output.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tokens / elapsed:.1f} toks/s, "
                                        f"output: {out_tokens / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()

    def shutdown(self) -> None:
        """Stop the workers now. Dropping the last reference to the LLM does the same (the
        executor, which owns the workers, cleans up when it is collected)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
