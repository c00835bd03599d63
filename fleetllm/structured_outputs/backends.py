"""Grammar backends: a StructuredOutputsParams -> a compiled grammar -> per-sequence matchers
that fill a token bitmask and advance with each accepted token.

xgrammar (the default, as in vLLM: a pushdown automaton with precomputed masks) or llguidance
("guidance": a lazy Earley parser, near-zero compile time, slower masks); "auto" falls back to
guidance for a constraint xgrammar refuses. Both fill the same int32 bitmask (bit j of word i
allows token 32 * i + j). `parse` needs no tokenizer and runs in add_request, so a malformed
schema or regex is an InvalidRequestError before anything is queued; `compile` may be slow and
runs on the grammar thread (StructuredOutputManager), never on the step path.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from fleetllm.config import STRUCTURED_OUTPUTS_BACKENDS as BACKENDS
from fleetllm.errors import ConfigurationError, InvalidRequestError
from fleetllm.sampling_params import StructuredOutputsParams

# Optional JSON whitespace is capped at this many characters per gap (any indentation a
# pretty-printer writes fits): uncapped, a small model can emit newlines until max_tokens and
# never close its object (vLLM's known failure; disable_any_whitespace removes it altogether).
MAX_JSON_WHITESPACE = 20
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NNN: " and, for a failed
# check, "Check failed: (...) is false: ": noise to whoever sent the schema.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _clean(error: BaseException) -> str:
    return _NOISE.sub("", str(error).strip()).splitlines()[0] if str(error).strip() else \
        type(error).__name__


def _schema_text(params: StructuredOutputsParams) -> str:
    schema = params.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"a JSON schema is an object, got {type(schema).__name__}")
    if params.disable_additional_properties:
        schema = _no_additional_properties(schema)
    return json.dumps(schema)


def _no_additional_properties(schema: Any) -> Any:
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


def _compact(params: StructuredOutputsParams) -> bool:
    return params.disable_any_whitespace or params.json_whitespace_limit == 0


def _whitespace_limit(params: StructuredOutputsParams) -> int:
    limit = params.json_whitespace_limit
    return MAX_JSON_WHITESPACE if limit is None else limit


def _literal(text: str) -> str:
    """A double-quoted grammar literal (EBNF and Lark share JSON's escapes)."""
    return json.dumps(text, ensure_ascii=False)


def _is_lark(grammar: str) -> bool:
    return "::=" not in grammar


class Matcher:
    """One sequence's position in its grammar."""

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        raise NotImplementedError

    @property
    def terminated(self) -> bool:
        raise NotImplementedError


class XgrammarMatcher(Matcher):
    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._m = xgr.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return self._m.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._m.is_terminated()


class GuidanceMatcher(Matcher):
    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self._m = llguidance.LLMatcher(tokenizer, grammar)

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token) and not self._m.is_error()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, row)

    @property
    def terminated(self) -> bool:
        return self._m.is_stopped()


# Two holes in xgrammar 0.2's character classes, closed by rewriting the grammar's EBNF:
# - a string with a length bound takes any character but " \ CR LF, control characters
#   included, which JSON forbids unescaped (json.loads refuses them); its unbounded strings
#   exclude \0-\x1f, as the bounded ones now do;
# - a negated class ([^...], and "." as [\0-\U0010ffff]) matches UTF-8-encoded surrogates
#   (U+D800-U+DFFF: bytes ED A0-BF ..), which no UTF-8 decoder accepts: a byte-level
#   tokenizer's single-byte tokens can spell them, and the text shows U+FFFD.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
_ANY_CHAR = r"[\0-\U0010ffff]"
_SURROGATES = r"\ud800-\udfff"
# a quoted literal (kept as it is) | a negated class
_EBNF_PIECE = re.compile(r'"(?:\\.|[^"\\])*"|\[\^((?:\\.|[^\]\\])*)\]')


# xgrammar 0.2 writes its generic JSON rules (basic_array, basic_object and their items:
# values of no given type, any json_object) with ", " and ": " whatever `separators` says;
# compact JSON (disable_any_whitespace) rewrites the separators of those rules only (they hold
# no user text: a schema's own literals are in the other rules).
_BASIC_RULE = re.compile(r'^(basic_(?:array|object)\w* ::= )(.*)$', re.M)


def _compact_basic_rules(text: str) -> str:
    return _BASIC_RULE.sub(lambda m: m.group(1) + m.group(2).replace('", "', '","')
                           .replace('": "', '":"'), text)


