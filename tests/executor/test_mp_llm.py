"""LLM.generate on the mp backend: tensor and pipeline parallel runs give the greedy tokens of
the single-process run (issue: MultiprocExecutor, acceptance 1)."""

from __future__ import annotations

import random

import pytest
from conftest import make_checkpoint

from fleetllm import LLM, SamplingParams

KV = 32 << 20


def prompts_32(seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 380) for _ in range(rng.randint(1, 300))]}
            for _ in range(32)]


def greedy(path, prompts, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with LLM(path, kv_cache_memory=KV, **kwargs) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def kv1_model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("kv1") / "m", "LlamaForCausalLM", seed=5,
                           num_key_value_heads=1)


@pytest.mark.parametrize("name", ["llama_gqa", "kv1", "llama_tied"])
def test_tp_pp_layouts_match_single_process(tiny_models, kv1_model, name):
    path = kv1_model if name == "kv1" else tiny_models[name]
    prompts = prompts_32(seed=len(name))
    reference = greedy(path, prompts)
    layouts = [(2, 1), (1, 2), (2, 2)] if name == "llama_gqa" else [(2, 1), (2, 2)]
    for tp, pp in layouts:
        got = greedy(path, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                     distributed_executor_backend="mp")
        same = sum(a == b for a, b in zip(got, reference, strict=True))
        assert same >= 31, (tp, pp, same)


def test_mp_with_one_worker_matches_uni(tiny_models):
    prompts = prompts_32(seed=3)[:8]
    path = tiny_models["qwen2_bias"]
    assert greedy(path, prompts, distributed_executor_backend="mp") == greedy(path, prompts)


def test_script_without_main_guard_runs_mp(tiny_models, tmp_path):
    """Spawned workers must not re-run the user's script (which would start workers again),
    and a config naming a class defined in that script still reaches them."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from fleetllm import LLM, SamplingParams\n"
        "from fleetllm.executor.multiproc import MultiprocExecutor\n"
        "class MyExecutor(MultiprocExecutor):\n"
        "    pass\n"
        f"llm = LLM({str(tiny_models['llama_gqa'])!r}, kv_cache_memory=1 << 25,\n"
        "          tensor_parallel_size=2, distributed_executor_backend=MyExecutor)\n"
        "out = llm.generate({'prompt_token_ids': [5, 6, 7]},\n"
        "                   SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)\n"
        "print('tokens', len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("tokens 4") == 1


def test_mp_driver_exits_without_leaked_semaphore_warning(tiny_models, tmp_path):
    """tqdm's default multiprocessing lock used to be reported as leaked at exit."""
    import subprocess
    import sys

    script = tmp_path / "driver.py"
    script.write_text(
        "from fleetllm import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    with LLM({str(tiny_models['llama_gqa'])!r}, kv_cache_memory=1 << 25,\n"
        "             distributed_executor_backend='mp') as llm:\n"
        "        llm.generate('def f(x):', SamplingParams(max_tokens=3))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Processed prompts" in proc.stderr  # the progress bar was drawn
    assert "leaked" not in proc.stderr, proc.stderr[-2000:]


def test_dropping_the_llm_ends_its_workers(tiny_models):
    import os
    import time

    llm = LLM(tiny_models["llama_gqa"], kv_cache_memory=KV, tensor_parallel_size=2)
    pids = llm.llm_engine.model_executor.collective_rpc(lambda w: os.getpid())
    del llm  # no shutdown(), no gc.collect(): the last reference going is enough
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(_running(p) for p in pids):
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
