"""AWQ, GPTQ and compressed-tensors checkpoints (fleetllm quantize --type AWQ|GPTQ|W4A16|W8A8
writes them): greedy tokens and logprobs against transformers running a float32 model of the
same weights dequantized by code independent of fleetllm's reader (the formats' arithmetic
below; compressed-tensors' own decompressor), the layouts' bit orders, tensor parallelism, and
one clear error for what is not read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import make_checkpoint
from safetensors import safe_open
from test_gguf_model import LOGPROB_TOL, PROMPTS, TOKENS

from fleetllm import LLM, SamplingParams
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.quant.groups import GroupQuant
from fleetllm.quant.hf_checkpoint import unpack
from fleetllm.quant.hf_export import export_quantized
from fleetllm.quant.packed import QType

SIZES = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
INT8_ACTS_TOL = 0.05  # W8A8's logprobs (test_matches_transformers_on_the_dequantized_weights)
# name: (format, export options)
CASES = {
    "awq-g128": ("AWQ", dict(group_size=128)),
    "awq-g32": ("AWQ", dict(group_size=32)),
    "gptq-sym-g128": ("GPTQ", dict(group_size=128)),
    "gptq-asym-g64": ("GPTQ", dict(group_size=64, sym=False)),
    "gptq-act-order": ("GPTQ", dict(group_size=64, act_order=True)),
    "gptq-8bit-channel": ("GPTQ", dict(bits=8, group_size=-1)),
    "gptq-8bit-asym-g128": ("GPTQ", dict(bits=8, group_size=128, sym=False)),
    "w4a16-g128": ("W4A16", dict(group_size=128)),
    "w4a16-asym-g32": ("W4A16", dict(group_size=32, sym=False)),
    "w8a8": ("W8A8", {}),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("hfq") / "llama", "LlamaForCausalLM",
                           seed=5, **SIZES)


@pytest.fixture(scope="module")
def checkpoints(source, tmp_path_factory):
    root = tmp_path_factory.mktemp("hfq-out")
    made: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in made:
            fmt, options = CASES[case]
            made[case] = export_quantized(source, root / case, fmt, **options)
        return made[case]
    return get


# --- an independent reading of each format: the arithmetic the formats document -------------

def _nibbles(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    per, mask = 32 // bits, (1 << bits) - 1
    shifts = torch.arange(per, dtype=torch.int32) * bits
    x = words.unsqueeze(dim + 1) >> shifts.view(*([per] + [1] * (words.dim() - dim - 1)))
    x = x & mask
    shape = list(words.shape)
    shape[dim] *= per
    return x.reshape(shape)


def _awq(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's int32 words [R, C] -> [R, 8 C]: column j of each 8 at these bits."""
    shifts = torch.tensor([0, 16, 4, 20, 8, 24, 12, 28], dtype=torch.int32)
    return ((words.unsqueeze(-1) >> shifts) & 15).reshape(words.shape[0], -1)


