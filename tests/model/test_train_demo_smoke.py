"""The demo-model training script runs end to end, and the shipped demo model is trained.

``tools/train_demo_model.py --smoke`` trains a throwaway model in a few seconds; the
shipped ``fleetllm/demo_model`` must load with plain Hugging Face transformers and
predict held-out stdlib code far better than a uniform guess.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from helpers import load_tool
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools" / "train_demo_model.py"
SHIPPED = REPO / "fleetllm" / "demo_model"
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
    "training_log.json",
    "heldout_files.txt",
)


def _check_checkpoint_dir(path: Path) -> tuple[object, object]:
    for name in CHECKPOINT_FILES:
        assert (path / name).is_file(), f"missing {name} in {path}"
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.config.model_type == "llama"
    assert tok.eos_token_id is not None
    assert tok.eos_token_id == model.config.eos_token_id
    assert len(tok) == model.config.vocab_size
    text = "def f(x):\n    if x:\n\t\treturn  [1, 2]\n\n"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    return tok, model


def train(*args: str) -> float:
    """Runs the script with --smoke and ARGS; its wall time."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--no-progress",
                           "--threads", "2", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return time.time() - t0


@pytest.fixture(scope="module")
def smoke_model(tmp_path_factory) -> tuple[Path, float]:
    out = tmp_path_factory.mktemp("smoke") / "demo"
    return out, train("--out", str(out))


def test_smoke_training_produces_loadable_checkpoint(smoke_model) -> None:
    out, elapsed = smoke_model
    assert elapsed < 60, f"smoke training took {elapsed:.1f}s"
    tok, model = _check_checkpoint_dir(out)
    log = json.loads((out / "training_log.json").read_text())
    assert math.isfinite(log["final_heldout_loss"])
    assert math.isfinite(log["final_train_loss"])
    ids = tok("import os\n", return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)


def test_teacher_trains_a_draft_with_its_tokenizer(smoke_model, tmp_path: Path) -> None:
    """--teacher: the draft takes the teacher's tokenizer (a draft must share its target's
    vocabulary) and records how often its argmax agrees with the teacher's."""
    teacher, draft = smoke_model[0], tmp_path / "draft"
    # Another vocabulary size than the teacher's: the teacher's tokenizer must win.
    train("--out", str(draft), "--teacher", str(teacher), "--vocab-size", "300")
    _check_checkpoint_dir(draft)
    assert (draft / "tokenizer.json").read_text() == (teacher / "tokenizer.json").read_text()
    config = json.loads((draft / "config.json").read_text())
    assert config["vocab_size"] == json.loads((teacher / "config.json").read_text())[
        "vocab_size"]
    log = json.loads((draft / "training_log.json").read_text())
    assert 0.0 <= log["final_agreement"] <= 1.0
    assert "agreement" in log["history"][-1]
    assert "draft" in (draft / "README.md").read_text().splitlines()[0]


def test_shipped_demo_model_beats_uniform_on_heldout_file() -> None:
    tok, model = _check_checkpoint_dir(SHIPPED)
    model.eval()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    heldout = (SHIPPED / "heldout_files.txt").read_text().split()
    assert heldout, "no held-out files listed"
    existing = [stdlib / rel for rel in heldout if (stdlib / rel).is_file()]
    assert existing, f"none of the held-out files exist under {stdlib}"
    text = existing[0].read_text(encoding="utf-8")
    ids = tok(text, add_special_tokens=False).input_ids[:256]
    assert len(ids) == 256
    # Training documents always follow an <|endoftext|>, so score the file the same way.
    input_ids = torch.tensor([[tok.eos_token_id, *ids]])
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss.float().item()
    uniform = math.log(model.config.vocab_size)
    assert loss < uniform - 1.5, f"held-out loss {loss:.3f} vs uniform {uniform:.3f}"


