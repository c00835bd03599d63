"""The CUDA path (device="cuda"), which CI cannot run: every test here is skipped unless torch
sees a CUDA device. tools/device_check.sh runs this file on a lent GPU machine.

On the GPU: greedy parity with transformers (float32 token for token, logprobs within 2e-3;
bfloat16 diverging only at near-ties); KV blocks sized by gpu_memory_utilization with used
memory under it; sleep(1) / sleep(2) / wake_up free and restore the KV cache and weights with
the same outputs; mp gives uni's tokens; prefix caching, chunked prefill and preemption give
the same tokens; the C++ CPU kernels are never built or called. Figures are appended as JSON
lines to FLEETLLM_CUDA_REPORT when it is set.
"""

from __future__ import annotations

import gc
import json
import os
import random
import time
from pathlib import Path

import pytest
import torch
from conftest import make_checkpoint

from fleetllm import LLM, SamplingParams

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(180)]

DEMO = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
MODELS = ["llama_gqa", "qwen2_bias", "llama_tied", "qwen3_qknorm", "llama3_rope", "demo"]
SMALL = dict(swap_space=16 << 20)  # no 512 MiB pinned swap pool per engine
MiB = 1 << 20


def report(test: str, **figures) -> None:
    path = os.environ.get("FLEETLLM_CUDA_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}, default=str) + "\n")


def free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _release_after():
    yield
    free_cuda()


def used_bytes() -> tuple[int, int]:
    """(device memory in use by every process, total), as the driver reports it."""
    free, total = torch.cuda.mem_get_info()
    return total - free, total


def rpc(llm: LLM, fn):
    return llm.llm_engine.model_executor.collective_rpc(fn)


def model_path(name: str, tiny_models) -> Path:
    return DEMO if name == "demo" else tiny_models[name]


def random_prompts(vocab: int, count: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))]
            for _ in range(count)]


