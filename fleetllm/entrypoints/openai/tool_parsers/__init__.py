"""Tool-call parsers for tool_choice "auto" (--enable-auto-tool-choice --tool-call-parser
NAME), by vLLM's names."""

from __future__ import annotations

from fleetllm.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ToolCallText,
    ToolParser,
)
from fleetllm.entrypoints.openai.tool_parsers.hermes_tool_parser import HermesToolParser
from fleetllm.entrypoints.openai.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from fleetllm.errors import ConfigurationError

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ConfigurationError(f"tool_call_parser: {name!r} is not one of "
                                 f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolCallText", "ToolParser",
           "get_tool_parser"]
