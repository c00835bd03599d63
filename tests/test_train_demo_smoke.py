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
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
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
