"""Random structured-output constraints (JSON schemas, regexes, choices) and the check that
an output satisfies its constraint. Schemas are bounded (string lengths, array sizes, integer
ranges, nesting) so that any model, even a random-weight one, can complete them within the
tests' max_tokens: an output cut at max_tokens is a failure, not a pass."""

from __future__ import annotations

import json
import random
import re

import jsonschema

from fleetllm import StructuredOutputsParams

_NAMES = ["id", "name", "age", "tags", "ok", "score", "items", "kind", "meta", "note", "x",
          "y_2", "long_property_name"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["integer", "boolean", "string", "enum", "null", "const"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds) if depth else "object"
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "string":
        schema = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            schema["minLength"] = rng.randint(0, schema["maxLength"])
        return schema
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "a b", "x\"y", "ü", "42"],
                                   rng.randint(1, 3))}
    if kind == "const":
        return {"const": rng.choice(["v1", "fixed", "ok"])}
    if kind == "array":
        low = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + rng.randint(0, 2)}
    names = rng.sample(_NAMES, rng.randint(1, 4 if depth else 5))
    props = {n: random_schema(rng, depth + 1) for n in names}
    # additionalProperties false: JSON Schema's default allows any other key, which llguidance
    # honours, and a random-weight model then writes keys without end.
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": [n for n in names if rng.random() < 0.7]}


def random_regex(rng: random.Random) -> str:
    """Regexes in the syntax Python, xgrammar and llguidance share, each match bounded."""
    parts = []
    for _ in range(rng.randint(1, 4)):
        piece = rng.choice([
            lambda: rng.choice(["id-", "x", "ab", r"\.", "/", " "]),
            lambda: f"[a-z]{{{rng.randint(1, 3)},{rng.randint(3, 5)}}}",
            lambda: f"\\d{{{rng.randint(1, 4)}}}",
            lambda: "(" + "|".join(rng.sample(["cat", "dog", "eel", "a1"], 2)) + ")",
            lambda: f"[A-F0-9]{{{rng.randint(1, 3)}}}",
            lambda: "(-[0-9])?",
        ])()
        parts.append(piece)
    return "".join(parts)


def random_choice(rng: random.Random) -> list[str]:
    words = ["yes", "no", "maybe", "positive", "negative", "the cat", "x" * 5, "ünï", "42"]
    return rng.sample(words, rng.randint(1, 4))


def random_constraint(rng: random.Random) -> StructuredOutputsParams:
    """A JSON schema (3 in 5), a regex or a choice. Not "any JSON object": it is unbounded,
    and only a trained model can be relied on to close it."""
    kind = rng.choice(["json", "json", "json", "regex", "choice"])
    if kind == "json":
        return StructuredOutputsParams(json=random_schema(rng),
                                       disable_any_whitespace=rng.random() < 0.7)
    if kind == "regex":
        return StructuredOutputsParams(regex=random_regex(rng))
    return StructuredOutputsParams(choice=random_choice(rng))


def check_output(so: StructuredOutputsParams, text: str) -> None:
    """Raises AssertionError unless text satisfies the constraint."""
    if so.json is not None or so.json_object:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise AssertionError(f"not JSON ({e}): {text!r}") from None
        schema = {"type": "object"} if so.json_object else (
            json.loads(so.json) if isinstance(so.json, str) else so.json)
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{text!r} does not validate: {e.message}") from None
    elif so.regex is not None:
        assert re.fullmatch(so.regex, text), f"{text!r} does not match {so.regex!r}"
    elif so.choice is not None:
        assert text in so.choice, f"{text!r} not in {so.choice}"