def _decompressed(t: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """compressed-tensors' own decompressor, given its scales in float32 (transformers'
    integration would multiply in the scales' bf16)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate(group)
    compressor = BaseCompressor.get_value_from_registry(group["format"])
    out = {}
    for name in list(t):
        prefix, _, last = name.rpartition(".")
        if last in ("weight_packed",) or (last == "weight" and t[name].dtype == torch.int8):
            local = {k.removeprefix(prefix + "."): v for k, v in t.items()
                     if k.startswith(prefix + ".weight")}
            local["weight_scale"] = local["weight_scale"].float()
            out[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    return out


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, projections dequantized to float32 (AWQ, GPTQ: as
    AutoAWQ / auto-gptq dequantize; compressed-tensors by its own library)."""
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        t = {name: f.get_tensor(name) for name in f.keys()}
    if config["quant_method"] == "compressed-tensors":
        out = _decompressed(t, config)
        return {**{k: v for k, v in t.items() if ".weight_" not in k and k not in out
                   and v.dtype != torch.int8}, **out}
    out = {}
    for name, value in t.items():
        prefix, _, last = name.rpartition(".")
        if last == "qweight" and config["quant_method"] == "awq":
            g = value.shape[0] // t[f"{prefix}.scales"].shape[0]
            w = (_awq(value) - _awq(t[f"{prefix}.qzeros"]).repeat_interleave(g, 0)) * \
                t[f"{prefix}.scales"].float().repeat_interleave(g, 0)
            out[f"{prefix}.weight"] = w.T.contiguous()
        elif last == "qweight":
            bits = config["bits"]
            q = _nibbles(value, bits, 0)
            z = _nibbles(t[f"{prefix}.qzeros"], bits, 1) + 1
            g_idx = t[f"{prefix}.g_idx"].long()
            w = (q - z[g_idx]) * t[f"{prefix}.scales"].float()[g_idx]
            out[f"{prefix}.weight"] = w.T.contiguous()
        elif last in ("qzeros", "scales", "g_idx"):
            continue
        else:
            out[name] = value
    return out


def load_reference(path: Path) -> transformers.PreTrainedModel:
    """transformers' float32 model of the checkpoint's weights dequantized (reference_weights);
    for int8 input activations (W8A8), each quantized projection's x rounded to int8 per token
    first, as the format (and vLLM) does, by an arithmetic written here."""
    config = transformers.AutoConfig.from_pretrained(path)
    scheme = config.quantization_config.get("config_groups", {}).get("group_0", {})
    int8_acts = bool(scheme.get("input_activations"))
    del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(
        {k: v.float() for k, v in reference_weights(path).items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    if int8_acts:
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.register_forward_pre_hook(lambda _, args: (_per_token_int8(args[0]),))
    return model.eval()


def _per_token_int8(x: torch.Tensor) -> torch.Tensor:
    scale = x.abs().amax(-1, keepdim=True) / 127
    return torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)) * scale


def reference(path: Path) -> tuple[list[list[int]], list[torch.Tensor]]:
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = load_reference(path)
    tokens, logits = [], []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        steps = []
        with torch.no_grad():
            for _ in range(TOKENS):
                steps.append(model(ids).logits[0, -1].float())
                ids = torch.cat([ids, steps[-1].argmax().view(1, 1)], dim=1)
        tokens.append(ids[0, -TOKENS:].tolist())
        logits.append(torch.stack(steps))
    return tokens, logits


def generate(path: Path, **kwargs) -> tuple[list[list[int]], list[list[float]]]:
    with LLM(str(path), max_model_len=128, dtype="float32", **kwargs) as llm:
        params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs],
            [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)] for o in outs])


