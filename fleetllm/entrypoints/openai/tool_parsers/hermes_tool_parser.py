"""Hermes-style tool calls (Hermes 2/3, Qwen2.5/3): `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks; the text before the first one is the message's content."""

from __future__ import annotations

import json
import re

from fleetllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolCallText,
    ToolParser,
    arguments_json,
    held_back,
)

START, END = "<tool_call>", "</tool_call>"
# A block runs to its end tag, or to the end of the text (a model may stop before the tag).
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    name = "hermes"
    special_tokens = (START, END)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        if START not in text:
            return ExtractedToolCalls(False, content=text)
        calls = []
        try:
            for body in _BLOCK.findall(text):
                call = json.loads(body)
                name, args = call["name"], call.get("arguments", {})
                if not isinstance(name, str):
                    raise TypeError("name")
                calls.append(ToolCallText(name, arguments_json(args)))
        except (ValueError, TypeError, KeyError):  # not a call after all: all of it is text
            return ExtractedToolCalls(False, content=text)
        # vLLM's rule, which a stream can follow too: the content is what precedes the calls.
        content = text[:text.find(START)]
        return ExtractedToolCalls(True, calls, content or None)

    def split_stream(self, text: str, final: bool) -> tuple[str, int | None]:
        start = text.find(START)
        if start < 0:
            return (text if final else held_back(text, START)), None
        # The tags hold no JSON characters, so the blocks read as a row of objects.
        return text[:start], start
