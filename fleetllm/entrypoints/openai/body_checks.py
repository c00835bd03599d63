"""Checks on a request before its fields are read, so that no value can fail later where a 400
is no longer possible (the engine-core process's msgpack wire, the tokenizer, a grammar
compiler), and bounds on the work one request can make the API process do.

- screen_json: anywhere in a parsed body, an int outside [-2**63, 2**64 - 1] (what msgpack
  carries), a non-finite float (1e999 parses as inf), a string with a lone surrogate ("\\ud800"
  is valid JSON, but no UTF-8 encoder takes it), or nesting past MAX_JSON_DEPTH is a 400
  naming its path ("guided_json.properties.a").
- TextBound: a text whose tokens cannot fit max_model_len (longer, in characters, than
  max_model_len times the tokenizer's longest token) is refused before it is tokenized.
- until_disconnected: runs the preparation of a request (tokenizing, adding its prompts) and
  stops it when the client goes away, so a request nobody waits for costs nothing more.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import Request

from fleetllm.entrypoints.openai.errors import APIError, truncate

T = TypeVar("T")
MIN_INT, MAX_INT = -(1 << 63), (1 << 64) - 1
MAX_JSON_DEPTH = 100  # far past any real schema or message list; a grammar compiler recurses


class ClientDisconnected(Exception):
    """The client went away before its response was ready; its requests are aborted."""


def screen_json(obj: Any) -> None:
    """A 400 naming the first value (by path) that nothing past the API could carry."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(obj, ())]
    while stack:
        value, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            _refuse(path, f"nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, list) and _plain_ints(value):  # token ids: checked at C speed
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str) and not _is_text(key):
                _refuse((*path, key), _SURROGATE)
            kind = type(item)
            if kind is str:
                if not _is_text(item):
                    _refuse((*path, key), _SURROGATE)
            elif kind is int:
                if not MIN_INT <= item <= MAX_INT:  # in a list (of ids): named by the list
                    where = (*path, key) if isinstance(value, dict) or not path else path
                    at = f"item {key} " if where is path else ""
                    _refuse(where, f"{at}{truncate(str(item), 40)} is out of range (integers "
                            f"here are in [-2**63, 2**64 - 1])")
            elif kind is float:
                if not math.isfinite(item):
                    _refuse((*path, key), "must be a finite number")
            elif kind is dict or kind is list:
                stack.append((item, (*path, key)))


_SURROGATE = "contains a lone surrogate (\\ud800-\\udfff), which is not text"


def _plain_ints(values: list) -> bool:
    """A non-empty list of ints (no bools), all in range."""
    return bool(values) and set(map(type, values)) == {int} and \
        MIN_INT <= min(values) and max(values) <= MAX_INT


def _is_text(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _refuse(path: tuple[Any, ...], why: str) -> None:
    param = ".".join(truncate(str(p), 40) for p in path) or "body"
    raise APIError(400, f"{param}: {why}", param)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters one token of `tokenizer` covers (its longest vocabulary entry;
    byte-level entries spell one character per byte, so this bounds the text's characters
    too); None when it cannot be read."""
    try:
        return _longest(tokenizer)
    except Exception:  # no vocabulary to read (or an unhashable stand-in)
        return None


@functools.lru_cache(maxsize=8)  # one read per tokenizer, not per handler (128k entries)
def _longest(tokenizer: Any) -> int | None:
    vocab = tokenizer.get_vocab()
    added = getattr(tokenizer, "added_tokens_encoder", None) or {}
    return max(len(t) for t in [*vocab, *added]) or None


class TextBound:
    """Refuses a text that cannot fit max_model_len tokens, before it is tokenized: each
    token covers at most `longest` characters, so a text past `max_model_len * longest`
    characters has more tokens than the model's context."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        longest = longest_token_chars(tokenizer) if tokenizer is not None else None
        self.max_chars = None if longest is None else max_model_len * max(longest, 1)
        self.max_model_len = max_model_len

    def check(self, text: str, param: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise APIError(400, f"{param}: {len(text)} characters is more than any text of "
                           f"max_model_len={self.max_model_len} tokens can be (at most "
                           f"{self.max_chars} characters); shorten it", param)


async def until_disconnected(work: Awaitable[T], request: Request | None) -> T:
    """`work`'s result; ClientDisconnected (`work` cancelled: a cancelled add aborts its
    request) if the client goes away first."""
    task = asyncio.ensure_future(work)
    if request is None:
        return await task
    gone = asyncio.ensure_future(disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        task.cancel()
        try:
            await task
        except BaseException:
            pass
        raise ClientDisconnected
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