def hf_cuda(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()


def hf_greedy_cuda(model, prompt: list[int], max_tokens: int
                   ) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate on the GPU: (tokens, raw float32 logits per step, on the
    CPU)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=max_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    return (out.sequences[0, len(prompt):].tolist(),
            [x[0].float().cpu() for x in out.logits])


def first_divergence(ours: list[int], ref: list[int]) -> int | None:
    return next((j for j, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)


# ------------------------------------------------------------------------ parity with HF


def _generate_cuda(path: Path, prompts: list[list[int]], dtype: str | None, **kw):
    params = [SamplingParams(temperature=0, max_tokens=8 + i, ignore_eos=True, logprobs=5)
              for i in range(len(prompts))]  # finishing at different steps
    extra = {} if dtype is None else {"dtype": dtype}
    with LLM(path, device="cuda", **extra, **SMALL, **kw) as llm:
        dtypes = rpc(llm, lambda w: (str(w.device), w.model_runner.dtype,
                                     w.cache_engine.gpu_cache[0].dtype,
                                     w.cache_engine.gpu_cache[0].device.type))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return dtypes, [(o.outputs[0].token_ids,
                     [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                    for o in outs]


@pytest.mark.parametrize("name", MODELS)
def test_float32_greedy_matches_transformers_on_cuda(name, tiny_models):
    """dtype="auto" keeps a float32 checkpoint in float32 on CUDA; 10 prompts batched by the
    engine (prefills, then decodes as requests finish) against transformers one by one on the
    same GPU: tokens identical, but for a divergence at an exact tie (the two logits within
    1e-3), and every step's top-5 logprobs within 2e-3 of transformers'."""
    path = model_path(name, tiny_models)
    cfg = json.loads((path / "config.json").read_text())
    prompts = random_prompts(cfg["vocab_size"], 10, 1, 70, seed=11)
    dtypes, ours = _generate_cuda(path, prompts, None)
    assert dtypes == [("cuda:0", torch.float32, torch.float32, "cuda")], dtypes
    hf = hf_cuda(path, torch.float32)
    same, ties, worst, problems = 0, [], 0.0, []
    for i, (prompt, (tokens, lps)) in enumerate(zip(prompts, ours, strict=True)):
        ref_tokens, logits = hf_greedy_cuda(hf, prompt, len(tokens))
        step = first_divergence(tokens, ref_tokens)
        if step is None:
            same += 1
        else:
            row = logits[step]
            gap = (row.max() - row[tokens[step]]).item()
            ties.append((i, step, gap))
            if gap > 1e-3:
                problems.append(f"prompt {i} step {step}: ours {tokens[step]} is {gap:.2e} "
                                f"below transformers' {ref_tokens[step]}: not a tie")
        for j, (lp, row) in enumerate(zip(lps[:step], logits, strict=False)):
            ref_lp = torch.log_softmax(row, -1)
            for tok, value in lp.items():
                worst = max(worst, abs(value - ref_lp[tok].item()))
            fifth = min(lp.values())  # our top 5 (the greedy token among them)
            for tok in set(ref_lp.topk(5).indices.tolist()) - set(lp):  # a tie at the 5th
                if ref_lp[tok].item() > fifth + 2e-3:
                    problems.append(f"prompt {i} step {j}: transformers' top-5 token {tok} "
                                    f"({ref_lp[tok].item():.4f}) not in ours {lp}")
    report("float32_parity", model=name, identical=same, prompts=len(prompts), ties=ties,
           max_logprob_diff=worst, problems=problems[:5])
    assert not problems, problems
    assert worst <= 2e-3, worst
    assert same >= len(prompts) - 1, (same, ties)


@pytest.mark.parametrize("name", MODELS)
def test_bfloat16_greedy_mostly_matches_transformers_on_cuda(name, tiny_models):
    """bfloat16 weights, activations and KV cache on both sides (the float32 checkpoint
    rounded alike). Different GEMM shapes (our batch, transformers' single prompt) round
    differently on the GPU, so a request may diverge: at least 3/4 must be identical, and
    every first divergence must be a bf16 near-tie within transformers' top 5 (our token's
    logit at most 8 bf16 steps below its largest). Logprobs of the steps before any
    divergence: mean difference <= 0.06, max <= 0.5."""
    path = model_path(name, tiny_models)
    cfg = json.loads((path / "config.json").read_text())
    prompts = random_prompts(cfg["vocab_size"], 12, 1, 70, seed=12)
    dtypes, ours = _generate_cuda(path, prompts, "bfloat16")
    assert dtypes == [("cuda:0", torch.bfloat16, torch.bfloat16, "cuda")], dtypes
    hf = hf_cuda(path, torch.bfloat16)
    same, problems, diffs, divergences = 0, [], [], []
    for i, (prompt, (tokens, lps)) in enumerate(zip(prompts, ours, strict=True)):
        ref_tokens, logits = hf_greedy_cuda(hf, prompt, len(tokens))
        step = first_divergence(tokens, ref_tokens)
        if step is None:
            same += 1
        else:
            row = logits[step]
            top = row.max().item()
            ulp = 2.0 ** (torch.tensor(abs(top) or 1.0).log2().floor().item() - 7)
            divergences.append((i, step, round((top - row[tokens[step]].item()) / ulp, 2)))
            if tokens[step] not in row.topk(5).indices.tolist() or \
                    row[tokens[step]] < top - 8 * ulp:
                problems.append(f"prompt {i} step {step}: {tokens[step]} (logit "
                                f"{row[tokens[step]]:.4f}) vs {ref_tokens[step]} ({top:.4f})")
        for lp, row in zip(lps[:step], logits, strict=False):
            ref_lp = torch.log_softmax(row, -1)
            diffs += [abs(v - ref_lp[t].item()) for t, v in lp.items()]
    mean = sum(diffs) / max(1, len(diffs))
    report("bfloat16_parity", model=name, identical=same, prompts=len(prompts),
           divergences_in_bf16_steps=divergences, mean_logprob_diff=mean,
           max_logprob_diff=max(diffs, default=0.0))
    assert not problems, problems
    assert same >= 0.75 * len(prompts), (same, divergences)
    assert mean <= 0.06 and max(diffs, default=0.0) <= 0.5, (mean, max(diffs))


def test_cuda_path_never_builds_or_calls_the_cpu_kernels(tiny_models, monkeypatch):
    """Loading (weight packing asks whether the kernels exist) and running on CUDA never loads
    the C++ CPU kernels: building them needs a host compiler and ~10 s, for nothing."""
    from fleetllm.kernels import cpu_kernels

    def refuse():
        raise AssertionError("the CUDA path tried to load the C++ CPU kernels")

    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_ops", None)
    monkeypatch.setattr(cpu_kernels, "_load", refuse)
    for dtype in ("float32", "bfloat16"):
        with LLM(tiny_models["llama_gqa"], device="cuda", dtype=dtype, **SMALL) as llm:
            outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 20}],
                                SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                                use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)


# ----------------------------------------------------------------------- memory profiling


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """A small model with a long context, so that the block cap (max_num_seqs full-length
    sequences) lies far above what a fraction of the GPU holds: 128 KiB per float32 block."""
    return make_checkpoint(tmp_path_factory.mktemp("long") / "m", "LlamaForCausalLM", seed=5,
                           hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=4, head_dim=64,
                           max_position_embeddings=32768)


def test_kv_blocks_follow_gpu_memory_utilization(long_model):
    """gpu_memory_utilization is the fraction of the device's total memory that may be in use
    (by everything: other processes, this one's weights and activations) once the KV cache is
    allocated. Two engines at 0.3 and 0.6: the cache takes what is left under each line (all
    but the profiled activation peak), so the second holds 0.3 x total more bytes; the device's
    used memory stays under the line after init and after a generate."""
    block_bytes = 2 * 16 * 4 * 64 * 4 * 4  # K and V, block_size 16, 4 KV heads x 64, 4 layers
    runs = {}
    for util in (0.3, 0.6):
        free_cuda()
        before, total = used_bytes()
        with LLM(long_model, device="cuda", gpu_memory_utilization=util, max_model_len=32768,
                 max_num_seqs=1024, swap_space=1 << 20, enable_prefix_caching=False) as llm:
            blocks = llm.llm_engine.config.cache_config.num_gpu_blocks
            [kv] = rpc(llm, lambda w: sum(t.numel() * t.element_size()
                                          for t in w.cache_engine.gpu_cache))
            after_init, _ = used_bytes()
            llm.generate([{"prompt_token_ids": [3 + i % 500 for i in range(n)]}
                          for n in (5, 300, 2000)],
                         SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                         use_tqdm=False)
            after_generate, _ = used_bytes()
        runs[util] = dict(blocks=blocks, before=before, after_init=after_init,
                          after_generate=after_generate)
        report("memory_profiling_run", util=util, total_bytes=total, kv_bytes=kv, **runs[util])
        line = util * total
        assert kv == blocks * block_bytes
        assert blocks < 1024 * 2048  # the budget decided, not the cap
        assert after_init <= line + 64 * MiB, (util, after_init / MiB, line / MiB)
        assert after_generate <= line + 256 * MiB, (util, after_generate / MiB, line / MiB)
        # all of the room under the line but the weights and the activation peak
        assert kv >= line - before - 512 * MiB, (util, kv / MiB, (line - before) / MiB)
    a, b = runs[0.3], runs[0.6]
    expected = (0.3 * total - (b["before"] - a["before"])) / block_bytes
    got = b["blocks"] - a["blocks"]
    report("memory_profiling", total_bytes=total, block_bytes=block_bytes, runs=runs,
           extra_blocks=got, expected_extra_blocks=expected)
    assert abs(got - expected) <= 0.01 * expected + 256 * MiB / block_bytes, (got, expected)


# ----------------------------------------------------------------------------- sleep / wake


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """~100 MB of float32 weights (as test_lifecycle's)."""
    return make_checkpoint(tmp_path_factory.mktemp("big") / "m", "LlamaForCausalLM", seed=3,
                           hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                           vocab_size=16384)


PROMPTS = [{"prompt_token_ids": [5 + i, 17, 99, 300 + 7 * i, 42, 8 + i] * (1 + 3 * i)}
           for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)


def greedy(llm: LLM, prompts=PROMPTS) -> list[tuple[list[int], list[dict]]]:
    return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()}
                                      for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def max_logprob_diff(a: list[tuple[list[int], list[dict]]],
                     b: list[tuple[list[int], list[dict]]]) -> float:
    """The same tokens (asserted), and the largest difference of their logprobs."""
    assert [t for t, _ in a] == [t for t, _ in b]
    return max((abs(x[k] - y[k]) for (_, xs), (_, ys) in zip(a, b, strict=True)
                for x, y in zip(xs, ys, strict=True) for k in x), default=0.0)


