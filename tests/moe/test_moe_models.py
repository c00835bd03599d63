"""MoE checkpoints (Qwen3-MoE, Qwen2-MoE, Mixtral; tests/moe/moe_checkpoints.py) against
transformers in float32, on one process, mp TP=2 / PP=2 and Ray TP=2; unsupported routers
refused before any worker starts."""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
from helpers import check_logprobs_close, greedy_run, hf_greedy, load_hf
from moe_checkpoints import MOE_CONFIGS, make_moe_checkpoint
from safetensors import safe_open

from fleetllm.config import ArchConfig, EngineConfig, hf_tensor_shapes
from fleetllm.errors import ConfigurationError, ModelLoadError
from fleetllm.executor import Executor
from fleetllm.kernels import cpu_kernels
from fleetllm.model import moe_experts

# Logprobs where our tokens and transformers' agree: float32 on both sides, measured at most
# 1.5e-6 apart (C++ op and PyTorch path alike); the bound leaves room for other CPUs' sums.
LOGPROB_ATOL = 1e-4
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: make_moe_checkpoint(root / name, arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(MOE_CONFIGS.items())}


def make_executor(path, **kwargs) -> Executor:
    cfg = EngineConfig.from_kwargs(model=str(path), kv_cache_memory=32 << 20, **kwargs)
    executor = Executor.get_class(cfg)(cfg)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    return executor


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 7, 16, 33, 70)]


def check_against_transformers(path, ours) -> None:
    """>= 90% of the requests give transformers' greedy tokens; every one is within the
    other's top-5 at its first difference; logprobs within LOGPROB_ATOL where they agree."""
    hf = load_hf(path)
    same = 0
    for prompt, (tokens, lps) in zip(_prompts(), ours, strict=True):
        ref_tokens, ref_rows = hf_greedy(hf, prompt, MAX_TOKENS)
        same += check_logprobs_close(tokens, lps, ref_tokens, ref_rows)
        for pos, lp in enumerate(lps):
            if tokens[:pos + 1] != ref_tokens[:pos + 1]:
                break
            for tok, value in lp.items():
                assert math.isclose(value, ref_rows[pos][tok].item(), abs_tol=LOGPROB_ATOL), \
                    (pos, tok, value, ref_rows[pos][tok].item())
    assert same >= 0.9 * len(ours), f"{same} of {len(ours)} requests identical"


@pytest.mark.parametrize("kernel", ["chosen", "pytorch"])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_matches_transformers_in_one_process(moe_models, name, kernel, monkeypatch):
    if kernel == "pytorch":  # the path CUDA and builds without the kernels take
        monkeypatch.setattr(moe_experts.FusedExperts, "choose_kernel",
                            lambda self: setattr(self, "kernel", moe_experts.torch_experts))
    with make_executor(moe_models[name]) as executor:
        model = executor.driver_worker.model_runner.model
        experts = [m for m in model.modules() if isinstance(m, moe_experts.FusedExperts)]
        assert experts, "no MoE layer was built"
        if kernel == "chosen" and cpu_kernels.available():  # the C++ op, chosen at load
            assert all(m.kernel is moe_experts.cpu_experts for m in experts)
        ours = greedy_run(executor, _prompts(), MAX_TOKENS)
    check_against_transformers(moe_models[name], ours)


@pytest.mark.parametrize("name,layout", [
    ("qwen2_moe", dict(tensor_parallel_size=2)),       # shared expert split too
    ("qwen3_moe", dict(tensor_parallel_size=2)),       # a dense layer among MoE ones
    ("mixtral", dict(tensor_parallel_size=2)),
    ("qwen3_moe_norm", dict(pipeline_parallel_size=2)),
], ids=["qwen2_moe-tp2", "qwen3_moe-tp2", "mixtral-tp2", "qwen3_moe_norm-pp2"])
def test_matches_transformers_on_mp(moe_models, name, layout):
    with make_executor(moe_models[name], distributed_executor_backend="mp", **layout) as ex:
        ours = greedy_run(ex, _prompts(), MAX_TOKENS)
    check_against_transformers(moe_models[name], ours)


def test_matches_transformers_on_ray_tp2(moe_models):
    pytest.importorskip("ray")
    with make_executor(moe_models["qwen2_moe"], tensor_parallel_size=2,
                       distributed_executor_backend="ray", ray_cpus_per_worker=0.5) as ex:
        ours = greedy_run(ex, _prompts(), MAX_TOKENS)
    check_against_transformers(moe_models["qwen2_moe"], ours)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_tensor_shapes_name_every_checkpoint_tensor(moe_models, name):
    """hf_tensor_shapes (dummy weights, the bench presets) lists exactly transformers' tensors."""
    path = moe_models[name]
    arch = ArchConfig.from_dict(json.loads((path / "config.json").read_text()))
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert hf_tensor_shapes(arch) == saved


