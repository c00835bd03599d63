"""POST /v1/embeddings: one engine request per input, all added at once (the engine batches
them), answered in OpenAI's shape.

Inputs: a string, a list of strings, token ids, or a list of token-id lists (at most
MAX_EMBEDDING_INPUTS); text is tokenized in one call on the tokenizer thread. Each vector is
sent as floats, or with `encoding_format: "base64"` as base64 of its little-endian float32
bytes (what OpenAI's client asks for by default and decodes with np.frombuffer).
Refused with a 400 before the engine sees anything: a server without an embedding model, no
input or an empty one, token ids outside the vocabulary, an input over max_model_len (unless
`truncate_prompt_tokens` cuts it), `dimensions` the model was not trained for
(ModelConfig.check_dimensions). The engine refuses an input over its token budget (400).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from fastapi import Request
from starlette.responses import Response

from fleetllm.engine.async_engine import RequestStream
from fleetllm.engine.outputs import PoolingRequestOutput
from fleetllm.entrypoints.openai.body_checks import until_disconnected
from fleetllm.entrypoints.openai.errors import APIError
from fleetllm.entrypoints.openai.protocol import (
    MAX_EMBEDDING_INPUTS,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from fleetllm.entrypoints.openai.serving_engine import (
    OpenAIServing,
    json_response,
    request_ids,
)
from fleetllm.entrypoints.openai.streams import ClientDisconnected, collect_final
from fleetllm.errors import ConfigurationError, InvalidRequestError
from fleetllm.pooling_params import PoolingParams

_MARGIN = 64  # tokens kept past truncate_prompt_tokens when only a text's end is tokenized


class ServingEmbedding(OpenAIServing):
    endpoint = "/v1/embeddings"
    needs_task = "embed"

    async def create(self, req: EmbeddingRequest, raw: Request) -> Response:
        arrival = time.time()
        lora_request = self.check_model(req.model)
        self.check_task()
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        except ConfigurationError as e:  # the model already bounds these; kept for safety
            raise APIError(400, str(e).removeprefix(f"[{e.code}] ")) from None
        try:
            self.engine.model_config.check_dimensions(req.dimensions)  # the engine's rule
        except InvalidRequestError as e:
            raise APIError(400, str(e).removeprefix(f"[{e.code}] "), "dimensions") from None
        response_id, engine_id = request_ids(raw, "embd")

        async def prepare() -> tuple[list[dict[str, Any]], list[RequestStream]]:
            prompts = await self._prompts(req)
            return prompts, await self.start(engine_id, [(p, params) for p in prompts],
                                             arrival, lora_request,
                                             {"prompt": "input", "lora_request": "model"})

        try:  # a client that leaves while its inputs are tokenized and added stops both
            prompts, streams = await until_disconnected(prepare(), raw)
        except ClientDisconnected:
            return Response(status_code=499)
        try:
            finals: list[PoolingRequestOutput] = await collect_final(streams, raw)
        except ClientDisconnected:
            return Response(status_code=499)
        data = [EmbeddingData(index=i, embedding=_encoded(out.outputs.data,
                                                          req.encoding_format))
                for i, out in enumerate(finals)]
        tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        return json_response(EmbeddingResponse(
            id=response_id, created=int(arrival), model=self.models.model_name(lora_request),
            data=data,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens)))

    async def _prompts(self, req: EmbeddingRequest) -> list[dict[str, Any]]:
        """Each input as an engine prompt with its token ids, checked and truncated."""
        inputs: list = [req.input] if isinstance(req.input, str) else req.input
        if not inputs:
            raise APIError(400, "input: must not be empty", "input")
        if isinstance(inputs[0], int):
            inputs = [inputs]
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, "
                           f"got {len(inputs)}", "input")
        self.check_prompt_count(len(inputs), 1, "input")
        texts = [x for x in inputs if isinstance(x, str)]
        if texts and self.tokenizer is None:
            raise APIError(400, "input: this model has no tokenizer: send token ids", "input")
        keep = self._truncation(req.truncate_prompt_tokens)
        texts = [self._bounded(t, keep, "input" if len(inputs) == 1 else f"input.{i}")
                 for i, t in enumerate(inputs) if isinstance(t, str)]
        encoded = iter(await self.engine.run_in_tokenizer_thread(
            lambda: [self.tokenizer.encode(t, add_special_tokens=req.add_special_tokens)
                     for t in texts]) if texts else [])
        prompts = []
        for i, x in enumerate(inputs):
            param = "input" if len(inputs) == 1 else f"input.{i}"
            text, ids = (x, next(encoded)) if isinstance(x, str) else (None, list(x))
            if keep is not None:
                ids = ids[-keep:]  # vLLM keeps the end of an input
            self.check_token_ids(ids, param)
            if len(ids) > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is "
                               f"{self.max_model_len} tokens. However, {param} has {len(ids)} "
                               f"tokens. Please reduce the length of the input, or set "
                               f"truncate_prompt_tokens.", param)
            prompts.append({"prompt": text, "prompt_token_ids": ids} if text is not None
                           else {"prompt_token_ids": ids})
        return prompts

    def _bounded(self, text: str, keep: int | None, param: str) -> str:
        """The text to tokenize: all of it (refused past what max_model_len tokens can
        spell, TextBound), or with truncation to the last `keep` tokens only its end, long
        enough to hold `keep` + _MARGIN tokens (each token spells at most `longest`
        characters): the margin's tokens, where the cut may split a word, are dropped."""
        limit = self.text_bound.max_chars
        if keep is None or limit is None:
            self.text_bound.check(text, param)
            return text
        tail = (keep + _MARGIN) * (limit // self.max_model_len)
        return text[-tail:] if len(text) > tail else text

    def _truncation(self, value: int | None) -> int | None:
        """How many tokens of each input to keep (None: all)."""
        if value is None:
            return None
        if value == -1:
            return self.max_model_len
        if value == 0 or value > self.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens: must be -1 (the model's limit) or "
                           f"1 to max_model_len={self.max_model_len}, got {value}",
                           "truncate_prompt_tokens")
        return value


def _encoded(data: Any, encoding_format: str) -> list[float] | str:
    """A float32 vector as floats (each float32 exactly, as a JSON number), or base64 of its
    little-endian float32 bytes."""
    vector = data.detach().cpu().float()
    if encoding_format == "base64":
        raw = vector.numpy().astype("<f4", copy=False).tobytes()
        return base64.b64encode(raw).decode("ascii")
    return vector.tolist()