def test_shipped_demo_model_completes_python() -> None:
    tok, model = _check_checkpoint_dir(SHIPPED)
    model.eval()
    prompt = "def fibonacci(n):"
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model.generate(
            ids, max_new_tokens=48, do_sample=False,
            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        )
    completion = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    # Looks like Python: an indented body that opens with a keyword or a docstring.
    assert re.search(r"\n {4,}\S", completion), repr(completion)
    assert re.search(
        r'"""|\b(return|if|for|while|def|else|None|self|import|raise|Return)\b', completion
    ), repr(completion)


SOURCE = '''import os


def join_all(parts, sep=","):
    """Join parts with sep, skipping empty ones, and strip the result."""
    kept = [p for p in parts if p]
    if not kept:
        return ""
    return sep.join(kept).strip()


class Box:
    def describe(self, verbose=False):
        """Say what is in the box, at length when verbose."""
        if verbose:
            return "a box holding " + ", ".join(sorted(self.items)) + " and nothing else"
        return "a box"

    def tiny(self):
        return 1
'''


def test_copy_windows_repeat_a_function_under_a_new_name() -> None:
    """tools/copy_windows.py: functions and methods (dedented, long enough) are found; a
    copy-edit text is the function, a line asking for it again, its def line and its body
    (what a copying model predicts from the prompt); span repeats say a span twice."""
    import random

    import numpy as np

    cw = load_tool("copy_windows")
    found = cw.functions(SOURCE, min_chars=100)
    assert [f.split("(")[0] for f in found] == ["def join_all", "def describe"]
    assert found[1].startswith("def describe(self, verbose=False):\n    \"\"\"Say")
    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    pool = cw.copy_edit_pool(tok.backend_tokenizer, [SOURCE], 500, seed=0, variants=8)
    assert len(pool) == 16
    for item in pool:
        text = tok.decode(item.ids)
        head, body = tok.decode(item.ids[:item.body_start]), tok.decode(item.ids[item.body_start:])
        source = next(f for f in found if f.partition("\n")[2] + "\n" == body)
        assert text.startswith(source)  # the function, then its copy
        copy_line = head.rstrip("\n").rsplit("\n", 1)[1]
        assert copy_line.startswith("def ") and copy_line.endswith("):")
    # Renamed copies (their bridge names both) and plain ones both occur.
    heads = [tok.decode(item.ids[:item.body_start]) for item in pool]
    assert any("def join_all(" not in h.split("\n\n")[-1] for h in heads)
    assert any(h.count("def join_all(") == 2 for h in heads)
    rng = random.Random(0)
    corpus = np.arange(5, 1000, dtype=np.uint16)
    for vocab in (0, 4096):
        ids = cw.span_repeat(corpus, [9], rng, max_span=40, vocab_size=vocab)
        half = (len(ids) - 1) // 2
        assert ids[:half] == ids[half + 1:] and ids[half] == 9 and 16 <= half <= 40
    windows = cw.copy_batch(pool, corpus, 12, 600, 0, [9], rng, 4096)
    assert len(windows) == 12 and all(len(w) == 600 for w in windows)


def test_copy_fraction_trains_on_copy_windows_and_reports_copying(tmp_path: Path) -> None:
    """--copy-fraction mixes copy windows into the batches (from the previous model's
    tokenizer, --tokenizer) and the log reports the held-out copy loss and accuracy."""
    out = tmp_path / "copying"
    train("--out", str(out), "--tokenizer", str(SHIPPED), "--copy-fraction", "0.5",
          "--seq-len", "480", "--max-position-embeddings", "512", "--max-files", "60",
          "--heldout-every", "6")
    log = json.loads((out / "training_log.json").read_text())
    assert log["args"]["copy_fraction"] == 0.5
    assert log["n_heldout_copy_windows"] > 0
    assert math.isfinite(log["final_heldout_copy_loss"])
    assert 0.0 <= log["final_heldout_copy_accuracy"] <= 1.0
    assert "heldout_copy_accuracy" in log["history"][-1]
    assert (out / "tokenizer.json").read_text() == (SHIPPED / "tokenizer.json").read_text()
    assert "copy windows" in (out / "README.md").read_text()