def _valid_utf8_classes(grammar: Any, json_strings: bool = False,
                        compact: bool = False) -> Any:
    import xgrammar as xgr

    text = str(grammar)
    if json_strings:
        text = text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
    if compact:
        text = _compact_basic_rules(text)
    text = text.replace(_ANY_CHAR, f"[^{_SURROGATES}]")

    def close(m: re.Match) -> str:
        body = m.group(1)
        if body is None or body.endswith(_SURROGATES):
            return m.group(0)
        return f"[^{body}{_SURROGATES}]"

    return xgr.Grammar.from_ebnf(_EBNF_PIECE.sub(close, text))


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._compiler: Any = None

    def parse(self, params: StructuredOutputsParams) -> Any:
        """The grammar, parsed but not compiled against the vocabulary (cheap)."""
        import xgrammar as xgr

        kind = params.kind
        try:
            compact = _compact(params)
            if kind == "json":
                return _valid_utf8_classes(xgr.Grammar.from_json_schema(
                    _schema_text(params), **self._spacing(params)), json_strings=True,
                    compact=compact)
            if kind == "json_object":
                return _valid_utf8_classes(xgr.Grammar.from_json_schema(
                    '{"type": "object"}', **self._spacing(params)), json_strings=True,
                    compact=compact)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(
                    "root ::= " + " | ".join(_literal(c) for c in params.choice))
            if kind == "regex":
                return _valid_utf8_classes(xgr.Grammar.from_regex(params.regex))
            if _is_lark(params.grammar):
                return _valid_utf8_classes(xgr.Grammar.from_lark(params.grammar))
            return _valid_utf8_classes(xgr.Grammar.from_ebnf(params.grammar))
        except InvalidRequestError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with its message
            raise InvalidRequestError(f"invalid {kind} constraint: {_clean(e)}") from None

    @staticmethod
    def _spacing(params: StructuredOutputsParams) -> dict[str, Any]:
        if _compact(params):  # as json.dumps(separators=(",", ":"))
            return {"any_whitespace": False, "separators": (",", ":")}
        return {"any_whitespace": True, "max_whitespace_cnt": _whitespace_limit(params)}

    def compile(self, grammar: Any) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            tokenizer, vocab_size, stop = self._args
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=stop)
            # One thread: compiling shares the machine's cores with the model.
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> Matcher:
        return XgrammarMatcher(compiled)


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._args = (tokenizer, vocab_size, stop_token_ids)
        self._tokenizer: Any = None

    def _lltokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf

            tokenizer, vocab_size, stop = self._args
            self._tokenizer = llguidance.hf.from_tokenizer(
                tokenizer, n_vocab=vocab_size, eos_token=stop[0] if stop else None)
        return self._tokenizer

    def parse(self, params: StructuredOutputsParams) -> str:
        import llguidance

        kind, m = params.kind, llguidance.LLMatcher
        flexible = {"whitespace_flexible": False} if _compact(params) else \
            {"whitespace_pattern": rf"[\x20\n\t]{{0,{_whitespace_limit(params)}}}"}
        try:
            if kind == "json":
                grammar = m.grammar_from_json_schema(_schema_text(params), defaults=flexible)
            elif kind == "json_object":
                grammar = m.grammar_from_json_schema('{"type": "object"}', defaults=flexible)
            elif kind == "regex":
                grammar = m.grammar_from_regex(params.regex)
            elif kind == "choice":
                grammar = m.grammar_from_lark(
                    "start: " + " | ".join(_literal(c) for c in params.choice))
            else:  # Lark as it is; EBNF (GBNF) converted
                from llguidance.gbnf_to_lark import any_to_lark

                grammar = m.grammar_from_lark(any_to_lark(params.grammar))
        except InvalidRequestError:
            raise
        except Exception as e:
            raise InvalidRequestError(f"invalid {kind} constraint: {_clean(e)}") from None
        error = m.validate_grammar(grammar, self._lltokenizer())
        if error:
            raise InvalidRequestError(f"invalid {kind} constraint: {error.strip()}")
        return grammar

    def compile(self, grammar: str) -> str:
        return grammar  # llguidance builds its parser lazily, per matcher

    def matcher(self, compiled: str) -> Matcher:
        return GuidanceMatcher(self._lltokenizer(), compiled)


def make_backend(name: str, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
                 ) -> XgrammarBackend | GuidanceBackend:
    if name not in ("xgrammar", "guidance"):
        raise ConfigurationError(f"structured outputs backend: {name!r}; use one of "
                                 f"{', '.join(BACKENDS)}")
    cls = XgrammarBackend if name == "xgrammar" else GuidanceBackend
    return cls(tokenizer, vocab_size, stop_token_ids)
