"""GGUF models everywhere the engine goes: pipeline parallel (mp), ray TP=2, LoRA adapters on
a quantized base, speculative decoding (n-gram, draft model), sleep levels 1 and 2, and
save_sharded_state keeping the quantized layout. Greedy tokens against the same file on uni;
where tensor parallelism splits the sums, transformers' parity (test_gguf_model)."""

from __future__ import annotations

import gc
import json
import math
import weakref
from pathlib import Path

import pytest
from lora_helpers import ATTN, MLP, make_adapter
from safetensors import safe_open
from test_gguf_model import DEMO, PROMPTS, TOKENS, check_parity

from fleetllm import LLM, LoRARequest, SamplingParams
from fleetllm.model.linear_kernels import Gguf
from fleetllm.model.sharded_state import METADATA_FILE as META
from fleetllm.quant.gguf_checkpoint import open_gguf
from fleetllm.quant.gguf_export import export_gguf
from fleetllm.quant.packed import PLAIN

GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
KV = dict(max_model_len=128, kv_cache_memory=16 << 20)


def run(llm: LLM, **kwargs) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, **kwargs)
    return [list(o.outputs[0].token_ids) for o in outs]


def generate(path: Path, **kwargs) -> list[list[int]]:
    with LLM(str(path), **KV, **kwargs) as llm:
        return run(llm)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """preset -> the demo model's GGUF file, written on first use."""
    root = tmp_path_factory.mktemp("gguf-engine")
    made: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in made:
            made[preset] = export_gguf(DEMO, root / f"demo-{preset}.gguf", preset,
                                       progress=False)
        return made[preset]
    return get


@pytest.fixture(scope="module")
def uni(files):
    """preset -> the file's greedy tokens on one worker."""
    cache: dict[str, list[list[int]]] = {}

    def get(preset: str) -> list[list[int]]:
        if preset not in cache:
            cache[preset] = generate(files(preset))
        return cache[preset]
    return get


def assert_tp_tokens(path: Path, got: list[list[int]], want: list[list[int]]) -> None:
    """uni's tokens; where tensor parallelism's split sums changed one, transformers' parity on
    the file decides (test_gguf_model.check_parity)."""
    if got != want:
        check_parity(path, got)


def test_pipeline_parallel_and_tp_pp_match_uni(files, uni):
    """mp PP=2 (K-quants; the tied LM head on the last stage reads the embedding's blocks)
    and TP=2 x PP=2 (Q8_0: o_proj's 256 columns split in whole 32-blocks)."""
    path = files("Q4_K_M")
    assert generate(path, pipeline_parallel_size=2, distributed_executor_backend="mp") == \
        uni("Q4_K_M")
    path = files("Q8_0")
    got = generate(path, tensor_parallel_size=2, pipeline_parallel_size=2,
                   distributed_executor_backend="mp")
    assert_tp_tokens(path, got, uni("Q8_0"))


def test_ray_tensor_parallel_matches_uni(files, uni):
    pytest.importorskip("ray")
    path = files("Q8_0")
    got = generate(path, tensor_parallel_size=2, distributed_executor_backend="ray",
                   ray_cpus_per_worker=0.5)
    assert_tp_tokens(path, got, uni("Q8_0"))


def test_lora_on_a_quantized_base_matches_peft(files, uni, tmp_path):
    """An adapter made on the float model, served on its Q4_K_M file: transformers + peft on
    the file dequantized; the same engine without it keeps uni's tokens."""
    adapter = make_adapter(DEMO, tmp_path / "adapter", r=8, alpha=16, targets=ATTN + MLP,
                           seed=3, scale=0.1)
    path = files("Q4_K_M")
    with LLM(str(path), **KV, enable_lora=True, max_lora_rank=8) as llm:
        lora = run(llm, lora_request=LoRARequest("a", 1, str(adapter)))
        base = run(llm)
    assert base == uni("Q4_K_M")
    assert all(a != b for a, b in zip(lora, base, strict=True))  # the delta is applied
    check_parity(path, lora, adapter=adapter)


SPECULATE = {"ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3},
             "draft": {"method": "draft_model", "num_speculative_tokens": 3}}


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_keeps_the_tokens(files, uni, method):
    """The target a GGUF file; the draft model another (the demo draft's Q8_0)."""
    config = dict(SPECULATE[method])
    if method == "draft":
        config["model"] = str(export_gguf(DEMO.parent / "demo_draft",
                                          files("Q4_K_M").parent / "draft-Q8_0.gguf", "Q8_0",
                                          progress=False))
    with LLM(str(files("Q4_K_M")), **KV, speculative_config=config) as llm:
        assert run(llm) == uni("Q4_K_M")
        assert llm.llm_engine.spec_decode_metrics.accepted_tokens > 0


def test_sleep_levels_keep_the_tokens_and_free_the_packed_copies(files, uni):
    with LLM(str(files("Q4_K_M")), **KV) as llm:
        llm.sleep(1)
        llm.wake_up()
        assert run(llm) == uni("Q4_K_M")
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        copies = [weakref.ref(model.embed_tokens.packed)] + [
            weakref.ref(m.kernel.tensor) for m in model.modules()
            if isinstance(getattr(m, "kernel", None), Gguf)]
        del model
        llm.sleep(2)
        gc.collect()
        assert [ref() is None for ref in copies] == [True] * len(copies)
        llm.wake_up()
        assert run(llm) == uni("Q4_K_M")


def test_sharded_state_keeps_the_quantized_layout(files, uni, tmp_path):
    path, out = files("Q4_K_M"), tmp_path / "sharded"
    with LLM(str(path), **KV) as llm:
        llm.llm_engine.model_executor.save_sharded_state(out)
    with safe_open(str(out / "model-rank-0-part-0.safetensors"), "pt") as f:
        packed = {k: (f.get_slice(k).get_dtype(), math.prod(f.get_slice(k).get_shape()))
                  for k in f.keys() if k.endswith(".packed")}
    assert "embed_tokens.packed" in packed and "lm_head.packed" not in packed  # tied
    # q/k/v, o, gate/up of 4 layers (down_proj's 688 columns: F16 in the file, kept dense)
    assert len(packed) == 1 + 4 * 3 and {d for d, _ in packed.values()} == {"U8"}, packed
    # The file's blocks as they are (plus the headers), not dequantized
    blocks = sum(int(t.n_bytes) for t in open_gguf(str(path)).reader.tensors
                 if int(t.tensor_type) not in PLAIN)
    assert blocks <= sum(n for _, n in packed.values()) < 1.01 * blocks
    dense = (DEMO / "model.safetensors").stat().st_size  # float32
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < dense / 3
    assert json.loads((out / META).read_text())["gguf"] == path.name
    with LLM(str(out), load_format="sharded_state", **KV) as llm:
        assert run(llm) == uni("Q4_K_M")
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        assert isinstance(model.layers["0"].self_attn.qkv_proj.kernel, Gguf)
        assert model.lm_head.kernel.tensor is model.embed_tokens.packed
        llm.llm_engine.model_executor.save_sharded_state(tmp_path / "again")  # still GGUF's
    assert json.loads((tmp_path / "again" / META).read_text())["gguf"] == path.name
    assert (tmp_path / "again" / "model-rank-0-part-0.safetensors").stat().st_size == \
        (out / "model-rank-0-part-0.safetensors").stat().st_size
