"""Where the members of JSON objects are in text that is still growing: what streaming a
tool call needs (its name once complete, then its arguments' text as it grows), without
waiting for the whole JSON to parse. Incremental: each character is read once, so a long
answer costs O(length) over its whole stream, not O(length) per delta."""

from __future__ import annotations

import json


class MemberScanner:
    """Reads the JSON objects that open at nesting `depth` (1: top-level objects, possibly
    several separated by anything else; 2: the objects of a top-level array). `objects[i]`
    maps each member's key to [value start, value end or None while the value is open], as
    offsets in the text fed so far. Text outside any JSON value (tags, separators) is
    skipped; a prefix of valid JSON is read as far as it goes."""

    def __init__(self, depth: int):
        self.depth = depth
        self.text = ""
        self.objects: list[dict[str, list]] = []
        self._stack: list[str] = []
        self._in_str = self._escaped = False
        self._str_start = 0
        self._expect_key = True  # in an object at `depth`: the next string is a key
        self._key: str | None = None
        self._scalar = False  # a number or literal value at `depth` is open

    def feed(self, chunk: str) -> None:
        start = len(self.text)
        self.text += chunk
        for i in range(start, len(self.text)):
            self._read(i, self.text[i])

    def _read(self, i: int, ch: str) -> None:
        stack, depth = self._stack, self.depth
        if self._in_str:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_str = False
                if len(stack) == depth and stack[-1] == "{":
                    if self._expect_key:
                        try:
                            self._key = json.loads(self.text[self._str_start:i + 1])
                        except ValueError:
                            self._key = None
                    elif self._key is not None:
                        self.objects[-1][self._key][1] = i + 1
            return
        at_object = len(stack) == depth and bool(stack) and stack[-1] == "{"
        if self._scalar and (ch in ",}]" or ch.isspace()):
            self._scalar = False
            if self._key is not None:
                self.objects[-1][self._key][1] = i
        if ch.isspace():
            return
        key = self._key
        if at_object and not self._expect_key and key is not None and key not in self.objects[-1]:
            self.objects[-1][key] = [i, None]  # a value starts
            self._scalar = ch not in '{["'
        if ch == '"':
            self._in_str, self._str_start = True, i
        elif ch in "{[":
            stack.append(ch)
            if len(stack) == depth and ch == "{":
                self.objects.append({})
                self._expect_key, self._key = True, None
        elif ch in "}]":
            if stack:
                stack.pop()
            if len(stack) == depth and stack and stack[-1] == "{" and key is not None \
                    and not self._expect_key and self.objects[-1][key][1] is None:
                self.objects[-1][key][1] = i + 1  # a container value closed
        elif at_object and ch == ":":
            self._expect_key = False
        elif at_object and ch == ",":
            self._expect_key, self._key = True, None

    def member_text(self, members: dict[str, list], key: str) -> str | None:
        """The text of a member's value so far (None: not started)."""
        span = members.get(key)
        if span is None:
            return None
        return self.text[span[0]:span[1] if span[1] is not None else len(self.text)]

    def complete_string(self, members: dict[str, list], key: str) -> str | None:
        """A member's value once it is a complete JSON string, else None."""
        span = members.get(key)
        if span is None or span[1] is None:
            return None
        try:
            value = json.loads(self.text[span[0]:span[1]])
        except ValueError:
            return None
        return value if isinstance(value, str) else None


def object_members(text: str, depth: int) -> list[dict[str, list]]:
    """MemberScanner's objects for the whole of `text`."""
    scanner = MemberScanner(depth)
    scanner.feed(text)
    return scanner.objects