def test_sleep_and_wake_up_free_and_restore_cuda_memory(big_model):
    with LLM(big_model, device="cuda", max_model_len=1024, **SMALL) as llm:
        reference = greedy(llm)
        [kv] = rpc(llm, lambda w: sum(t.numel() * t.element_size()
                                      for t in w.cache_engine.gpu_cache))
        [weights] = rpc(llm, lambda w: sum(p.numel() * p.element_size()
                                           for p in w.model_runner.model.parameters()))
        assert kv >= 256 * MiB and weights >= 90 * MiB, (kv, weights)
        figures = {"kv_bytes": kv, "weight_bytes": weights}
        try:
            _sleep_and_wake(llm, reference, kv, weights, figures)
        finally:
            report("sleep_wake", **figures)


def _sleep_and_wake(llm: LLM, reference, kv: int, weights: int, figures: dict) -> None:
    """test_sleep_and_wake_up_free_and_restore_cuda_memory's steps (figures: what it
    measured, reported even when a step fails)."""
    # level 1: the KV cache is freed and (on CUDA) the weights move to host memory
    free_cuda()
    awake, used_awake = torch.cuda.memory_allocated(), used_bytes()[0]
    llm.sleep(1)
    asleep, used_asleep = torch.cuda.memory_allocated(), used_bytes()[0]
    assert rpc(llm, lambda w: {p.device.type for p in w.model_runner.model.parameters()}) \
        == [{"cpu"}]
    figures["level1_allocated_drop"] = awake - asleep
    figures["level1_device_used_drop"] = used_awake - used_asleep
    assert awake - asleep >= kv + 0.95 * weights, figures
    assert used_awake - used_asleep >= 0.9 * (kv + weights), figures  # empty_cache'd
    t = time.perf_counter()
    llm.wake_up()
    figures["level1_wake_s"] = time.perf_counter() - t
    assert rpc(llm, lambda w: {p.device.type for p in w.model_runner.model.parameters()}) \
        == [{"cuda"}]
    assert abs(torch.cuda.memory_allocated() - awake) <= 16 * MiB
    assert max_logprob_diff(greedy(llm), reference) <= 1e-4  # the same weights, kernels

    # level 2: the weights are discarded (emptied in place), then loaded again; the
    # weights alone first, then the KV cache
    free_cuda()
    awake = torch.cuda.memory_allocated()
    llm.sleep(2)
    asleep = torch.cuda.memory_allocated()
    assert rpc(llm, lambda w: sum(p.numel() for p in w.model_runner.model.parameters())) \
        == [0]
    figures["level2_allocated_drop"] = awake - asleep
    assert awake - asleep >= kv + 0.95 * weights, figures
    t = time.perf_counter()
    llm.wake_up(["weights"])
    figures["level2_wake_weights_s"] = time.perf_counter() - t
    half_awake = torch.cuda.memory_allocated()
    assert abs(half_awake - (asleep + weights)) <= 16 * MiB, figures
    llm.wake_up(["kv_cache"])
    free_cuda()
    assert abs(torch.cuda.memory_allocated() - awake) <= 16 * MiB
    assert max_logprob_diff(greedy(llm), reference) <= 1e-4


