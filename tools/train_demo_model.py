#!/usr/bin/env python3
"""Train fleetllm's bundled demo model: a tiny Llama that completes Python code.

The corpus is the Python standard library's own ``.py`` sources (found through
``sysconfig.get_paths()["stdlib"]``), so the model can be rebuilt on any machine
with no downloads. The script:

1. collects the stdlib sources deterministically (sorted relative paths) and holds
   out every ``--heldout-every``-th file for validation;
2. trains a byte-level BPE tokenizer (``tokenizers``) on the training files;
3. trains a small ``transformers.LlamaForCausalLM`` with plain PyTorch
   (AdamW, warmup + cosine LR, grad clipping) on EOS-joined documents packed
   into fixed-length windows;
4. saves a normal Hugging Face checkpoint directory (config.json,
   model.safetensors, generation_config.json, tokenizer files) plus README.md,
   training_log.json and heldout_files.txt.

Usage (on a CPU, the recipe of the first demo model: 1,200 steps x 8 x 256 tokens,
30 minutes on 2 cores, held-out loss 3.94)::

    nice -n 19 python tools/train_demo_model.py --out fleetllm/demo_model

``--smoke`` trains a throwaway model on a handful of files for a few steps (tests).

``--copy-fraction F`` makes F of each batch windows that repeat themselves (a function
copied under a new name, a span said twice: ``tools/copy_windows.py``), so that the model
learns to copy from its prompt, which n-gram speculative decoding needs. The shipped model
and its draft were trained so on a GPU (``--device cuda``; a minute each on an H200), from
Python 3.11.7's stdlib files copied into a directory (``--stdlib``) with the previous model's
tokenizer (``--tokenizer``)::

    python tools/train_demo_model.py --out fleetllm/demo_model --tokenizer fleetllm/demo_model \
        --stdlib stdlib-3.11.7 --device cuda --seq-len 512 --batch-size 64 --steps 2000 \
        --copy-fraction 0.75 --eval-every 100 --threads 8
    python tools/train_demo_model.py --teacher fleetllm/demo_model --out fleetllm/demo_draft \
        --stdlib stdlib-3.11.7 --device cuda --seq-len 512 --batch-size 64 --steps 2500 \
        --copy-fraction 0.5 --num-layers 1 --hidden-size 128 --num-heads 4 --num-kv-heads 2 \
        --intermediate-size 344 --eval-every 250 --threads 8

The 4M-parameter model overfits the 2.4M-token corpus past about 30,000 plain windows (with
``--copy-fraction 0.5``, held-out loss 2.62 at step 800, 5.6 at step 9,000); copying forms
within 500 steps (held-out copy accuracy 92%). ``--time-budget S`` sets ``--steps`` from the
speed of the first steps instead; ``--init DIR`` fine-tunes DIR's weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EOS_TOKEN = "<|endoftext|>"

# Directory names under the stdlib that are skipped: third-party packages, test
# suites, build config, and data-like modules (codec tables, pydoc topic dumps)
# that would teach the model little about Python code.
SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "__pycache__",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "turtledemo",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__phello__",
        "lib-dynload",
    }
)
MAX_FILE_BYTES = 400_000


@dataclass
class CorpusFile:
    rel: str
    text: str


def stdlib_dir(override: str | None = None) -> Path:
    return Path(override or sysconfig.get_paths()["stdlib"]).resolve()


def collect_corpus(root: Path) -> list[CorpusFile]:
    """All usable stdlib ``.py`` files, sorted by relative path (deterministic)."""
    rels: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        )
        for name in filenames:
            if not name.endswith(".py") or name.startswith("_sysconfigdata"):
                continue
            rels.append(Path(dirpath, name).relative_to(root).as_posix())
    files: list[CorpusFile] = []
    for rel in sorted(rels):
        path = root / rel
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(CorpusFile(rel, text))
    return files


def split_corpus(
    files: list[CorpusFile], every: int
) -> tuple[list[CorpusFile], list[CorpusFile]]:
    """Hold out every ``every``-th file (indices every//2, every//2 + every, ...)."""
    offset = every // 2
    train = [f for i, f in enumerate(files) if i % every != offset]
    heldout = [f for i, f in enumerate(files) if i % every == offset]
    return train, heldout


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok: Any, max_len: int) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        model_max_length=max_len,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(hf_tok: Any, out: Path) -> None:
    hf_tok.save_pretrained(str(out))
    # Pin the class name every transformers version understands (v5 would write
    # its internal "TokenizersBackend" name, which 4.x cannot resolve).
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["clean_up_tokenization_spaces"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    special = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN,
               "unk_token": EOS_TOKEN}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def encode_docs(tok: Any, texts: list[str], eos_id: int) -> Any:
    """Token ids of all documents, each followed by EOS, as one uint16 array."""
    import numpy as np

    ids: list[int] = [eos_id]
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.uint16)


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def evaluate(model: Any, windows: Any, batch_size: int) -> float:
    """Mean per-token cross entropy (nats) over ``windows`` (N x (L+1) int64)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i : i + batch_size].to(model.device)
            logits = model(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(),
                batch[:, 1:].reshape(-1),
                reduction="sum",
            )
            total += loss.item()
            count += batch[:, 1:].numel()
    model.train()
    return total / max(1, count)


def copy_scores(model: Any, windows: Any, spans: list[tuple[int, int]],
                batch_size: int) -> tuple[float, float]:
    """(loss, argmax accuracy) over the copied bodies of held-out copy-edit windows: what
    the model predicts where a copying model predicts the prompt's text again."""
    import torch
    import torch.nn.functional as F

    model.eval()
    loss = right = count = 0.0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch_size):
            batch = windows[i : i + batch_size].to(model.device)
            logits = model(input_ids=batch[:, :-1]).logits.float()
            for row, (start, end) in enumerate(spans[i : i + batch_size]):
                # Position p predicts token p + 1.
                pred, target = logits[row, start - 1 : end - 1], batch[row, start:end]
                loss += F.cross_entropy(pred, target, reduction="sum").item()
                right += (pred.argmax(-1) == target).sum().item()
                count += end - start
    model.train()
    return loss / max(1, count), right / max(1, count)


