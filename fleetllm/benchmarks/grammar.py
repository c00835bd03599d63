"""Grammar backends for structured outputs: compile time and per-token mask time.

    fleetllm bench grammar [--model DIR] [--vocab-size 32000] [--backends xgrammar,guidance]

Per backend, for JSON schemas of 3, 15 and 60 properties (nested) and a regex: first mask
(parse + compile + a matcher's first bitmask from a cold cache: what a request with a new
schema waits in the scheduler) and mask (the mean time to fill one sequence's bitmask, what
each sampled token costs a step, over --tokens seeded random tokens the grammar allows). The
tokenizer is --model's (default: the demo model, 4K vocabulary), or with --vocab-size a
byte-level BPE of that size trained on fleetllm's sources (mask time grows with the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

import torch

from fleetllm.engine.arg_utils import resolve_model
from fleetllm.sampling_params import StructuredOutputsParams
from fleetllm.structured_outputs.backends import make_backend
from fleetllm.worker.sampler import unpack_bitmask


def _object(rng: random.Random, props: int, depth: int) -> dict:
    out: dict[str, Any] = {}
    for i in range(props):
        kind = rng.choice(["integer", "string", "boolean", "enum", "array", "object"][
            : 6 if depth < 2 else 4])
        if kind == "integer":
            out[f"p{i}"] = {"type": "integer", "minimum": 0, "maximum": 10_000}
        elif kind == "string":
            out[f"p{i}"] = {"type": "string", "maxLength": 16}
        elif kind == "boolean":
            out[f"p{i}"] = {"type": "boolean"}
        elif kind == "enum":
            out[f"p{i}"] = {"enum": ["alpha", "beta", "gamma", "delta"]}
        elif kind == "array":
            out[f"p{i}"] = {"type": "array", "items": {"type": "integer"}, "maxItems": 4}
        else:
            out[f"p{i}"] = _object(rng, 3, depth + 1)
    return {"type": "object", "properties": out, "required": list(out),
            "additionalProperties": False}


def constraints() -> dict[str, StructuredOutputsParams]:
    rng = random.Random(0)
    return {f"json {n} props": StructuredOutputsParams(json=_object(rng, n, 0))
            for n in (3, 15, 60)} | {
        "regex (email-like)": StructuredOutputsParams(
            regex=r"[a-z0-9._]{1,20}@[a-z0-9]{1,12}\.(com|org|net|io)")}


def trained_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sources = [p.read_text() for p in Path(__file__).resolve().parents[1].rglob("*.py")]
    tok.train_from_iterator(sources * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


def measure(backend: Any, so: StructuredOutputsParams, vocab: int, eos: int, tokens: int,
            rng: random.Random) -> tuple[float, float]:
    """(first mask, mean mask) in seconds: parse, compile and the first bitmask from a cold
    cache (the grammar thread's work), then the mean bitmask fill over `tokens` tokens drawn
    from those allowed (seeded; a completed grammar starts over)."""
    bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    start = time.perf_counter()
    compiled = backend.compile(backend.parse(so))
    matcher = backend.matcher(compiled)
    matcher.fill(bitmask, 0)
    first = time.perf_counter() - start
    spent = 0.0
    for _ in range(tokens):
        allowed = unpack_bitmask(bitmask[0], vocab).nonzero().flatten().tolist()
        token = eos if eos in allowed and rng.random() < 0.3 else rng.choice(allowed)
        matcher.accept(token)
        if matcher.terminated or token == eos:
            matcher = backend.matcher(compiled)
        start = time.perf_counter()
        matcher.fill(bitmask, 0)
        spent += time.perf_counter() - start
    return first, spent / tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="whose tokenizer (default: demo model)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="train a byte-level BPE of this size instead")
    parser.add_argument("--backends", default="xgrammar,guidance")
    parser.add_argument("--tokens", type=int, default=300, help="tokens walked per schema")


def run(args: argparse.Namespace) -> dict:
    if args.vocab_size:
        tokenizer = trained_tokenizer(args.vocab_size)
        where = f"a byte-level BPE trained for {args.vocab_size} tokens"
    else:
        from transformers import AutoTokenizer

        path = resolve_model(args.model)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        where = f"{path}'s tokenizer"
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    print(f"grammar backends on {where} ({vocab} tokens), {args.tokens} tokens per schema")
    print(f"{'backend':10} {'constraint':20} {'first mask ms':>14} {'mask us/token':>14}")
    results: dict[str, dict] = {}
    for name in args.backends.split(","):
        backend = make_backend(name, tokenizer, vocab, [eos])
        # the vocabulary set-up (once per engine) is not any schema's cost
        measure(backend, StructuredOutputsParams(regex="x"), vocab, eos, 1, random.Random(0))
        for label, so in constraints().items():
            first, mask = measure(backend, so, vocab, eos, args.tokens, random.Random(0))
            results.setdefault(name, {})[label] = {"first_mask_ms": first * 1e3,
                                                   "mask_us": mask * 1e6}
            print(f"{name:10} {label:20} {first * 1e3:14.2f} {mask * 1e6:14.1f}")
    print(json.dumps(results))
    return results
