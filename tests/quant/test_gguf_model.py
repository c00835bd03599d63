"""GGUF files run by the engine: greedy tokens against transformers running the same file
dequantized in float32 (its own GGUF loader), for every preset fleetllm reads, on the trained
demo model and random llama / qwen2 / qwen3 weights; the one-call decode paths; bad files."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import make_checkpoint

from fleetllm import LLM, SamplingParams
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.quant.gguf_export import export_gguf

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
PROMPTS = ["def fibonacci(n):", "import numpy as np\n", "class Engine:", "The quick brown",
           "for i in range(10):", "Hello world", "x = [", "# A comment about"]
TOKENS = 12
DEMO_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_0", "Q5_1", "Q4_K_M",
              "Q4_0", "Q4_1"]
# Random weights: sizes whose rows K-quants take (multiples of 256), q/k/v biases (qwen2),
# q/k norms (qwen3); a 4096-token vocabulary from the bundled tokenizer's size.
RANDOM = {"llama": ("LlamaForCausalLM", {}),
          # rows that split in whole 256-blocks across 2 tensor-parallel ranks
          "llama512": ("LlamaForCausalLM", dict(hidden_size=512, intermediate_size=1024,
                                              num_attention_heads=8)),
          "qwen2": ("Qwen2ForCausalLM", {}),
          "qwen3": ("Qwen3ForCausalLM", dict(hidden_size=512, head_dim=128))}
RANDOM_TYPES = ["Q8_0", "Q6_K", "Q4_K_M"]  # the demo model runs every preset


def reference_tokens(path: Path, prompts: list[str], adapter: Path | None = None
                     ) -> tuple[list[list[int]], list]:
    """transformers' greedy tokens on the file (with a PEFT adapter: peft's), and its logits
    at each step."""
    tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    tokens, logits = [], []
    for p in prompts:  # plain greedy steps: no stop at EOS (the engine ignores it here)
        ids = tok(p, return_tensors="pt").input_ids
        steps = []
        with torch.no_grad():
            for _ in range(TOKENS):
                steps.append(model(ids).logits[0, -1])
                ids = torch.cat([ids, steps[-1].argmax().view(1, 1)], dim=1)
        tokens.append(ids[0, -TOKENS:].tolist())
        logits.append(torch.stack(steps))
    return tokens, logits


# The largest |logprob - transformers' logprob| of a token both chose: measured up to 6e-4
# on these files (the demo model, random llama / qwen2 / qwen3, every preset; float32 sums in
# a different order, and the VNNI path's two planes of x, ~3e-5 relative).
LOGPROB_TOL = 2e-3


def check_parity(path: Path, got: list[list[int]], min_equal: float = 0.9,
                 logprobs: list[list[float]] | None = None, adapter: Path | None = None
                 ) -> float:
    """>= min_equal of the requests equal the reference (with `adapter`: transformers + peft),
    and each one's first differing token is within the reference's top 5 there; the sampled
    tokens' logprobs (where given) within LOGPROB_TOL of the reference's over the tokens both
    chose. Returns the fraction equal."""
    want, logits = reference_tokens(path, PROMPTS, adapter)
    equal = 0
    for i, (g, w, lg) in enumerate(zip(got, want, logits, strict=True)):
        same = next((j for j, (a, b) in enumerate(zip(g, w, strict=False)) if a != b), len(g))
        if logprobs is not None and same:
            ref = torch.log_softmax(lg[:same].double(), -1)[torch.arange(same), g[:same]]
            err = (torch.tensor(logprobs[i][:same], dtype=torch.float64) - ref).abs().max()
            assert err < LOGPROB_TOL, f"{path.name}: logprob off by {err:.2e}"
        if g == w:
            equal += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(g, w, strict=False)) if a != b)
        top5 = lg[i].topk(5).indices.tolist()
        assert g[i] in top5, f"{path.name}: token {i} {g[i]} not in the reference's top 5 {top5}"
    assert equal / len(got) >= min_equal, f"{path.name}: {equal}/{len(got)} equal"
    return equal / len(got)


def generate(path: Path, with_logprobs: bool = False, **kwargs):
    """Greedy tokens of PROMPTS (and, with_logprobs, each sampled token's logprob)."""
    with LLM(str(path), max_model_len=128, **kwargs) as llm:
        # logprobs only when asked: a row that wants them leaves multi-step's greedy C loop
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True,
                                logprobs=0 if with_logprobs else None)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if not with_logprobs:
        return tokens
    return tokens, [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids,
                                                    o.outputs[0].logprobs, strict=True)]
                    for o in outs]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(model, preset) -> its GGUF file, written on first use."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, str], Path] = {}

    def get(model: str, preset: str) -> Path:
        if (model, preset) not in made:
            if model == "demo":
                src = DEMO
            else:
                src = root / f"{model}-hf"
                if not src.exists():
                    arch, extra = RANDOM[model]
                    make_checkpoint(src, arch, seed=3, **{
                        "vocab_size": 512, "hidden_size": 256, "intermediate_size": 512,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                        "max_position_embeddings": 512, **extra})
            made[model, preset] = export_gguf(src, root / f"{model}-{preset}.gguf", preset,
                                              progress=False)
        return made[model, preset]
    return get


