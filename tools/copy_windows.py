"""Training windows that repeat themselves, so the demo model learns to copy.

A model that copies continues text repeated from its prompt, which is what n-gram speculative
decoding drafts from; plain stdlib windows teach that weakly at the demo model's size, so
``tools/train_demo_model.py --copy-fraction F`` mixes in copy-edit windows (a function, a
comment asking for it again, then the function renamed) and span repeats (a corpus span or
random tokens, then the same again), each inside a window of plain corpus tokens with the loss
over the whole window. The phrasings differ from ``fleetllm bench latency --workload copy``'s,
so that benchmark measures copying in general. Held-out copy-edit windows measure copying:
loss and argmax accuracy over the second copy's body.
"""

from __future__ import annotations

import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEF_RE = re.compile(r"([ \t]*)def (\w+)\(")

# {old}: the function's name, {new}: the copy's.
RENAMED_BRIDGES = (
    "# Renamed copy: {new}",
    "# {new} is {old} under a new name:",
    "# Copy of {old} as {new}:",
    "# A duplicate of the function above, called {new}:",
    "# {old} again, named {new}:",
    "# Same code, new name ({new}):",
)
PLAIN_BRIDGES = ("# Again:", "# Copy:", "# Duplicate of {old}:", "")
RENAMES = ("{old}_new", "new_{old}", "{old}2", "_{old}", "{old}_copy", "{old}_old",
           "my_{old}", "{old}_impl")


@dataclass
class CopyText:
    ids: list[int]
    body_start: int  # index in ids where the copy's body (after its def line) starts


def functions(text: str, min_chars: int = 200, max_chars: int = 1500) -> list[str]:
    """Every function or method in ``text`` whose dedented source has min..max characters."""
    lines = text.splitlines(keepends=True)
    found = []
    for i, line in enumerate(lines):
        m = DEF_RE.match(line)
        if not m:
            continue
        indent = len(m.group(1).expandtabs())
        j = i + 1
        while j < len(lines) and (not lines[j].strip()
                                  or len(lines[j]) - len(lines[j].lstrip()) > indent):
            j += 1
        source = textwrap.dedent("".join(lines[i:j])).strip()
        if min_chars <= len(source) <= max_chars:
            found.append(source)
    return found


def heldout_functions(model: Path) -> list[str]:
    """The functions (as `functions` finds them) of the stdlib files a model was held out
    from: its heldout_files.txt, those of them this Python has."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = (model / "heldout_files.txt").read_text().split()
    return [f for rel in names if (stdlib / rel).is_file()
            for f in functions((stdlib / rel).read_text(encoding="utf-8"))]


def copy_edit_text(source: str, rng: random.Random) -> tuple[str, str]:
    """(the text up to and including the copy's def line, the copy's body)."""
    old = DEF_RE.match(source).group(2)  # type: ignore[union-attr]
    head, _, body = source.partition("\n")
    if rng.random() < 0.75:
        new = rng.choice(RENAMES).format(old=old)
        bridge = rng.choice(RENAMED_BRIDGES)
        head = head.replace(f"def {old}(", f"def {new}(", 1)
    else:
        new, bridge = old, rng.choice(PLAIN_BRIDGES)
    gap = rng.choice(("\n\n\n", "\n\n", "\n"))
    bridge = bridge.format(old=old, new=new)
    first = f"{source}{gap}{bridge}\n" if bridge else f"{source}{gap}"
    return f"{first}{head}\n", f"{body}\n"


def copy_edit_pool(tokenizer: Any, texts: list[str], max_len: int, seed: int,
                   variants: int = 2) -> list[CopyText]:
    """``variants`` copy-edit texts per function of ``texts`` that fit in max_len tokens.
    The head (up to the copy's def line and its newline) and the body are tokenized apart,
    as a prompt that ends with that newline is: byte-level BPE would otherwise merge the
    newline with the next line's indentation, a token such a prompt never ends with."""
    rng = random.Random(seed)
    heads, bodies = [], []
    for text in texts:
        for source in functions(text):
            for _ in range(variants):
                head, body = copy_edit_text(source, rng)
                heads.append(head)
                bodies.append(body)
    pool = []
    encoded = zip(tokenizer.encode_batch(heads, add_special_tokens=False),
                  tokenizer.encode_batch(bodies, add_special_tokens=False), strict=True)
    for head, body in encoded:
        ids = head.ids + body.ids
        if len(ids) <= max_len:
            pool.append(CopyText(ids, len(head.ids)))
    return pool


def embed(ids: list[int], corpus: Any, length: int, eos_id: int,
          rng: random.Random) -> tuple[list[int], int]:
    """``ids`` at a random offset in a window of ``length`` corpus tokens (an EOS after it);
    returns the window and the offset."""
    room = length - len(ids) - 1
    before = rng.randint(0, room)
    start = rng.randrange(0, len(corpus) - length)
    prefix = corpus[start:start + before].tolist()
    tail_start = rng.randrange(0, len(corpus) - length)
    suffix = corpus[tail_start:tail_start + room - before].tolist()
    return prefix + ids + [eos_id] + suffix, before


def span_repeat(corpus: Any, newline_ids: list[int], rng: random.Random,
                max_span: int = 200, vocab_size: int = 0) -> list[int]:
    """A span, a line break, the same span: random tokens (ids 1..vocab_size-1) where
    vocab_size is given, else a random corpus span."""
    n = rng.randint(16, max_span)
    if vocab_size:
        span = [rng.randrange(1, vocab_size) for _ in range(n)]
    else:
        start = rng.randrange(0, len(corpus) - n)
        span = corpus[start:start + n].tolist()
    return span + newline_ids + span


def copy_batch(pool: list[CopyText], corpus: Any, count: int, length: int, eos_id: int,
               newline_ids: list[int], rng: random.Random,
               vocab_size: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens: 60% copy-edit (when the pool has any), the
    rest span repeats, half of those of random tokens."""
    windows = []
    for _ in range(count):
        if pool and rng.random() < 0.6:
            ids = rng.choice(pool).ids
        else:
            ids = span_repeat(corpus, newline_ids, rng, min(200, (length - 4) // 2),
                              vocab_size if rng.random() < 0.5 else 0)
        windows.append(embed(ids, corpus, length, eos_id, rng)[0])
    return windows


def copy_eval_windows(pool: list[CopyText], corpus: Any, length: int, eos_id: int,
                      seed: int, count: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Held-out copy-edit windows and, for each, the (start, end) of the copy's body."""
    rng = random.Random(seed)
    windows, spans = [], []
    for item in rng.sample(pool, min(count, len(pool))):
        window, offset = embed(item.ids, corpus, length, eos_id, rng)
        windows.append(window)
        spans.append((offset + item.body_start, offset + len(item.ids)))
    return windows, spans