# --------------------------------------------------------------------------- mp backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mp_backend_gives_uni_results_on_cuda(tiny_models, dtype):
    """distributed_executor_backend="mp" with one worker process (the GPU's only one): the
    same tokens as uni, logprobs equal to 1e-4 (the same kernels on the same device), the
    worker in its own process on cuda:0; sleep(1) / wake_up there too."""
    path = tiny_models["qwen2_bias"]
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 8, 1, 60, seed=7)]
    results = {}
    for backend in ("uni", "mp"):
        with LLM(path, device="cuda", dtype=dtype, distributed_executor_backend=backend,
                 **SMALL) as llm:
            ex = llm.llm_engine.model_executor
            where = rpc(llm, lambda w: (os.getpid(), str(w.device)))
            results[backend] = greedy(llm, prompts)
            if backend == "mp":
                assert where[0][0] != os.getpid() and where[0][1] == "cuda:0", where
                assert ex.worker_pids == [where[0][0]]
                llm.sleep(1)
                llm.wake_up()
                assert max_logprob_diff(greedy(llm, prompts), results["mp"]) <= 1e-4
    worst = max_logprob_diff(results["mp"], results["uni"])
    report("mp_vs_uni", dtype=dtype, max_logprob_diff=worst)
    assert worst <= 1e-4, worst