@pytest.mark.parametrize("preset", DEMO_TYPES)
def test_demo_model_matches_transformers(files, preset):
    path = files("demo", preset)
    tokens, logprobs = generate(path, with_logprobs=True)
    check_parity(path, tokens, logprobs=logprobs)


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("preset", RANDOM_TYPES)
def test_random_weights_match_transformers(files, model, preset):
    path = files(model, preset)
    tokens, logprobs = generate(path, with_logprobs=True)
    check_parity(path, tokens, logprobs=logprobs)


def test_one_call_decode_paths_run_quantized(files, monkeypatch):
    """The fused layers (LinearKind.GGUF, a quantized embedding and tied LM head) and the
    multi-step C loop give the modules' tokens."""
    from fleetllm.kernels import cpu_kernels

    path = files("demo", "Q4_K_M")
    calls = {"decoder_layers": 0, "greedy_passes": 0}
    for name in calls:
        real = getattr(cpu_kernels, name)

        def spy(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(cpu_kernels, name, spy)
    fused = generate(path)
    multi = generate(path, num_scheduler_steps=4)
    assert calls["decoder_layers"] > 0 and calls["greedy_passes"] > 0, calls
    monkeypatch.setenv("FLEETLLM_CPU_KERNELS", "0")  # not read again in this process:
    from fleetllm.model import fused as fused_mod
    monkeypatch.setattr(fused_mod, "run_layers", lambda *a, **k: None)
    modules = generate(path)
    assert fused == modules == multi


def test_a_quantized_model_keeps_no_dense_weights(files):
    path = files("demo", "Q8_0")
    with LLM(str(path), max_model_len=64) as llm:
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        kinds = {type(m.kernel).__name__ for m in model.modules() if hasattr(m, "kernel")}
        dense = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert "Gguf" in kinds
    # The demo's down projection has 688 columns (no 32-block fits): the file keeps it F32
    assert all("down_proj" in n for n in dense), dense


def test_tensor_parallel_matches(files):
    path = files("llama512", "Q4_K_M")
    got = generate(path, tensor_parallel_size=2, distributed_executor_backend="mp")
    check_parity(path, got)


def test_tensor_parallel_refuses_a_split_block(files):
    """256 columns of o_proj over 2 ranks would split Q4_K's 256-blocks: refused, named."""
    path = files("llama", "Q4_K_M")
    with pytest.raises(ModelLoadError, match=r"o_proj.*split its blocks of 256"):
        generate(path, tensor_parallel_size=2, distributed_executor_backend="mp")


def _rewrite(src: Path, dst: Path, edit) -> Path:
    data = bytearray(src.read_bytes())
    edit(data)
    dst.write_bytes(bytes(data))
    return dst


def test_bad_files_are_one_clear_error(files, tmp_path):
    good = files("demo", "Q8_0")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:os.path.getsize(good) // 2])
    magic = _rewrite(good, tmp_path / "magic.gguf", lambda d: d.__setitem__(slice(0, 4),
                                                                          b"GGML"))
    cases = {truncated: "truncated", magic: "GGUF", tmp_path / "missing.gguf": "missing.gguf"}
    for path, needle in cases.items():
        with pytest.raises(ModelLoadError, match=needle):
            LLM(str(path))
    with pytest.raises(ConfigurationError, match="quantization"):
        LLM(str(DEMO), quantization="awq")


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, int, tuple[int, ...]]],
                config_from: Path) -> Path:
    """A copy of config_from's metadata with other tensors (raw bytes, ggml type, shape)."""
    import gguf

    reader = gguf.GGUFReader(str(config_from))
    writer = gguf.GGUFWriter(str(path), arch=reader.get_field("general.architecture").contents())
    for field in reader.fields.values():
        if field.name.startswith(("GGUF.", "general.architecture")):
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             sub_type=field.types[-1] if len(field.types) > 1 else None)
    for name, (raw, qtype, shape) in tensors.items():
        if qtype == 0:  # F32: the array itself
            writer.add_tensor(name, raw.view(np.float32).reshape(shape))
        else:  # blocks: the byte shape [rows, row bytes]
            writer.add_tensor(name, raw.reshape(shape[0], -1), raw_shape=(shape[0], raw.size //
                                                                           shape[0]),
                              raw_dtype=gguf.GGMLQuantizationType(qtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_type_and_wrong_shape_name_the_tensor(files, tmp_path):
    import gguf

    good = files("demo", "Q8_0")
    reader = gguf.GGUFReader(str(good))
    tensors = {t.name: (np.asarray(t.data).view(np.uint8), int(t.tensor_type),
                        tuple(reversed([int(d) for d in t.shape]))) for t in reader.tensors}
    raw, _, shape = tensors["blk.0.attn_q.weight"]
    q2k = dict(tensors)
    q2k["blk.0.attn_q.weight"] = (np.zeros((shape[0], shape[1] // 256 * 84), np.uint8),
                                  int(gguf.GGMLQuantizationType.Q2_K), shape)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight.*Q2_K"):
        LLM(str(_write_gguf(tmp_path / "q2k.gguf", q2k, good)))
    wrong = dict(tensors)
    wrong["blk.1.ffn_norm.weight"] = (np.zeros(128 * 4, np.uint8), 0, (128,))
    with pytest.raises(ModelLoadError, match=r"blk\.1\.ffn_norm\.weight.*\(128,\)"):
        LLM(str(_write_gguf(tmp_path / "shape.gguf", wrong, good)))