def agreement(model: Any, teacher: Any, windows: Any, batch_size: int) -> float:
    """How often the model's argmax is the teacher's over ``windows``: a greedy draft's
    per-token acceptance rate."""
    import torch

    model.eval()
    same = count = 0
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch_size):
            ids = windows[i : i + batch_size, :-1].to(model.device)
            same += int((model(input_ids=ids).logits.argmax(-1)
                         == teacher(input_ids=ids).logits.argmax(-1)).sum())
            count += ids.numel()
    model.train()
    return same / max(1, count)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="fleetllm/demo_model", help="output checkpoint dir")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=None, help="warmup steps (default 5%%)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=64,
                   help="held-out windows for periodic eval (final eval uses all)")
    p.add_argument("--heldout-every", type=int, default=50)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=688)
    p.add_argument("--max-position-embeddings", type=int, default=512)
    p.add_argument("--init", default=None,
                   help="start from this checkpoint's weights (fine-tuning; its tokenizer "
                        "and shape) instead of a random initialisation")
    p.add_argument("--tokenizer", default=None,
                   help="use this checkpoint's tokenizer instead of training one")
    p.add_argument("--stdlib", default=None,
                   help="corpus root (default: this Python's stdlib directory)")
    p.add_argument("--copy-fraction", type=float, default=0.0,
                   help="fraction of each batch made of copy windows (tools/copy_windows.py)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (bf16 autocast on cuda)")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the training loop: --steps is set from the speed of "
                        "the first steps")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="dtype the weights are saved in (training is always float32)")
    p.add_argument("--no-progress", action="store_true", help="disable the tqdm bar")
    p.add_argument("--teacher", default=None,
                   help="train a draft for this checkpoint: its tokenizer, its distributions")
    p.add_argument("--smoke", action="store_true",
                   help="tiny throwaway run on a few files for a few steps (tests)")
    args = p.parse_args(argv)
    if args.smoke:  # small settings, except those given on the command line
        small = {"steps": 4, "batch_size": 2, "seq_len": 64, "max_files": 10,
                 "heldout_every": 5, "vocab_size": 384, "hidden_size": 64, "num_layers": 2,
                 "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128,
                 "max_position_embeddings": 128, "eval_every": 2, "eval_windows": 4}
        for name, value in small.items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    if args.warmup is None:
        args.warmup = 200 if args.time_budget else max(1, args.steps // 20)
    if not 0.0 <= args.copy_fraction <= 1.0:
        p.error("--copy-fraction must be in [0, 1]")
    return args


def write_readme(out: Path, info: dict[str, Any], heldout: list[str]) -> None:
    a = info["args"]
    draft = a["teacher"] is not None
    intro = [
        "# fleetllm-demo-py",
        "",
        "A tiny Llama-architecture causal LM trained from scratch on the Python standard",
        "library's own source code. It is fleetllm's bundled demo / test model: small enough",
        "to ship in the repository and run on a CPU, trained enough that greedy completions",
        "look like Python. It is not useful for anything else.",
    ] if not draft else [
        "# fleetllm-demo-py draft",
        "",
        f"A draft model for speculative decoding with `{a['teacher']}`: the same tokenizer,",
        "trained on the same corpus to match that model's next-token distributions (KL",
        "divergence to its softmax), not the text's. Use it as",
        '`speculative_config={"method": "draft_model", "model": <this directory>}`.',
    ]
    tokenizer = (
        f"Byte-level BPE (`tokenizers`; ByteLevel pre-tokenizer and decoder, GPT-2 regex), "
        f"vocab {info['vocab_size']}, trained on the training files only. "
        "`<|endoftext|>` (id 0) is BOS, EOS, PAD and UNK. Decoding reproduces the input "
        "bytes exactly (spaces, newlines, indentation). No BOS is added automatically."
    ) if not draft else f"The teacher's (`{a['teacher']}`), vocab {info['vocab_size']}."
    agreement = [] if not draft else [
        f"- Held-out argmax agreement with the teacher (a greedy draft's per-token acceptance): "
        f"**{info['final_agreement']:.1%}**"]
    lines = [
        *intro,
        "",
        "## How it was made",
        "",
        "```",
        info["command"],
        "```",
        "",
        f"- Script: `tools/train_demo_model.py` (plain PyTorch loop over "
        f"`transformers.LlamaForCausalLM`), seed {a['seed']}, {a['threads']} torch threads.",
        f"- Machine: {info['machine']}; Python {info['python']}, torch {info['torch']}, "
        f"transformers {info['transformers']}, tokenizers {info['tokenizers']}.",
        f"- Wall time: {info['wall_time_s'] / 60:.1f} min total "
        f"({info['train_time_s'] / 60:.1f} min in the training loop).",
        "",
        "## Corpus",
        "",
        (f"- `.py` files under `{a['stdlib']}` (`--stdlib`), "
         if a["stdlib"] else
         f"- `.py` files under `sysconfig.get_paths()['stdlib']` (Python {info['python']}), ")
        + "sorted by relative path; skipped directories: "
        + ", ".join(f"`{d}`" for d in sorted(SKIP_DIRS))
        + f", `config-*`; skipped files: `_sysconfigdata*`, files > {MAX_FILE_BYTES} bytes, "
        "non-UTF-8 files.",
        f"- {info['n_files']} files ({info['n_chars']:,} characters): "
        f"{info['n_train_files']} for training ({info['n_train_tokens']:,} tokens), "
        f"{info['n_heldout_files']} held out ({info['n_heldout_tokens']:,} tokens). "
        f"Held out = every {a['heldout_every']}th file by sorted path "
        f"(index % {a['heldout_every']} == {a['heldout_every'] // 2}).",
        "- Documents are joined with `<|endoftext|>` and packed into "
        f"{a['seq_len']}-token windows.",
        "",
        "## Tokenizer",
        "",
        tokenizer,
        "",
        "## Model",
        "",
        f"`LlamaForCausalLM`: hidden {a['hidden_size']}, {a['num_layers']} layers, "
        f"{a['num_heads']} attention heads / {a['num_kv_heads']} KV heads (GQA), "
        f"intermediate {a['intermediate_size']}, max positions {a['max_position_embeddings']}, "
        f"rope_theta 10000, tied embeddings: **{info['n_params']:,} parameters**, "
        f"weights stored as {a['dtype']}.",
        "",
        "## Training",
        "",
        f"{a['steps']} steps x batch {a['batch_size']} x {a['seq_len']} tokens "
        f"({info['tokens_seen']:,} tokens, {info['epochs']:.2f} epochs of the plain "
        "windows); AdamW "
        f"(betas 0.9/0.95, weight decay {a['weight_decay']} on matrices), peak LR {a['lr']}, "
        f"{a['warmup']} warmup steps then cosine to {a['min_lr_ratio']}x, grad-norm clip "
        f"{a['grad_clip']}."
        + (f" {a['copy_fraction']:.0%} of each batch were copy windows "
           "(`tools/copy_windows.py`: a function again under a new name, a span said twice)."
           if a["copy_fraction"] else ""),
        "",
        "## Results",
        "",
        f"- Final train loss (mean of last {info['train_loss_window']} steps"
        + ("; KL divergence to the teacher" if draft else "") + "): "
        f"**{info['final_train_loss']:.4f}** nats/token",
        f"- Final held-out loss (all {info['n_heldout_windows']} held-out windows): "
        f"**{info['final_heldout_loss']:.4f}** nats/token "
        f"(perplexity {math.exp(info['final_heldout_loss']):.2f}; a uniform guess is "
        f"ln({info['vocab_size']}) = {math.log(info['vocab_size']):.2f})",
        *agreement,
        f"- Copying, over the second copy's body in {info['n_heldout_copy_windows']} held-out "
        f"copy-edit windows: loss **{info['final_heldout_copy_loss']:.4f}** nats/token, "
        f"argmax accuracy **{info['final_heldout_copy_accuracy']:.1%}**",
        "",
        "Greedy completion of `def fibonacci(n):` (48 new tokens):",
        "",
        "```python",
        info["sample"],
        "```",
        "",
        "Per-eval history is in `training_log.json`.",
        "",
        "## Held-out files",
        "",
        "Relative to the stdlib directory (also in `heldout_files.txt`):",
        "",
        *[f"- `{h}`" for h in heldout],
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def greedy_sample(model: Any, hf_tok: Any, prompt: str, new_tokens: int) -> str:
    import torch

    model.eval()
    ids = hf_tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    ids = ids.to(model.device)
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=hf_tok.pad_token_id, eos_token_id=hf_tok.eos_token_id,
        )
    model.train()
    return hf_tok.decode(out[0], skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    # Sleep rather than spin while waiting for work: this trains on shared CPUs.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

    import numpy as np
    import tokenizers
    import torch
    import torch.nn.functional as F
    import transformers
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    # ---- corpus ---------------------------------------------------------------
    root = stdlib_dir(args.stdlib)
    files = collect_corpus(root)
    if args.max_files is not None:
        files = files[: args.max_files]
    train_files, heldout_files = split_corpus(files, args.heldout_every)
    if not train_files or not heldout_files:
        raise SystemExit("corpus too small for a train/held-out split")
    print(f"corpus: {len(files)} files from {root} "
          f"({len(train_files)} train, {len(heldout_files)} held out)", flush=True)

    # ---- tokenizer (and teacher) ----------------------------------------------
    teacher = None
    if args.teacher:
        from transformers import AutoTokenizer

        teacher = LlamaForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
        teacher.requires_grad_(False)
        tok = AutoTokenizer.from_pretrained(args.teacher).backend_tokenizer
        if tok.get_vocab_size() != teacher.config.vocab_size:
            raise SystemExit("the teacher's tokenizer and model disagree on the vocabulary")
        args.max_position_embeddings = teacher.config.max_position_embeddings
    elif args.tokenizer or args.init:
        from transformers import AutoConfig, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.tokenizer or args.init).backend_tokenizer
        if args.init:  # fine-tuning keeps the checkpoint's shape (the README reports it)
            shape = AutoConfig.from_pretrained(args.init)
            args.hidden_size, args.intermediate_size = shape.hidden_size, shape.intermediate_size
            args.num_layers, args.num_heads = shape.num_hidden_layers, shape.num_attention_heads
            args.num_kv_heads = shape.num_key_value_heads
            args.max_position_embeddings = shape.max_position_embeddings
    else:
        tok = train_tokenizer([f.text for f in train_files], args.vocab_size)
    eos_id = tok.token_to_id(EOS_TOKEN)
    sample_text = train_files[0].text[:2000]
    if tok.decode(tok.encode(sample_text).ids) != sample_text:
        raise SystemExit("tokenizer does not round-trip")
    hf_tok = wrap_tokenizer(tok, args.max_position_embeddings)
    vocab_size = tok.get_vocab_size()

    train_ids = encode_docs(tok, [f.text for f in train_files], eos_id)
    heldout_ids = encode_docs(tok, [f.text for f in heldout_files], eos_id)
    print(f"tokens: {len(train_ids):,} train, {len(heldout_ids):,} held out "
          f"(vocab {vocab_size})", flush=True)

    win = args.seq_len + 1  # inputs + shifted targets

    def to_windows(ids: Any) -> Any:
        # Non-overlapping windows with stride seq_len (each target predicted once).
        n = (len(ids) - 1) // args.seq_len
        idx = np.arange(n)[:, None] * args.seq_len + np.arange(win)[None, :]
        return torch.from_numpy(ids[idx].astype(np.int64))

    train_windows = to_windows(train_ids)
    heldout_windows = to_windows(heldout_ids)
    if train_windows.shape[0] < args.batch_size or heldout_windows.shape[0] == 0:
        raise SystemExit("not enough tokens for one batch / one held-out window")

    # ---- copy windows (tools/copy_windows.py) ---------------------------------
    import copy_windows

    newline_ids = tok.encode("\n", add_special_tokens=False).ids
    copy_pool = copy_windows.copy_edit_pool(
        tok, [f.text for f in train_files], win - 8, args.seed) if args.copy_fraction else []
    heldout_pool = copy_windows.copy_edit_pool(tok, [f.text for f in heldout_files],
                                               win - 8, args.seed + 1)
    copy_eval, copy_spans = copy_windows.copy_eval_windows(
        heldout_pool, heldout_ids, win, eos_id, args.seed, args.eval_windows)
    copy_eval_t = torch.tensor(copy_eval, dtype=torch.int64).reshape(-1, win)
    copy_rng = random.Random(args.seed + 2)
    n_copy = round(args.batch_size * args.copy_fraction)
    print(f"copy windows: {len(copy_pool):,} copy-edit texts, {n_copy} copy windows per "
          f"batch; {len(copy_eval)} held-out copy-edit windows", flush=True)

    # ---- model ----------------------------------------------------------------
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        use_cache=True,
    )
    if args.init:
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        if model.config.vocab_size != vocab_size:
            raise SystemExit("--init's vocabulary differs from the tokenizer's")
    else:
        model = LlamaForCausalLM(config)
    model = model.to(args.device)
    model.config.rope_theta = 10000.0
    if teacher is not None:
        teacher.to(args.device)
    # Mixed precision on a GPU (float32 master weights); float32 throughout on a CPU.
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=args.device.startswith("cuda"))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(train_windows.shape[0], generator=gen)
    cursor = 0
    eval_subset = heldout_windows[: args.eval_windows]

    history: list[dict[str, float]] = []
    recent: list[Any] = []
    model.train()
    t_train = time.time()
    bar = tqdm(total=None if args.time_budget else args.steps, desc="train",
               disable=args.no_progress, dynamic_ncols=True, mininterval=2.0)
    step = 0
    calibrated = args.time_budget is None
    if not calibrated:
        args.steps = 10**9  # until step 50 says how many fit
    t_calib = t_train
    while step < args.steps:
        if not calibrated and step == 50:
            # Fix the step count from the speed of steps 10-50 (the first ones warm up).
            rate = 40 / (time.time() - t_calib)
            args.steps = max(step + 1, int(rate * (args.time_budget - (time.time() - t_train))
                                           + step))
            bar.total = args.steps
            calibrated = True
            print(f"{rate:.1f} steps/s: {args.steps} steps in the time budget", flush=True)
        elif calibrated and args.time_budget and step % args.eval_every == 0:
            # Shorten (never lengthen) the run if the steps slowed down since.
            left = args.time_budget - (time.time() - t_train)
            args.steps = min(args.steps, max(step + 1, step + int(left * step / (
                time.time() - t_train))))
            bar.total = args.steps
        if step == 10:
            t_calib = time.time()
        if cursor + args.batch_size - n_copy > len(order):
            order = torch.randperm(train_windows.shape[0], generator=gen)
            cursor = 0
        batch = train_windows[order[cursor : cursor + args.batch_size - n_copy]]
        cursor += args.batch_size - n_copy
        if n_copy:
            extra = copy_windows.copy_batch(copy_pool, train_ids, n_copy, win, eos_id,
                                            newline_ids, copy_rng, vocab_size)
            batch = torch.cat([batch, torch.tensor(extra, dtype=torch.int64)])
        batch = batch.to(args.device, non_blocking=True)
        lr = lr_at(step, args.steps, args.warmup, args.lr, args.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits.float()
            if teacher is None:
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                       batch[:, 1:].reshape(-1))
            else:
                with torch.no_grad():
                    target = F.log_softmax(teacher(input_ids=batch[:, :-1]).logits.float(), -1)
                loss = F.kl_div(F.log_softmax(logits, -1).flatten(0, 1),
                                target.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        recent = [*recent[-49:], loss.detach()]  # no .item(): it would wait for the GPU
        if step in (10, 50):
            loss.item()  # the calibration's clock reads after the GPU's work
        if step % args.eval_every == 0 or step == args.steps:
            with autocast:
                ev = evaluate(model, eval_subset, args.batch_size)
                copy_loss, copy_acc = copy_scores(model, copy_eval_t, copy_spans,
                                                  args.batch_size)
            train_loss = torch.stack(recent).mean().item()
            history.append({"step": step, "train_loss": train_loss,
                            "heldout_loss": ev, "heldout_copy_loss": copy_loss,
                            "heldout_copy_accuracy": copy_acc, "lr": lr,
                            "grad_norm": float(gnorm), "elapsed_s": time.time() - t_train})
            if teacher is not None:
                with autocast:
                    history[-1]["agreement"] = agreement(model, teacher, eval_subset,
                                                         args.batch_size)
            bar.set_postfix({"loss": f"{train_loss:.3f}", "heldout": f"{ev:.3f}",
                             "copy_acc": f"{copy_acc:.2f}"}, refresh=False)
            if args.no_progress:
                print(f"step {step}: train {train_loss:.4f} heldout {ev:.4f} "
                      f"copy loss {copy_loss:.3f} accuracy {copy_acc:.1%} "
                      f"({time.time() - t_train:.0f}s)", flush=True)
    bar.close()
    train_time = time.time() - t_train

    with autocast:
        final_heldout = evaluate(model, heldout_windows, args.batch_size)
        final_copy_loss, final_copy_acc = copy_scores(model, copy_eval_t, copy_spans,
                                                      args.batch_size)
    final_train = torch.stack(recent).mean().item()
    print(f"final: train loss {final_train:.4f}, held-out loss {final_heldout:.4f} nats "
          f"({heldout_windows.shape[0]} windows)", flush=True)
    final_agreement = None
    if teacher is not None:
        with autocast:
            final_agreement = agreement(model, teacher, heldout_windows, args.batch_size)
        print(f"held-out argmax agreement with the teacher: {final_agreement:.1%}", flush=True)

    sample = greedy_sample(model, hf_tok, "def fibonacci(n):", 48)
    print("greedy sample:\n" + sample, flush=True)

    # ---- save -----------------------------------------------------------------
    save_dtype = getattr(torch, args.dtype)
    model.to("cpu", save_dtype)
    model.config.torch_dtype = args.dtype
    model.generation_config = GenerationConfig(
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(hf_tok, out)
    heldout_rel = [f.rel for f in heldout_files]
    (out / "heldout_files.txt").write_text("\n".join(heldout_rel) + "\n")

    cmd_args = [a for a in (sys.argv[1:] if argv is None else argv)]
    command = "python tools/train_demo_model.py " + " ".join(shlex.quote(a) for a in cmd_args)
    info: dict[str, Any] = {
        "command": command.strip(),
        "args": vars(args),
        "machine": (f"{platform.machine()} CPU, {os.cpu_count()} cores ({platform.system()})"
                    + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda")
                       else "")),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "stdlib_dir": str(root),
        "n_files": len(files),
        "n_chars": sum(len(f.text) for f in files),
        "n_train_files": len(train_files),
        "n_heldout_files": len(heldout_files),
        "n_train_tokens": int(len(train_ids)),
        "n_heldout_tokens": int(len(heldout_ids)),
        "n_heldout_windows": int(heldout_windows.shape[0]),
        "vocab_size": vocab_size,
        "n_params": n_params,
        "tokens_seen": args.steps * args.batch_size * args.seq_len,
        # Passes over the corpus's plain windows (copy windows are made anew each step).
        "epochs": args.steps * (args.batch_size - n_copy) / train_windows.shape[0],
        "train_loss_window": len(recent),
        "final_train_loss": final_train,
        "final_heldout_loss": final_heldout,
        "final_agreement": final_agreement,
        "final_heldout_copy_loss": final_copy_loss,
        "final_heldout_copy_accuracy": final_copy_acc,
        "n_heldout_copy_windows": len(copy_eval),
        "train_time_s": train_time,
        "wall_time_s": time.time() - t_start,
        "sample": sample,
        "history": history,
    }
    (out / "training_log.json").write_text(json.dumps(info, indent=2) + "\n")
    write_readme(out, info, heldout_rel)
    print(f"saved to {out} in {info['wall_time_s']:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
