"""Where the members of JSON objects are in text that may still be growing: what streaming a
tool call's arguments needs (its name once complete, then its arguments' text as it grows),
without waiting for the whole JSON to parse."""

from __future__ import annotations

import json


def object_members(text: str, depth: int) -> list[dict[str, list]]:
    """For each JSON object that opens at nesting `depth` (1: top-level objects, possibly
    several separated by anything else; 2: the objects of a top-level array), its members so
    far: key -> [value start, value end or None while the value is still open]. Text outside
    any JSON value (tags, separators) is skipped; a prefix of valid JSON is read as far as
    it goes."""
    objects: list[dict[str, list]] = []
    stack: list[str] = []
    in_str = escaped = False
    str_start = 0
    expect_key = True  # in an object at `depth`: the next string is a key
    key: str | None = None
    scalar = False  # a number or literal value at `depth` is open
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
                if len(stack) == depth and stack[-1] == "{":
                    if expect_key:
                        try:
                            key = json.loads(text[str_start:i + 1])
                        except ValueError:
                            key = None
                    elif key is not None:
                        objects[-1][key][1] = i + 1
            continue
        at_object = len(stack) == depth and bool(stack) and stack[-1] == "{"
        if scalar and (ch in ",}]" or ch.isspace()):
            scalar = False
            if key is not None:
                objects[-1][key][1] = i
        if ch.isspace():
            continue
        if at_object and not expect_key and key is not None and key not in objects[-1]:
            objects[-1][key] = [i, None]  # a value starts
            scalar = ch not in '{["'
        if ch == '"':
            in_str, str_start = True, i
        elif ch in "{[":
            stack.append(ch)
            if len(stack) == depth and ch == "{":
                objects.append({})
                expect_key, key = True, None
        elif ch in "}]":
            if stack:
                stack.pop()
            if len(stack) == depth and stack and stack[-1] == "{" and key is not None \
                    and not expect_key and objects[-1][key][1] is None:
                objects[-1][key][1] = i + 1  # a container value closed
        elif at_object and ch == ":":
            expect_key = False
        elif at_object and ch == ",":
            expect_key, key = True, None
    return objects


def member_text(text: str, members: dict[str, list], key: str) -> str | None:
    """The text of a member's value so far (None: not started)."""
    span = members.get(key)
    if span is None:
        return None
    return text[span[0]:span[1] if span[1] is not None else len(text)]


def complete_string(text: str, members: dict[str, list], key: str) -> str | None:
    """A member's value once it is a complete JSON string, else None."""
    span = members.get(key)
    if span is None or span[1] is None:
        return None
    try:
        value = json.loads(text[span[0]:span[1]])
    except ValueError:
        return None
    return value if isinstance(value, str) else None