def check(path: Path, got: list[list[int]], logprobs: list[list[float]],
          tol: float = LOGPROB_TOL) -> None:
    """>= 90% of requests equal, each first difference within the reference's top 5, the
    tokens' logprobs within tol where both agree."""
    want, logits = reference(path)
    equal = 0
    for g, w, lg, lp in zip(got, want, logits, logprobs, strict=True):
        same = next((j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(g))
        if same:
            ref = torch.log_softmax(lg[:same].double(), -1)[torch.arange(same), g[:same]]
            err = (torch.tensor(lp[:same], dtype=torch.float64) - ref).abs().max()
            assert err < tol, f"{path.name}: logprob off by {err:.2e}"
        equal += same == len(g)
        if same < len(g):
            assert g[same] in lg[same].topk(5).indices.tolist(), f"{path.name}: step {same}"
    assert equal >= 0.9 * len(got), f"{path.name}: {equal}/{len(got)} equal"


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers_on_the_dequantized_weights(checkpoints, case):
    """W8A8 (int8 activations): the reference rounds x to int8 per token as the kernels do, but
    a value within float32's rounding of a level's midpoint may round the other way in one of
    them, which moves the logprobs after it by up to ~1e-2: INT8_ACTS_TOL."""
    path = checkpoints(case)
    check(path, *generate(path), tol=INT8_ACTS_TOL if CASES[case][0] == "W8A8" else LOGPROB_TOL)


def test_tensor_parallel_matches_and_refuses_split_act_order_groups(checkpoints):
    path = checkpoints("gptq-sym-g128")
    assert generate(path, tensor_parallel_size=2)[0] == generate(path)[0]
    with pytest.raises(ModelLoadError, match=r"(o_proj|down_proj).*whole blocks of 32"):
        generate(checkpoints("gptq-act-order"), tensor_parallel_size=2)


def test_bf16_model_and_the_fused_paths(checkpoints):
    """dtype bf16 (the CPU default for bf16 checkpoints): the prompt's GEMM path in bf16, the
    one-call decoder layers; tokens as float32's for most requests."""
    path = checkpoints("awq-g128")
    with LLM(str(path), max_model_len=128, dtype="bfloat16") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = generate(path)[0]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= len(PROMPTS) // 2


# --- layouts ------------------------------------------------------------------------------

def test_awq_order_and_sequential_packing():
    # AutoAWQ packs columns 0..7 into a word's nibbles in the order 0 2 4 6 1 3 5 7
    from fleetllm.quant.hf_checkpoint import AWQ_ORDER
    word = np.array([[0x75316420]], dtype=np.uint32).view(np.int32)
    assert unpack(word, 4, 1)[0, list(AWQ_ORDER)].tolist() == list(range(8))
    # GPTQ / compressed-tensors: the first value in the low bits, along either axis
    assert unpack(np.array([[0x76543210]], np.uint32).view(np.int32), 4, 1).tolist() == [
        list(range(8))]
    assert unpack(np.array([[0x04030201]], np.uint32).view(np.int32), 8, 0)[:, 0].tolist() == [
        1, 2, 3, 4]


@pytest.mark.parametrize("bits,zero,qtype", [(4, 8, QType.Q4_0), (4, None, QType.Q4_ZP),
                                             (8, 128, QType.Q8_0), (8, None, QType.Q8_ZP)])
def test_blocks_hold_the_groups_exactly(bits, zero, qtype):
    rng = np.random.default_rng(0)
    n, k, groups = 6, 256, 4
    q = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, (groups, n)).astype(np.float16).astype(np.float32)
    zeros = np.full((groups, n), zero, np.int32) if zero is not None else \
        rng.integers(0, (1 << bits) - 1, (groups, n), dtype=np.int32, endpoint=True)
    for g_idx in (np.arange(k) // (k // groups), rng.permutation(k) // (k // groups)):
        gq = GroupQuant(q, scales, zeros, g_idx, bits)
        blocks = gq.blocks()
        assert blocks.qtype == qtype
        assert (blocks.perm is None) == bool(np.all(np.diff(g_idx) >= 0))
        # exact: the scales are fp16 values, d (q - z) is float32's product of integers
        np.testing.assert_array_equal(blocks.dequantize().numpy(), gq.dequantize())


def test_groups_that_straddle_blocks_are_refused():
    q = np.zeros((2, 64), np.uint8)
    gq = GroupQuant(q, np.ones((4, 2), np.float32), np.full((4, 2), 8, np.int32),
                    np.arange(64) // 16, 4)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        gq.blocks()


# --- what is refused ---------------------------------------------------------------------

def _edit(path: Path, **changes) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_configs_are_one_clear_error(checkpoints, source, tmp_path):
    import shutil
    bad = [({"quant_method": "bitsandbytes"}, "bitsandbytes"),
           ({"version": "gemv"}, "gemv"), ({"group_size": 16}, "group_size 16"),
           ({"zero_point": False}, "zero points")]
    for changes, match in bad:
        path = tmp_path / "awq"
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(checkpoints("awq-g128"), path)
        _edit(path, **changes)
        with pytest.raises(ModelLoadError, match=match) as info:
            LLM(str(path))
        assert str(path / "config.json") in str(info.value)  # which checkpoint
    with pytest.raises(ConfigurationError, match="quantization_config"):
        LLM(str(source), quantization="awq")
    with pytest.raises(ConfigurationError, match="'gptq'"):
        LLM(str(checkpoints("awq-g128")), quantization="gptq")


def test_a_missing_part_names_the_tensor(checkpoints, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    path = tmp_path / "gptq"
    shutil.copytree(checkpoints("gptq-sym-g128"), path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.up_proj\.qzeros"):
        generate(path)


# --- everywhere the engine goes: the packed copies are GGUF's, so a smoke of each path ----

def test_ray_tensor_parallel_matches_uni(checkpoints):
    pytest.importorskip("ray")
    path = checkpoints("awq-g128")
    got = generate(path, tensor_parallel_size=2, distributed_executor_backend="ray",
                   ray_cpus_per_worker=0.5)[0]
    assert got == generate(path)[0]


def test_sharded_state_keeps_the_act_order_layout(checkpoints, tmp_path):
    """The packed copies are saved as they are, perm included, and load back."""
    path, out = checkpoints("gptq-act-order"), tmp_path / "sharded"
    want = generate(path)[0]
    with LLM(str(path), max_model_len=128, dtype="float32") as llm:
        llm.llm_engine.model_executor.save_sharded_state(out)
    quantized = (path / "model.safetensors").stat().st_size
    assert sum(f.stat().st_size for f in out.glob("*.safetensors")) < 1.3 * quantized
    assert generate(out, load_format="sharded_state")[0] == want


HOSTILE = [None, "x", -1, 0, 3, 1e9, [], {}, [1], {"a": 1}, True]


@pytest.mark.parametrize("case", ["awq-g128", "gptq-act-order", "w4a16-asym-g32", "w8a8"])
def test_every_config_field_fuzzed_is_read_or_one_typed_error(checkpoints, case):
    """Each quantization_config field (nested ones too) set to each hostile value: read, or
    ModelLoadError / ConfigurationError; never another exception."""
    from fleetllm.config_quant import resolve
    base = json.loads((checkpoints(case) / "config.json").read_text())

    def paths(node, prefix=()):
        for key, value in node.items():
            yield (*prefix, key)
            if isinstance(value, dict):
                yield from paths(value, (*prefix, key))

    for where in list(paths(base["quantization_config"])):
        for value in HOSTILE:
            config = json.loads(json.dumps(base))
            node = config["quantization_config"]
            for key in where[:-1]:
                node = node[key]
            node[where[-1]] = value
            try:
                resolve(None, config, "config.json")
            except (ModelLoadError, ConfigurationError):
                pass


@pytest.mark.parametrize("case,tensor", [("awq-g128", "qweight"), ("gptq-act-order", "g_idx"),
                                         ("gptq-sym-g128", "scales"),
                                         ("w4a16-asym-g32", "weight_zero_point"),
                                         ("w4a16-g128", "weight_shape"), ("w8a8", "weight")])
def test_a_hostile_tensor_is_one_clear_error(checkpoints, tmp_path, case, tensor):
    """One part of one projection replaced (wrong dtype, wrong shape, values out of range):
    a ModelLoadError naming the tensor, never a crash or a model that loads garbage silently."""
    import shutil

    from safetensors.torch import load_file, save_file
    name = f"model.layers.0.mlp.down_proj.{tensor}"
    for bad in ("dtype", "shape", "range"):
        path = tmp_path / f"{case}-{bad}"
        shutil.copytree(checkpoints(case), path)
        tensors = load_file(path / "model.safetensors")
        t = tensors[name]
        if bad == "dtype":
            t = t.to(torch.float16) if not t.is_floating_point() else t.to(torch.int32)
        elif bad == "shape":
            t = t[:1] if t.dim() == 1 or t.shape[0] > 1 else t[:, :1]
        elif t.is_floating_point() or t.dtype == torch.int32 and tensor != "weight_shape":
            continue  # scales, int32 words of packed values: any value is one
        else:
            t = torch.full_like(t, 10 ** 6 if tensor != "weight" else 127)
            if tensor == "weight":  # int8 weights: every value is one; make the shape wrong
                t = t[:, :-32]
        tensors[name] = t.contiguous()
        save_file(tensors, path / "model.safetensors")
        with pytest.raises(ModelLoadError, match=r"down_proj"):
            generate(path)


def test_sleep_level_2_reloads_the_checkpoint(checkpoints):
    """Sleep level 2 drops the packed copies and repacks them from the directory on wake."""
    path = checkpoints("gptq-act-order")
    want = generate(path)[0]
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(path), max_model_len=128, dtype="float32") as llm:
        llm.sleep(2)
        llm.wake_up()
        outs = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_lora_on_a_quantized_base_matches_peft(checkpoints, source, tmp_path):
    """An adapter made on the float model, served on its AWQ directory: as transformers + peft
    run it on the dequantized weights."""
    from lora_helpers import ATTN, MLP, make_adapter
    from peft import PeftModel

    from fleetllm.lora.request import LoRARequest
    path = checkpoints("awq-g128")
    adapter = make_adapter(source, tmp_path / "adapter", r=8, alpha=16, targets=ATTN + MLP,
                           seed=3, scale=0.1)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    with LLM(str(path), max_model_len=128, dtype="float32", enable_lora=True,
             max_lora_rank=8) as llm:
        outs = llm.generate(PROMPTS, greedy, lora_request=LoRARequest("a", 1, str(adapter)),
                            use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    model = PeftModel.from_pretrained(load_reference(path), str(adapter)).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    want = []
    for p in PROMPTS:
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            for _ in range(TOKENS):
                ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        want.append(ids[0, -TOKENS:].tolist())
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 0.9 * len(PROMPTS)
    assert got != generate(path)[0]  # the delta is applied
