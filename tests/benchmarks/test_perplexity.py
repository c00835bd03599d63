"""fleetllm bench perplexity: the engine's perplexity of a text equals transformers' on the
same windows (the second half of each scored, as llama-perplexity does), for a checkpoint
directory and its GGUF file."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import transformers

from fleetllm import LLM
from fleetllm.benchmarks.perplexity import default_text, perplexity
from fleetllm.quant.gguf_export import export_gguf

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
WINDOW, WINDOWS = 128, 6


def reference(model_dir: Path, text: str, gguf: str | None = None) -> float:
    kw = {"gguf_file": gguf} if gguf else {}
    tok = transformers.AutoTokenizer.from_pretrained(model_dir, **kw)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                              **kw).eval()
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    nll, n = 0.0, 0
    with torch.no_grad():
        for w in range(WINDOWS):
            x = torch.tensor([ids[w * WINDOW:(w + 1) * WINDOW]])
            lp = torch.log_softmax(model(x).logits[0].double(), -1)
            for pos in range(WINDOW // 2, WINDOW):
                nll -= lp[pos - 1, x[0, pos]].item()
                n += 1
    return math.exp(nll / n)


def test_perplexity_equals_transformers(tmp_path):
    files = default_text()
    assert files, "the demo model's held-out stdlib files are not on this Python"
    text = "".join(f.read_text() for f in files)
    gguf = export_gguf(DEMO, tmp_path / "demo-Q4_K_M.gguf", "Q4_K_M", progress=False)
    for model, want in ((DEMO, reference(DEMO, text)),
                        (gguf, reference(tmp_path, text, gguf.name))):
        with LLM(str(model), max_model_len=WINDOW) as llm:
            got, count = perplexity(llm, text, WINDOW, WINDOWS)
        assert count == WINDOWS * WINDOW // 2
        assert abs(got / want - 1) < 1e-4, (model, got, want)
