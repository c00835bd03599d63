"""Expert parallelism (enable_expert_parallel=True): each tensor-parallel rank holds whole
experts, E / N of them, vLLM's contiguous split, and loads no other expert's tensors; the
tokens of TP=2 with EP on mp (and Ray) against TP=2 without it and against transformers
(tiny checkpoints: tests/moe/moe_checkpoints.py), a GGUF Q8_0 file TP=2 refuses loading
under EP, sleep/wake and sharded state under EP, and what is refused or ignored."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import test_moe_gguf
from helpers import greedy_run
from test_moe_gguf import gguf_files  # noqa: F401 - the fixture
from test_moe_models import (
    MAX_TOKENS,
    _prompts,
    check_against_transformers,
    make_executor,
    moe_models,  # noqa: F401 - the fixture
)

from fleetllm.config import EngineConfig
from fleetllm.engine.arg_utils import add_engine_args, engine_kwargs_from
from fleetllm.errors import ConfigurationError

EP = dict(tensor_parallel_size=2, enable_expert_parallel=True)


def _held_experts(executor) -> list[list[tuple[int, int, int, bool]]]:
    """Per rank, per MoE layer: (first expert, experts held, w13's or the packed copies'
    expert count, expert parallel)."""
    def held(worker):
        from fleetllm.model.moe_experts import FusedExperts

        out = []
        for m in worker.model_runner.model.modules():
            if isinstance(m, FusedExperts):
                count = m.w13.shape[0] if m.packed is None else (m.bounds.numel() - 1) // 2
                out.append((m.first, m.local, count, m.ep))
        return out
    return executor.collective_rpc(held)


def _same_tokens(a, b) -> int:
    return sum(x == y for (x, _), (y, _) in zip(a, b, strict=True))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_expert_parallel_matches_tp_and_transformers_on_mp(moe_models, name):  # noqa: F811
    """8 experts on 2 ranks: rank 0 holds experts 0-3, rank 1 4-7, whole (w13 [4, 2I, H]);
    the greedy tokens are TP=2's and transformers' (qwen2_moe: its shared expert still split
    by TP)."""
    path = moe_models[name]
    with make_executor(path, distributed_executor_backend="mp", **EP) as ex:
        held = _held_experts(ex)
        ours = greedy_run(ex, _prompts(), MAX_TOKENS)
    assert [layers[0] for layers in held] == [(0, 4, 4, True), (4, 4, 4, True)]
    with make_executor(path, distributed_executor_backend="mp", tensor_parallel_size=2) as ex:
        assert _held_experts(ex)[1][0] == (0, 8, 8, False)  # TP: a slice of every expert
        tp = greedy_run(ex, _prompts(), MAX_TOKENS)
    assert _same_tokens(ours, tp) >= 0.9 * len(tp)
    check_against_transformers(path, ours)


def test_expert_parallel_on_ray(moe_models):  # noqa: F811
    pytest.importorskip("ray")
    with make_executor(moe_models["qwen2_moe"], distributed_executor_backend="ray",
                       ray_cpus_per_worker=0.5, **EP) as ex:
        assert [layers[0][:2] for layers in _held_experts(ex)] == [(0, 4), (4, 4)]
        ours = greedy_run(ex, _prompts(), MAX_TOKENS)
    check_against_transformers(moe_models["qwen2_moe"], ours)


def test_gguf_experts_tp_refuses_load_under_expert_parallel(gguf_files):  # noqa: F811
    """Q8_0 experts of width 32: TP=2 would split down's blocks of 32 (refused:
    test_moe_gguf.py), EP keeps each expert whole, packed on its rank only (4 experts' copies
    a rank); the tokens are transformers' on the dequantized file; sleep(2) frees and wake_up
    reloads this rank's experts to the same tokens."""
    hf_dir, path = gguf_files("qwen3moe-Q8_0")
    prompts, max_tokens = test_moe_gguf._prompts(), test_moe_gguf.MAX_TOKENS
    with make_executor(path, distributed_executor_backend="mp", **EP) as ex:
        held = _held_experts(ex)
        ours = greedy_run(ex, prompts, max_tokens)
        ex.sleep(2)
        ex.wake_up()
        assert _held_experts(ex) == held
        again = greedy_run(ex, prompts[:4], max_tokens)
    assert [layers[0] for layers in held] == [(0, 4, 4, True), (4, 4, 4, True)]
    test_moe_gguf.check_against_transformers(hf_dir, path, ours)
    assert [t for t, _ in again] == [t for t, _ in ours[:4]]


def test_sharded_state_keeps_its_expert_layout(moe_models, tmp_path):  # noqa: F811
    """A state saved under EP loads back under EP to the same tokens; without EP, whose ranks
    hold a slice of every expert instead, it is refused by name."""
    with make_executor(moe_models["qwen3_moe"], distributed_executor_backend="mp",
                       **EP) as ex:
        want = greedy_run(ex, _prompts()[:3], MAX_TOKENS)
        ex.save_sharded_state(tmp_path / "state")
    with make_executor(tmp_path / "state", load_format="sharded_state",
                       distributed_executor_backend="mp", **EP) as ex:
        got = greedy_run(ex, _prompts()[:3], MAX_TOKENS)
    assert [t for t, _ in got] == [t for t, _ in want]
    with pytest.raises(Exception, match="enable_expert_parallel=True"):
        make_executor(tmp_path / "state", load_format="sharded_state",
                      distributed_executor_backend="mp", tensor_parallel_size=2)


