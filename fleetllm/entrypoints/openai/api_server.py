"""The OpenAI-compatible app: build_app(engine, ...) -> a FastAPI app with these routes.

    GET /v1/models   POST /v1/completions   POST /v1/chat/completions   POST /v1/embeddings
    POST /tokenize   POST /detokenize   GET /version   GET /health   GET /metrics
    POST /sleep, /wake_up, GET /is_sleeping                 (with enable_sleep_mode)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter     (with allow_runtime_lora_updating)

A request's `model` is a served name or a LoRA adapter's (app.state.models). Bodies are parsed
by hand (serving_engine.parse_body), so a bad body is a 400 in OpenAI's error shape like any
error. Middleware, outermost first: CORS, X-Request-Id, the gate (API key, drain). A server
runs its model's task; the other task's endpoints answer a 400 naming it. /health is 503 when
the engine is dead or wedged or the server drains. launcher.py serves the app with uvicorn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse, Response

import fleetllm
from fleetllm.engine.async_engine import AsyncLLMEngine
from fleetllm.entrypoints.openai.cli_args import LoRAModulePath
from fleetllm.entrypoints.openai.errors import (
    api_error_from,
    error_response,
    install_error_handlers,
)
from fleetllm.entrypoints.openai.gate import RequestIdHeaders, ServerGate, ServerState
from fleetllm.entrypoints.openai.metrics import PrometheusMetrics
from fleetllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from fleetllm.entrypoints.openai.serving_chat import ServingChat
from fleetllm.entrypoints.openai.serving_completion import ServingCompletion
from fleetllm.entrypoints.openai.serving_embedding import ServingEmbedding
from fleetllm.entrypoints.openai.serving_engine import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    json_response,
    parse_body,
)
from fleetllm.entrypoints.openai.serving_models import ServingModels
from fleetllm.entrypoints.openai.serving_tokenization import ServingTokenization
from fleetllm.entrypoints.openai.tool_parsers import get_tool_parser
from fleetllm.errors import ConfigurationError

T = TypeVar("T")


@dataclass
class HTTPOptions:
    """CORS and request-id headers (vLLM's flags and defaults)."""

    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    enable_request_id_headers: bool = False


def build_app(engine: AsyncLLMEngine, served_model_names: list[str] | None = None,
              api_key: str | None = None, chat_template: str | None = None,
              state: ServerState | None = None, enable_sleep_mode: bool = False,
              http: HTTPOptions | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None,
              lora_modules: list[LoRAModulePath] | None = None,
              allow_runtime_lora_updating: bool = False,
              max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST) -> FastAPI:
    """`enable_auto_tool_choice` + `tool_call_parser` (a TOOL_PARSERS name): chat requests
    with tools may leave the choice to the model (tool_choice "auto"), and the parser reads
    its calls; vLLM's flags and rule (one without the other is a ConfigurationError).
    `lora_modules`: the adapters served by name (with enable_lora; loaded by
    `await app.state.models.init_static_loras()`); `allow_runtime_lora_updating` adds
    /v1/load_lora_adapter and /v1/unload_lora_adapter. `max_prompts_per_request`: the most
    engine requests (prompts x n) one completion or embedding request may start."""
    http = http or HTTPOptions()
    if enable_auto_tool_choice and not tool_call_parser:
        raise ConfigurationError("--enable-auto-tool-choice needs --tool-call-parser")
    parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
    names = served_model_names or [engine.model_config.model]
    state = state or ServerState()
    lora_config = engine.config.lora_config
    metrics = PrometheusMetrics(names[0], max_loras=lora_config.max_loras
                                if lora_config is not None else None)
    engine.stat_loggers.append(metrics)
    models = ServingModels(engine, names, lora_modules)
    if max_prompts_per_request < 1:
        raise ConfigurationError(f"--max-prompts-per-request must be >= 1, got "
                                 f"{max_prompts_per_request}")
    completion = ServingCompletion(engine, names, chat_template, models,
                                   max_prompts_per_request=max_prompts_per_request)
    chat = ServingChat(engine, names, chat_template,
                       parser if enable_auto_tool_choice else None, models,
                       max_prompts_per_request=max_prompts_per_request)
    embedding = ServingEmbedding(engine, names, models=models,
                                 max_prompts_per_request=max_prompts_per_request)
    tokenization = ServingTokenization(engine, names, chat_template, models)

    app = FastAPI(title="fleetllm", version=fleetllm.__version__, openapi_url=None,
                  docs_url=None, redoc_url=None)
    app.state.server = state
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.models = models
    install_error_handlers(app)
    # Each add_middleware wraps what is there: the last added runs first. The gate answers
    # 401/503 before anything below reads the request.
    app.add_middleware(ServerGate, state=state, api_key=api_key)
    if http.enable_request_id_headers:
        app.add_middleware(RequestIdHeaders)
    app.add_middleware(CORSMiddleware, allow_origins=http.allowed_origins,
                       allow_methods=http.allowed_methods, allow_headers=http.allowed_headers,
                       allow_credentials=http.allow_credentials)

    @app.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_response(503, "the server is shutting down")
        try:
            engine.check_health()
            await asyncio.to_thread(engine.check_workers)
        except Exception as e:
            err = api_error_from(e)
            return error_response(503, err.message)
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(engine.load), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": fleetllm.__version__}

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(ModelList(data=models.cards()))

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _mapped(completion.create(await parse_body(raw, CompletionRequest), raw))

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await _mapped(chat.create(await parse_body(raw, ChatCompletionRequest), raw))

    @app.post("/v1/embeddings")
    async def embeddings(raw: Request) -> Response:
        return await _mapped(embedding.create(await parse_body(raw, EmbeddingRequest), raw))

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        return await _mapped(tokenization.tokenize(await parse_body(raw, TokenizeRequest)))

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        return await _mapped(tokenization.detokenize(await parse_body(raw, DetokenizeRequest)))

    if enable_sleep_mode:
        @app.post("/sleep")
        async def sleep(level: int = 1) -> Response:
            if level not in (1, 2):
                return error_response(400, "level: must be 1 or 2", "level")
            await _mapped(engine.sleep(level))
            return Response(status_code=200)

        @app.post("/wake_up")
        async def wake_up(raw: Request) -> Response:
            tags = raw.query_params.getlist("tags") or None
            if tags and not set(tags) <= {"weights", "kv_cache"}:
                return error_response(400, "tags: each is 'weights' or 'kv_cache'", "tags")
            await _mapped(engine.wake_up(tags))
            return Response(status_code=200)

        @app.get("/is_sleeping")
        async def is_sleeping() -> dict:
            return {"is_sleeping": engine.is_sleeping}

    if allow_runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(raw: Request) -> Response:
            body = await parse_body(raw, LoadLoRAAdapterRequest)
            return PlainTextResponse(await _mapped(models.load_lora_adapter(body)))

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(raw: Request) -> Response:
            body = await parse_body(raw, UnloadLoRAAdapterRequest)
            return PlainTextResponse(await _mapped(models.unload_lora_adapter(body)))

    return app


async def _mapped(call: Awaitable[T]) -> T:
    """Engine errors (dead: 503, rejected: 400) become APIErrors here, so that they are
    answered like any other error rather than reported as crashes of the app."""
    try:
        return await call
    except Exception as e:
        raise api_error_from(e) from None