@pytest.mark.parametrize("change,message", [
    ({"n_group": 4, "topk_group": 2}, "grouped top-k"),
    ({"scoring_func": "sigmoid"}, "scoring function"),
    ({"e_score_correction_bias": True}, "router score bias"),
    ({"router_bias": True}, "router bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"architectures": ["DeepseekV3ForCausalLM"]}, "DeepseekV3ForCausalLM"),
    ({"architectures": ["Qwen3MoeModel"]}, "Qwen3MoeModel"),
])
def test_unsupported_router_refused_before_any_worker(moe_models, tmp_path, change, message,
                                                     monkeypatch):
    path = tmp_path / "ckpt"
    shutil.copytree(moe_models["qwen3_moe"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **change}))

    def no_workers(*args, **kwargs):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(Executor, "get_class", no_workers)
    with pytest.raises(ModelLoadError, match=message):
        EngineConfig.from_kwargs(model=str(path), kv_cache_memory=32 << 20)


def test_quantized_experts_and_lora_refused(moe_models, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(moe_models["qwen3_moe"], path)
    with pytest.raises(ConfigurationError, match="LoRA adapters on mixture-of-experts"):
        EngineConfig.from_kwargs(model=str(path), enable_lora=True)
    cfg = json.loads((path / "config.json").read_text())
    awq = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
           "version": "gemm"}
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": awq}))
    with pytest.raises(ModelLoadError, match="quantized experts"):
        EngineConfig.from_kwargs(model=str(path))


def test_tensor_parallel_size_must_divide_the_experts(moe_models, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(moe_models["qwen3_moe"], path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 33}))
    with pytest.raises(ConfigurationError, match="experts' intermediate size 33"):
        EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2)


def test_dummy_weights_of_a_moe_preset_are_its_checkpoint_tensors(tmp_path):
    """load_format="dummy" (the bench presets) fills the experts under the checkpoint names
    hf_tensor_shapes gives: the same tokens as those tensors written to safetensors."""
    import torch

    from fleetllm import LLM, SamplingParams
    from fleetllm.benchmarks.checkpoint import write_dummy_checkpoint
    from fleetllm.benchmarks.presets import PRESETS

    cfg = {**PRESETS["qwen3-moe-small"], "vocab_size": 512, "hidden_size": 64,
           "moe_intermediate_size": 32, "num_experts": 16, "num_experts_per_tok": 4,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
           "max_position_embeddings": 1024}
    (tmp_path / "preset").mkdir()
    (tmp_path / "preset" / "config.json").write_text(json.dumps(cfg))
    written = write_dummy_checkpoint(tmp_path / "preset", tmp_path / "ckpt", 3, torch.float32)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = []
    for path, kwargs in ((tmp_path / "preset", dict(load_format="dummy", seed=3)),
                         (written, {})):
        with LLM(path, kv_cache_memory=16 << 20, **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1] and all(len(t) == 6 for t in tokens[0])


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral"])
def test_dummy_weights_match_the_transformers_peer(moe_models, name, tmp_path):
    """`bench --compare hf` on a MoE preset: transformers given the dummy tensors (stacked as
    its experts are, hf_peers) computes what fleetllm's load_format="dummy" does."""
    import torch

    from fleetllm import LLM, SamplingParams
    from fleetllm.benchmarks.hf_peers import HFGenerate, load_hf_model
    from fleetllm.benchmarks.workload import Request

    (tmp_path / "config.json").write_text((moe_models[name] / "config.json").read_text())
    g = torch.Generator().manual_seed(5)
    requests = [Request(torch.randint(3, 512, (n,), generator=g).tolist(), 5)
                for n in (3, 17, 30)]
    with LLM(tmp_path, kv_cache_memory=16 << 20, load_format="dummy", seed=3) as llm:
        outs = llm.generate([{"prompt_token_ids": r.prompt} for r in requests],
                            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    hf = HFGenerate(load_hf_model(str(tmp_path), 3), batch_size=1).run(requests)
    assert ours == [list(t) for t in hf]


def test_multi_step_and_speculative_decoding_run_the_experts(moe_models):
    """The one-call decode paths (model/fused.py: greedy passes) do not apply to MoE layers;
    multi-step and n-gram drafts fall back to the modules and give the same tokens."""
    from fleetllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = []
    for kwargs in ({}, {"num_scheduler_steps": 4},
                   {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                           "prompt_lookup_max": 3}}):
        with LLM(moe_models["qwen2_moe"], kv_cache_memory=16 << 20, **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([list(o.outputs[0].token_ids) for o in outs])
    assert results[0] == results[1] == results[2]


def test_sharded_state_round_trip(moe_models, tmp_path):
    """A MoE model's sharded state (the experts' stacked w13 / w2 as parameters) saves and
    loads back to the same greedy tokens (saving once failed on the experts' kernel)."""
    with make_executor(moe_models["qwen2_moe"]) as executor:
        want = greedy_run(executor, _prompts(), MAX_TOKENS)
        executor.save_sharded_state(tmp_path / "state")
    with make_executor(tmp_path / "state", load_format="sharded_state") as executor:
        got = greedy_run(executor, _prompts(), MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in want]
