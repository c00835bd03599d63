"""Regression guards for the performance work, by counts and sizes (never times, which the
shared test machine cannot keep steady):

- a decode step's Python work (function calls, engine and worker together) does not grow with
  the sequence's history;
- the request a decode step ships to workers does not grow with history beyond its block
  table (a few bytes per block of block_size tokens; the token history is never resent);
- in this process the request references the engine's sequence data instead of copying it;
- LLM.generate builds one RequestOutput per request, not one per request per step;
- a decode step's host work stays off torch paths it does not need (each runs from memory
  after the step's weight stream): no inference_mode Python wrapper, no tensor of the sampled
  ids, no slice of logits that have no padding;
- `import fleetllm` sets OpenMP's bounded spin-wait before torch loads, and keeps a user's own.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from fleetllm import LLM, SamplingParams
from fleetllm.engine.outputs import RequestOutput
from fleetllm.worker.delta import DeltaEncoder

KV = 32 << 20


def count_calls(fn) -> int:
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


def test_decode_step_work_and_request_size_do_not_grow_with_history(tiny_models):
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        engine = llm.llm_engine
        inner = engine.model_executor.execute_model
        requests = []
        engine.model_executor.execute_model = lambda r: requests.append(r) or inner(r)
        engine.add_request("long", {"prompt_token_ids": list(range(5, 305))},
                           SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        encoder = DeltaEncoder()  # what the mp executor sends for each step
        calls, sizes, blocks = [], [], []
        for step in range(400):
            finished_only = step % 2 == 1  # both output modes
            calls.append(count_calls(lambda fo=finished_only: engine.step(fo)))
            request = requests[-1]
            [meta] = request.seq_group_metadata_list
            [(seq_id, data)] = meta.seq_data.items()
            [seq] = engine.scheduler.running[0].seqs if engine.scheduler.running else [None]
            if seq is not None:
                assert data is seq.data  # referenced, not copied
            sizes.append(len(pickle.dumps(encoder.encode(request))))
            blocks.append(len(meta.block_tables[seq_id]))
        assert not engine.has_unfinished_requests()
    # Steps 10/11 (history ~311) against 390/391 (~691): same work, same size but the table.
    for early, late in ((10, 390), (11, 391)):
        assert abs(calls[late] - calls[early]) <= 8, (calls[early], calls[late])
        grown = blocks[late] - blocks[early]
        assert grown > 20
        assert sizes[late] - sizes[early] <= 3 * grown, (sizes[early], sizes[late], grown)


def test_a_decode_steps_host_work_stays_off_torch_paths_it_does_not_need(tiny_models):
    """Each of these costs a batch-1 step tens of microseconds from a cold cache."""
    import torch

    def torch_calls(fn) -> tuple[set[str], int]:
        files, tensors = set(), 0

        def profile(frame, event, arg):
            nonlocal tensors
            if event == "call" and f"{os.sep}torch{os.sep}" in frame.f_code.co_filename:
                files.add(frame.f_code.co_filename.rsplit(f"{os.sep}torch{os.sep}", 1)[1])
            elif event == "c_call" and arg is torch.tensor:
                tensors += 1

        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        return files, tensors

    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        engine = llm.llm_engine
        runner = engine.model_executor.driver_worker.worker.model_runner
        inner, outputs = runner.execute_model, []
        runner.execute_model = lambda *a, **k: outputs.append(inner(*a, **k)) or outputs[-1]
        engine.add_request("r", {"prompt_token_ids": list(range(5, 40))},
                           SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        engine.step()  # the prompt
        files, tensors = torch_calls(engine.step)  # a decode step
        [result] = outputs[-1]
        assert len(result.outputs[0].samples) == 1 and result.sampled_token_ids is None
        assert not any(f.startswith(("autograd/grad_mode", "utils/_contextlib")) for f in files)
        assert tensors <= 6  # the step's index tensors (model_runner._prepare)
        head = runner.model.lm_head  # no padding to slice off: the GEMM's own output
        logits = head.logits(torch.zeros(1, head.weight.shape[1], dtype=head.weight.dtype))
        assert logits.shape == (1, head.vocab_size) and logits._base is None


def test_generate_builds_one_output_per_request(tiny_models, monkeypatch):
    built = []
    real = RequestOutput.from_seq_group
    monkeypatch.setattr(RequestOutput, "from_seq_group",
                        staticmethod(lambda g: built.append(g.request_id) or real(g)))
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 90)]
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=20, ignore_eos=True),
                            use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert sorted(built) == sorted(o.request_id for o in outs)


def test_intra_op_threads_default_to_the_available_cores(monkeypatch):
    import os

    import torch

    from fleetllm.worker import model_runner

    cores = model_runner.available_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setenv("FLEETLLM_NUM_THREADS", "1")
        model_runner._set_intra_op_threads(1)
        assert torch.get_num_threads() == 1
        monkeypatch.delenv("FLEETLLM_NUM_THREADS")
        model_runner._set_intra_op_threads(1)
        assert torch.get_num_threads() == cores
        model_runner._set_intra_op_threads(cores * 4)  # ranks share the cores, at least 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("given, expected", [
    ({}, ("10000", None)),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, (None, "PASSIVE")),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, (None, "ACTIVE")),
    ({"GOMP_SPINCOUNT": "500"}, ("500", None)),
])
def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise(given, expected):
    """libgomp reads its wait settings once, when torch loads it: `import fleetllm` must set
    them without importing torch. Sleeping at once (PASSIVE) made every oneDNN call of a decode
    step pay a thread wake-up."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import os, sys, fleetllm; assert 'torch' not in sys.modules; "
            "print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    out = subprocess.run([sys.executable, "-c", code], env={**env, **given}, text=True,
                         capture_output=True, timeout=60, check=True).stdout.split()
    assert tuple(None if v == "None" else v for v in out) == expected
