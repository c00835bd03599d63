"""What a tool-call parser is (vLLM's ToolParser, smaller): it reads the calls a model wrote
in its output text, whole (extract_tool_calls) or while the text grows (split_stream, which
ToolCallStreamer turns into OpenAI's stream deltas)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from fleetllm.entrypoints.openai.tool_parsers.json_scan import MemberScanner


@dataclass
class ToolCallText:
    """One call as far as it is known: its name once complete, its arguments' JSON text."""

    name: str | None
    arguments: str = ""
    done: bool = False  # the arguments are complete


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


class CallScanner:
    """The calls in JSON text that grows: objects at `depth` with a "name" and their
    arguments under the first of `args_keys` present."""

    def __init__(self, depth: int, args_keys: tuple[str, ...]):
        self.scanner = MemberScanner(depth)
        self.args_keys = args_keys

    def feed(self, chunk: str, first: int = 0) -> list[ToolCallText]:
        """The calls from index `first` on (the earlier ones are done and sent: reading
        them again would make a long stream quadratic)."""
        s = self.scanner
        s.feed(chunk)
        calls = []
        for members in s.objects[first:]:
            key = next((k for k in self.args_keys if k in members), None)
            args = "" if key is None else s.member_text(members, key) or ""
            done = key is not None and members[key][1] is not None
            calls.append(ToolCallText(s.complete_string(members, "name"), args, done))
        return calls


class ToolParser:
    name = ""
    # Tokens the parser reads in the text: they must not be skipped as special tokens.
    special_tokens: tuple[str, ...] = ()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    # Where the calls are, for a stream: objects at this depth of the JSON after
    # split_stream's offset, their arguments under the first of these keys present.
    calls_depth = 1
    args_keys: tuple[str, ...] = ("arguments",)

    def split_stream(self, text: str, final: bool) -> tuple[str, int | None]:
        """(the content so far, never taken back later; where the calls' JSON starts, or
        None while there are no calls). Until `final`, text that may still turn out to start
        a call is held back from the content. Once given, the offset never changes."""
        raise NotImplementedError


def held_back(text: str, marker: str) -> str:
    """`text` without a tail that could be the start of `marker` (decided by later text)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return text[:-n]
    return text
