"""POST /tokenize and /detokenize (vLLM's extensions): the server's own tokenizer and chat
template, so clients can count tokens exactly as the server will."""

from __future__ import annotations

from fleetllm.entrypoints.openai.errors import APIError
from fleetllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from fleetllm.entrypoints.openai.serving_engine import OpenAIServing


class ServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> dict:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of `prompt` and `messages`", "prompt")
        if req.messages is not None:
            _, ids = await self.render_chat(req.messages, req.add_generation_prompt,
                                            req.tools)
        else:
            self.text_bound.check(req.prompt or "", "prompt")
            ids = await self.engine.tokenize(req.prompt or "", req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, req: DetokenizeRequest) -> dict:
        self.check_model(req.model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        self.check_token_ids(req.tokens, "tokens", empty_ok=True)
        text = await self.engine.run_in_tokenizer_thread(self.decode, req.tokens)
        return {"prompt": text}
