"""A request's constraint on its output, from whichever field asked for it: OpenAI's
`response_format`, vLLM's `structured_outputs` object or its older `guided_*` fields, or a
chat request's `tool_choice` ("required" or a named function: at most one whitespace
character per gap of its JSON). At most one per request; the engine compiles and enforces it
(fleetllm/structured_outputs, docs/structured_outputs.md)."""

from __future__ import annotations

import json
from typing import Any

from fleetllm.entrypoints.openai.errors import APIError, truncate
from fleetllm.entrypoints.openai.protocol import (
    ChatCompletionTool,
    NamedToolChoice,
    SamplingRequest,
)
from fleetllm.errors import ConfigurationError
from fleetllm.sampling_params import StructuredOutputsParams
from fleetllm.structured_outputs.backends import BACKENDS

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def structured_outputs_for(req: SamplingRequest, engine_backend: str | None,
                           tool_schema: dict[str, Any] | None = None
                           ) -> StructuredOutputsParams | None:
    """The request's StructuredOutputsParams (None: unconstrained); a 400 naming the fields
    when more than one constrains it, or naming the one that is malformed."""
    given: dict[str, dict[str, Any]] = {}  # request field -> StructuredOutputsParams kwargs
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given["response_format"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs json_schema.schema",
                           "response_format.json_schema")
        given["response_format"] = {"json": fmt.json_schema.json_schema}
    for field, kind in _GUIDED:
        if getattr(req, field) is not None:
            given[field] = {kind: getattr(req, field)}
    if req.structured_outputs is not None:
        fields = req.structured_outputs.model_dump(by_alias=True, exclude_defaults=True)
        given["structured_outputs"] = fields
    if tool_schema is not None:
        # At most one whitespace character per gap: up to MAX_JSON_WHITESPACE there let a
        # small model write newlines until max_tokens instead of its call. Not none at all:
        # a model that ends a number with a newline would then write digits for ever.
        given["tool_choice"] = {"json": tool_schema, "json_whitespace_limit": 1}
    if req.guided_decoding_backend is not None:
        _check_backend(req.guided_decoding_backend, engine_backend)
    if not given:
        return None
    if len(given) > 1:
        names = list(given)
        raise APIError(400, f"{', '.join(names)}: a request takes one constraint on its output "
                       f"(response_format, structured_outputs, guided_json, guided_regex, "
                       f"guided_choice, guided_grammar, or tool_choice with tools), got "
                       f"{len(names)}", names[1])
    [(field, kwargs)] = given.items()
    if isinstance(kwargs.get("json"), str):  # schema text: say where it is broken now
        try:
            json.loads(kwargs["json"])
        except ValueError as e:
            raise APIError(400, f"{field}: the JSON schema is not valid JSON: {e}",
                           field) from None
    try:
        return StructuredOutputsParams(**kwargs)
    except ConfigurationError as e:
        message = str(e).removeprefix(f"[{e.code}] ")
        raise APIError(400, f"{field}: {truncate(message, 300)}", field) from None


def _check_backend(asked: str, engine_backend: str | None) -> None:
    """vLLM's per-request backend: a request cannot switch the engine's (vLLM refuses it
    too); naming the engine's, or "auto", is fine."""
    if asked not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend: {truncate(asked, 50)!r} is not one of "
                       f"{', '.join(BACKENDS)}", "guided_decoding_backend")
    if asked != "auto" and engine_backend not in (None, "auto", asked):
        raise APIError(400, f"guided_decoding_backend: this server compiles grammars with "
                       f"{engine_backend} (--structured-outputs-backend); a request cannot "
                       f"choose {asked}", "guided_decoding_backend")


def parameters_schema(tool: ChatCompletionTool) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def required_tools_schema(tools: list[ChatCompletionTool]) -> dict[str, Any]:
    """tool_choice "required": a JSON array of one or more {"name", "parameters"} calls, each
    one of the tools with its parameters' schema (vLLM's schema; the tools' $defs hoisted to
    the top, where their "#/$defs/..." references point)."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        params = dict(parameters_schema(tool))
        defs.update(params.pop("$defs", {}))
        options.append({"properties": {"name": {"type": "string",
                                                "enum": [tool.function.name]},
                                       "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": {"type": "object", "anyOf": options}}
    if defs:
        schema["$defs"] = defs
    return schema


def named_tool(req_tools: list[ChatCompletionTool] | None, choice: NamedToolChoice
               ) -> ChatCompletionTool:
    name = choice.function.name
    for tool in req_tools or []:
        if tool.function.name == name:
            return tool
    raise APIError(400, f"tool_choice: the function {truncate(name, 64)!r} is not in tools",
                   "tool_choice")
