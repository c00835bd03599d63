"""What a tool-call parser is (vLLM's ToolParser, smaller): it reads the calls a model wrote
in its output text, whole (extract_tool_calls) or while the text grows (split_stream, which
ToolCallStreamer turns into OpenAI's stream deltas)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from fleetllm.entrypoints.openai.tool_parsers.json_scan import (
    complete_string,
    member_text,
    object_members,
)


@dataclass
class ToolCallText:
    """One call as far as it is known: its name once complete, its arguments' JSON text."""

    name: str | None
    arguments: str = ""


@dataclass
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCallText] = field(default_factory=list)
    content: str | None = None


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments_json(value: object) -> str:
    """Arguments as OpenAI sends them: a JSON string (vLLM's json.dumps, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


def calls_in(text: str, depth: int, args_keys: tuple[str, ...]) -> list[ToolCallText]:
    """The calls in JSON text that may still be growing: objects at `depth` with a "name"
    and their arguments under the first of `args_keys` that is present."""
    calls = []
    for members in object_members(text, depth):
        args = next((a for k in args_keys if (a := member_text(text, members, k)) is not None),
                    "")
        calls.append(ToolCallText(complete_string(text, members, "name"), args))
    return calls


class ToolParser:
    name = ""
    # Tokens the parser reads in the text: they must not be skipped as special tokens.
    special_tokens: tuple[str, ...] = ()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def split_stream(self, text: str, final: bool) -> tuple[str, list[ToolCallText]]:
        """(the content so far, never taken back later; the calls so far). Until `final`,
        text that may still turn out to start a call is held back from the content."""
        raise NotImplementedError


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (decided by later text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text
