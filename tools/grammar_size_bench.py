"""Compile time of a constraint by its size, per grammar backend (docs/structured_outputs.md:
why a constraint takes at most MAX_CONSTRAINT_CHARS).

    .venv/bin/python tools/grammar_size_bench.py [--sizes 4096 16384 65536 300000]
"""

from __future__ import annotations

import argparse
import random
import string
import time

from transformers import AutoTokenizer

from fleetllm import sampling_params
from fleetllm.engine.arg_utils import DEMO_MODEL
from fleetllm.sampling_params import StructuredOutputsParams
from fleetllm.structured_outputs.backends import make_backend


def constraints(size: int) -> dict[str, StructuredOutputsParams]:
    """A regex, a choice list, a grammar and a JSON schema of enums, each about `size` chars."""
    rng = random.Random(0)
    text = "".join(rng.choice(string.ascii_letters) for _ in range(size))
    props = {f"p{i}": {"type": "string", "enum": [text[i:i + 16]]}
             for i in range(0, size // 40 * 16, 16)}
    return {"regex": StructuredOutputsParams(regex=text),
            "choice": StructuredOutputsParams(choice=[text[i:i + 32]
                                                      for i in range(0, size, 32)]),
            "grammar": StructuredOutputsParams(grammar=f'root ::= "{text}"'),
            "json": StructuredOutputsParams(json={"type": "object", "properties": props})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    args = parser.parse_args()
    sampling_params.MAX_CONSTRAINT_CHARS = 1 << 30  # time what the engine would refuse too
    tok = AutoTokenizer.from_pretrained(str(DEMO_MODEL))
    for name in args.backends:
        backend = make_backend(name, tok, len(tok), [tok.eos_token_id])
        for size in args.sizes:
            for kind, so in constraints(size).items():
                start = time.perf_counter()
                backend.compile(backend.parse(so))
                print(f"{name:9s} {kind:8s} {size:>7,} chars: "
                      f"{time.perf_counter() - start:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
