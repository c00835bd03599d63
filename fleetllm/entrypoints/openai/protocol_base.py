"""The rules every OpenAI API body of protocol.py follows, as pydantic base classes.

RequestModel: validated strictly (no "1" for 1, no true for 1, no NaN or Infinity; bounds
that protect the engine are the bodies' fields' own). No field is silently dropped: a field
is declared (and used), or listed in IGNORED_FIELDS (accepted: it changes nothing here), or
in UNSUPPORTED_FIELDS (a 400 naming it unless its value asks for nothing); any other field
is a 400 naming it. ResponseModel: extra fields allowed; OmitWhenNone leaves out the fields
it names while they are None.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_serializer, model_validator
from pydantic_core import PydanticCustomError

# Fields of OpenAI's API that are accepted and ignored, wherever they appear (a request, a
# message, stream_options): field -> why ignoring it changes nothing a client can observe.
IGNORED_FIELDS: dict[str, str] = {
    "user": "an end-user id for a provider's abuse monitoring",
    "metadata": "tags for stored completions; nothing is stored here",
    "store": "asks the provider to keep the completion; nothing is kept here",
    "service_tier": "a provider's processing tier; there is one here",
    "include_obfuscation": "stream_options: pads chunks against side channels",
    "refusal": "an assistant message's refusal text (replayed history)",
    "annotations": "an assistant message's citations (replayed history)",
}

# Fields of OpenAI's API that this server does not implement: a 400 naming the field, unless
# its value asks for nothing (null, [], {} or one of the listed values):
# field -> (what the 400 says, the values that ask for nothing).
UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "functions": ("function calling is not supported yet", ()),
    "function_call": ("function calling is not supported yet", ("none",)),
    "logit_bias": ("logit_bias is not supported", ()),
    "suffix": ("suffix (text after the insertion point) is not supported", ("",)),
    "audio": ("audio is not supported", ()),
    "modalities": ("only text output is supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "web_search_options": ("web search is not supported", ()),
}


def _asks_for_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    return value is None or (isinstance(value, list | dict) and not value) or any(
        type(value) is type(h) and value == h for h in harmless)


class RequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _screen_fields(cls, data: Any) -> Any:
        """Drop IGNORED_FIELDS, refuse UNSUPPORTED_FIELDS; declared fields always win, and
        anything else stays for extra="forbid" to name."""
        if not isinstance(data, dict):
            return data
        kept = {}
        for key, value in data.items():
            if key in cls.model_fields:
                kept[key] = value
            elif key in UNSUPPORTED_FIELDS:
                why, harmless = UNSUPPORTED_FIELDS[key]
                if not _asks_for_nothing(value, harmless):
                    raise PydanticCustomError("unsupported_field", "{why}",
                                              {"field": key, "why": why})
            elif key not in IGNORED_FIELDS:
                kept[key] = value
        return kept


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class OmitWhenNone(ResponseModel):
    """Leaves out the fields named in `omit_when_none` while they are None: a stream chunk
    carries `usage` only in the usage chunk and `role` only in the first delta, as OpenAI's
    and vLLM's do (`"usage": null` on every chunk trips strict clients)."""

    omit_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: Any) -> Any:
        data = handler(self)
        for name in self.omit_when_none:
            if name in data and data[name] is None:
                del data[name]
        return data