def _edited(src, dst, **change):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    return dst


def test_experts_not_divisible_by_ranks_refused(moe_models, tmp_path):  # noqa: F811
    path = _edited(moe_models["qwen3_moe"], tmp_path / "ckpt", num_experts=9)
    with pytest.raises(ConfigurationError,
                       match="enable_expert_parallel: 9 experts are not divisible by "
                             "tensor_parallel_size=2"):
        EngineConfig.from_kwargs(model=str(path), **EP)
    EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2)  # TP alone: fine


def test_expert_width_need_not_divide_under_expert_parallel(moe_models, tmp_path):  # noqa: F811
    """Whole experts: their intermediate size is not split, so 33 is fine under EP."""
    path = _edited(moe_models["qwen3_moe"], tmp_path / "ckpt", moe_intermediate_size=33)
    with pytest.raises(ConfigurationError, match="experts' intermediate size 33"):
        EngineConfig.from_kwargs(model=str(path), tensor_parallel_size=2)
    cfg = EngineConfig.from_kwargs(model=str(path), **EP)
    assert cfg.parallel_config.enable_expert_parallel


def test_dense_model_ignores_expert_parallel():
    """As vLLM: the flag changes only MoE layers; a dense model is built as without it."""
    from fleetllm.engine.arg_utils import DEMO_MODEL

    cfg = EngineConfig.from_kwargs(model=str(DEMO_MODEL), enable_expert_parallel=True)
    assert not cfg.model_config.arch.num_experts and cfg.parallel_config.enable_expert_parallel


def test_cli_flag():
    parser = argparse.ArgumentParser()
    actions = add_engine_args(parser)
    args = parser.parse_args(["--tensor-parallel-size", "2", "--enable-expert-parallel"])
    assert engine_kwargs_from(args, actions) == EP


class _Unread:
    """A checkpoint tensor that fails when anything reads it."""

    def __getitem__(self, index):
        raise AssertionError("another rank's expert was read")

    def narrow(self, *args):
        raise AssertionError("another rank's expert was read")


def test_a_rank_reads_only_its_own_experts(monkeypatch):
    """Rank 1 of 2 with EP holds experts 4-7 whole: experts 0-3's tensors are never read,
    4-7's land at local index 0-3 unsplit, and the layer is complete once they are in."""
    import torch

    from fleetllm.distributed import parallel_state
    from fleetllm.model.moe_experts import DOWN, GATE, UP, FusedExperts

    monkeypatch.setattr(parallel_state, "_TP", parallel_state.GroupCoordinator([0, 1], 1))
    monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", True)
    experts = FusedExperts(8, hidden_size=16, intermediate_size=12)
    assert (experts.first, experts.local, tuple(experts.w13.shape)) == (4, 4, (4, 24, 16))
    done = []
    for e in range(8):
        for part, shape in ((GATE, (12, 16)), (UP, (12, 16)), (DOWN, (16, 12))):
            tensor = _Unread() if e < 4 else torch.full(shape, float(e * 3 + part))
            done.append(experts.load_expert(e, part, tensor))
    assert done[-1] and not any(done[:-4])  # gate/up complete at expert 7's up, down last
    assert torch.equal(experts.w13.data[3, :12], torch.full((12, 16), 21.0))  # expert 7 gate
    assert torch.equal(experts.w2.data[0], torch.full((16, 12), 14.0))  # expert 4 down


def test_dummy_weights_under_expert_parallel(moe_models, tmp_path):  # noqa: F811
    """load_format="dummy" (the bench presets): each rank makes only its experts' tensors
    (loader._LazyDummy) and the tokens are one process's."""
    from fleetllm import LLM, SamplingParams

    (tmp_path / "config.json").write_text((moe_models["qwen3_moe"] / "config.json").read_text())
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = []
    for kwargs in ({}, dict(distributed_executor_backend="mp", **EP)):
        with LLM(tmp_path, kv_cache_memory=16 << 20, load_format="dummy", seed=3,
                 **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert tokens[0] == tokens[1]


def test_expert_parallel_with_pipeline_stages(moe_models):  # noqa: F811
    """TP=2 x PP=2 with EP (4 workers): each stage spreads its MoE layer's experts over its
    two ranks; tokens and expert load as one process gives them."""
    from fleetllm import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 20, 41)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    results = []
    for kwargs in ({}, dict(pipeline_parallel_size=2, distributed_executor_backend="mp",
                            **EP)):
        with LLM(moe_models["qwen3_moe"], kv_cache_memory=16 << 20, **kwargs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append(([list(o.outputs[0].token_ids) for o in outs],
                            llm.llm_engine.expert_load()))
    assert results[1] == results[0] and sorted(results[0][1]) == [0, 2]
