"""Tools in chat: what a request's `tools` + `tool_choice` ask for (ToolPlan), and the
assistant's answer read back as OpenAI's `tool_calls`, whole or streamed.

    "none"            no constraint, the text is content
    "auto"            no constraint; the server's --tool-call-parser reads calls out of the text
    "required"        the output is constrained to a JSON array of {"name", "parameters"} calls
    {"type": "function", "function": {"name": ...}}
                      the output is constrained to that function's parameters: the arguments
Both constraints allow at most one whitespace character per gap of the JSON: a call costs
about its content's tokens, never free whitespace a small model can fill until max_tokens.
A chat with tools answers finish_reason "tool_calls" when it made calls (vLLM does so for
"required" and named calls too).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from fleetllm.entrypoints.openai.errors import APIError
from fleetllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ToolCall,
)
from fleetllm.entrypoints.openai.structured_outputs import (
    named_tool,
    parameters_schema,
    required_tools_schema,
)
from fleetllm.entrypoints.openai.tool_parsers import ToolCallText, ToolParser
from fleetllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    CallScanner,
    arguments_json,
    tool_call_id,
)

AUTO_NEEDS_FLAGS = ('"auto" tool choice requires --enable-auto-tool-choice and '
                    '--tool-call-parser to be set')


@dataclass
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    schema: dict[str, Any] | None = None  # the constraint for "required" / "named"
    function: str | None = None  # the named function
    parser: ToolParser | None = None  # for "auto"
    parallel: bool = True  # False (parallel_tool_calls): only the first call is returned


def plan_tools(req: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """What `tools` and `tool_choice` ask for (vLLM's defaults and 400s)."""
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if req.tools else "none"
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none")
    if not req.tools:
        raise APIError(400, "tool_choice: needs tools (a non-empty list of functions)",
                       "tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = named_tool(req.tools, choice)
        return ToolPlan("named", parameters_schema(tool), tool.function.name)
    if choice == "required":
        return ToolPlan("required", required_tools_schema(req.tools), parallel=parallel)
    if auto_parser is None:
        raise APIError(400, AUTO_NEEDS_FLAGS, "tool_choice")
    return ToolPlan("auto", parser=auto_parser, parallel=parallel)


def template_message(m: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it. A replayed call's arguments go in as a dict, as
    transformers' templates expect (vLLM does the same); text that is not a JSON object
    stays a string."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.name:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for call in m.tool_calls:
            try:
                args: Any = json.loads(call.function.arguments)
            except ValueError:
                args = call.function.arguments
            calls.append({"id": call.id, "type": call.type, "function": {
                "name": call.function.name,
                "arguments": args if isinstance(args, dict) else call.function.arguments}})
        message["tool_calls"] = calls
    return message


def _tool_call(call: ToolCallText) -> ToolCall:
    return ToolCall(id=tool_call_id(), function=FunctionCall(name=call.name or "",
                                                             arguments=call.arguments))


def read_answer(plan: ToolPlan, text: str, finish_reason: str | None
                ) -> tuple[str | None, list[ToolCall] | None, str | None]:
    """(content, tool_calls, finish_reason) of a whole answer. Text that does not hold calls
    (an answer cut short by max_tokens, or "auto" choosing to talk) stays content."""
    calls: list[ToolCallText] = []
    content: str | None = text
    if plan.mode == "named":
        calls, content = [ToolCallText(plan.function, text)], None
    elif plan.mode == "required":
        try:
            calls = [ToolCallText(c["name"], arguments_json(c["parameters"]))
                     for c in json.loads(text)]
            content = None
        except (ValueError, TypeError, KeyError):
            calls = []
    elif plan.mode == "auto":
        assert plan.parser is not None
        found = plan.parser.extract_tool_calls(text)
        if found.tools_called:
            calls, content = found.tool_calls, found.content
    if not calls or (plan.mode != "auto" and finish_reason != "stop"):
        return text, None, finish_reason
    if not plan.parallel:
        calls = calls[:1]
    return content, [_tool_call(c) for c in calls], \
        "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass
class ToolCallStreamer:
    """One choice's stream: from its text so far, what is new in its content and calls.
    A call's first delta carries its index, id, type, name and the arguments so far; later
    ones the arguments' new text (OpenAI's shape)."""

    plan: ToolPlan
    text: str = ""
    content_sent: int = 0
    sent: list[int] = field(default_factory=list)  # per call: argument characters sent
    _scanner: CallScanner | None = None
    _scanned: int = 0  # how much of the text the scanner has read
    _done: int = 0  # calls before this one are complete and sent
    _split_at: int | None = None  # "auto": where the calls start, once they do
    _content: str = ""  # "auto": the content before them

    def feed(self, delta: str, final: bool) -> tuple[str, list[DeltaToolCall]]:
        self.text += delta
        content, calls = self._split(final)
        new_content = content[self.content_sent:]
        self.content_sent = len(content)
        deltas = []
        for index, call in enumerate(calls, self._done):
            if index > 0 and not self.plan.parallel:
                break
            if call.name is None:
                break  # calls come in order: wait for this one's name
            if index == len(self.sent):
                self.sent.append(len(call.arguments))
                deltas.append(DeltaToolCall(index=index, id=tool_call_id(), type="function",
                                            function=DeltaFunctionCall(
                                                name=call.name, arguments=call.arguments)))
            elif len(call.arguments) > self.sent[index]:
                deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                    arguments=call.arguments[self.sent[index]:])))
                self.sent[index] = len(call.arguments)
            if call.done and index == self._done:
                self._done += 1  # all of it sent: never read again
        return new_content, deltas

    def _split(self, final: bool) -> tuple[str, list[ToolCallText]]:
        if self.plan.mode == "named":
            return "", [ToolCallText(self.plan.function, self.text)] if self.text else []
        if self.plan.mode == "required":
            return "", self._calls(0, 2, ("parameters",))
        if self.plan.mode == "auto":
            parser = self.plan.parser
            assert parser is not None
            if self._split_at is None:  # once the calls start, the content is settled
                content, self._split_at = parser.split_stream(self.text, final)
                if self._split_at is None:
                    return content, []
                self._content = content
            return self._content, self._calls(self._split_at, parser.calls_depth,
                                              parser.args_keys)
        return self.text, []

    def _calls(self, start: int, depth: int, args_keys: tuple[str, ...]
               ) -> list[ToolCallText]:
        """The calls in the text from `start` on, read incrementally."""
        if self._scanner is None:
            self._scanner, self._scanned = CallScanner(depth, args_keys), start
        chunk, self._scanned = self.text[self._scanned:], len(self.text)
        return self._scanner.feed(chunk, self._done)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.sent and reason == "stop" else reason