# ------------------------------------------------- prefix caching, chunked prefill, swapping


def test_prefix_caching_and_chunked_prefill_give_the_same_results_on_cuda(tiny_models):
    """Prompts sharing a 70-token prefix, one by one (later ones hit the cache) and then all
    at once, with prefix caching and a 32-token budget (every prompt prefilled in chunks, over
    cached blocks), against no caching and a budget that takes each prompt whole: the same
    greedy and seeded-sampled tokens, and prompt logprobs."""
    rng = random.Random(4)
    system = [rng.randrange(3, 500) for _ in range(70)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(3, 500) for _ in range(n)]}
               for n in (1, 5, 30, 17, 0, 90)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]

    def summary(outs):
        """Per request: every sample's tokens, and its prompt logprobs (or None)."""
        return [([c.token_ids for c in o.outputs],
                 o.prompt_logprobs and [d and {k: v.logprob for k, v in d.items()}
                                        for d in o.prompt_logprobs]) for o in outs]

    def assert_same(a, b):
        """The same tokens; prompt logprobs within 1e-3 (the paths attend with different
        SDPA calls: causal, or an explicit mask over cached blocks)."""
        assert [t for t, _ in a] == [t for t, _ in b]
        for (_, x), (_, y) in zip(a, b, strict=True):
            assert (x is None) == (y is None)
            for dx, dy in zip(x or [], y or [], strict=True):
                assert (dx is None) == (dy is None)
                common = set(dx or {}) & set(dy or {})  # the prompt token, and the top 1
                assert dx is None or common, (dx, dy)
                for k in common:
                    assert abs(dx[k] - dy[k]) <= 1e-3, (k, dx[k], dy[k])

    results, hits = {}, {}
    for caching, budget in ((False, 2048), (True, 32)):
        with LLM(tiny_models["llama_gqa"], device="cuda", enable_prefix_caching=caching,
                 max_num_batched_tokens=budget, **SMALL) as llm:
            one_by_one = [llm.generate(p, sp, use_tqdm=False)[0]
                          for p, sp in zip(prompts, params, strict=True)]
            together = llm.generate(prompts, params, use_tqdm=False)
            bm = llm.llm_engine.scheduler.block_manager
            hits[caching] = bm.prefix_cache.hit_tokens if caching else 0
        results[caching] = (summary(one_by_one), summary(together))
    report("prefix_caching_chunked_prefill", hit_tokens=hits[True])
    assert hits[True] >= 4 * 64, hits  # 70 shared tokens: 4 full blocks per later prompt
    assert_same(results[True][0], results[False][0])
    assert_same(results[True][1], results[False][1])
    assert_same(results[False][0], results[False][1])  # batched or alone: the same


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preemption_gives_the_same_results_on_cuda(tiny_models, mode):
    """40 blocks for 12 sequences that need ~6 each: preempted sequences are swapped out to
    the pinned host pool and back (CacheEngine.swap_out/swap_in across devices), or
    recomputed, with the same tokens as without preemption."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(380, 12, 40, 90, seed=5)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    path = tiny_models["llama_gqa"]
    with LLM(path, device="cuda", **SMALL) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    with LLM(path, device="cuda", num_gpu_blocks_override=40, preemption_mode=mode,
             swap_space=1 << 28) as llm:
        assert rpc(llm, lambda w: w.cache_engine.cpu_cache[0].is_pinned()) == [True]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        scheduler = llm.llm_engine.scheduler
        preemptions = scheduler.num_preemptions
        assert scheduler.block_manager.num_free_gpu_blocks == 40
    report("preemption", mode=mode, preemptions=preemptions)
    assert preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference


def test_speculative_decoding_gives_the_same_tokens_on_cuda(tiny_models):
    """n-gram speculative decoding on cuda: a decode with drafts is several decode rows
    (the torch decode path there, not the CPU kernel); greedy and seeded outputs are the same
    tokens as without it, and drafts are accepted."""
    prompts = [{"prompt_token_ids": ([5, 9, 17, 33, 40 + i] * 12)[:30 + 5 * i]} for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=40, ignore_eos=True)] * 4
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    path = tiny_models["llama_gqa"]
    results = {}
    for on in (False, True):
        kw = {"speculative_config": spec} if on else {}
        with LLM(path, device="cuda", block_size=4, **SMALL, **kw) as llm:
            results[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                         use_tqdm=False)]
            if on:
                metrics = llm.llm_engine.spec_decode_metrics
    report("spec_decode", accepted=metrics.accepted_tokens, drafted=metrics.draft_tokens)
    assert metrics.accepted_tokens > 0
    assert results[True] == results[False]


def test_a_draft_model_gives_the_same_tokens_on_cuda():
    """The demo model with its bundled draft on cuda: the draft's own cache and passes on the
    GPU, the same greedy tokens as without it, and its drafts accepted."""
    from fleetllm.engine.arg_utils import DEMO_DRAFT, DEMO_MODEL

    prompts = ["def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = {"method": "draft_model", "model": str(DEMO_DRAFT), "num_speculative_tokens": 3}
    results = {}
    for on in (False, True):
        kw = {"speculative_config": spec} if on else {}
        with LLM(DEMO_MODEL, device="cuda", **SMALL, **kw) as llm:
            results[on] = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                         use_tqdm=False)]
            if on:
                metrics = llm.llm_engine.spec_decode_metrics
    report("draft_model", accepted=metrics.accepted_tokens, drafted=metrics.draft_tokens)
    assert results[True] == results[False]
    assert metrics.draft_acceptance_rate > 0.3, metrics


@pytest.mark.parametrize("mix", ["mixed", "greedy"])
@pytest.mark.parametrize("backend", ["uni", "mp"])
def test_multi_step_gives_the_same_tokens_on_cuda(tiny_models, backend, mix):
    """num_scheduler_steps=8 on cuda: the worker's k passes feed the sampled tokens back on
    the GPU (broadcast from the output rank, a worker process with mp); greedy and seeded
    outputs are the tokens of one pass per call, with n=2 and max_tokens inside a call. All
    greedy on one rank: the lean path's loop (greedy_passes.py; no C call on cuda)."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts(512, 6, 3, 40, seed=11)]
    params = [SamplingParams(temperature=0, max_tokens=29, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=21, ignore_eos=True)] * 3
    if mix == "greedy":
        params = [SamplingParams(temperature=0, max_tokens=21 + 4 * i, ignore_eos=True)
                  for i in range(6)]
    path = tiny_models["llama_gqa"]
    results = {}
    for k in (1, 8):
        with LLM(path, device="cuda", num_scheduler_steps=k,
                 distributed_executor_backend=backend, **SMALL) as llm:
            results[k] = [[c.token_ids for c in o.outputs]
                          for o in llm.generate(prompts, params, use_tqdm=False)]
    report("multi_step", backend=backend, mix=mix, requests=len(prompts))
    assert results[8] == results[1]
