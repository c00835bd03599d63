"""Llama 3.x JSON tool calls (vLLM's llama3_json): the output is `{"name": ...,
"parameters": {...}}` objects (or "arguments"), optionally after `<|python_tag|>`, separated
by ';'. Output that does not start that way is content."""

from __future__ import annotations

import json

from fleetllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolCallText,
    ToolParser,
    arguments_json,
)

PYTHON_TAG = "<|python_tag|>"
_ARGS = ("parameters", "arguments")


def _json_start(text: str) -> int | None:
    """Where the calls start: after the tag, or at a first '{'; None: the text is content."""
    start = len(text) - len(text.lstrip())
    if text.startswith(PYTHON_TAG, start):
        return start + len(PYTHON_TAG)
    return start if text.startswith("{", start) else None


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    special_tokens = (PYTHON_TAG,)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = _json_start(text)
        if start is None:
            return ExtractedToolCalls(False, content=text)
        part = text[start:]
        decoder = json.JSONDecoder()
        calls, i = [], 0
        try:
            while True:
                while i < len(part) and (part[i].isspace() or part[i] == ";"):
                    i += 1
                if i == len(part):
                    break
                call, i = decoder.raw_decode(part, i)
                key = next(k for k in _ARGS if k in call)
                if not isinstance(call["name"], str):
                    raise TypeError("name")
                calls.append(ToolCallText(call["name"], arguments_json(call[key])))
        except (ValueError, TypeError, KeyError, StopIteration):
            return ExtractedToolCalls(False, content=text)
        return ExtractedToolCalls(bool(calls), calls, None if calls else text)

    args_keys = _ARGS

    def split_stream(self, text: str, final: bool) -> tuple[str, int | None]:
        stripped = text.lstrip()
        if not final and (not stripped or PYTHON_TAG.startswith(stripped)):
            return "", None  # not decided yet
        start = _json_start(text)
        return (text, None) if start is None else ("", start)
