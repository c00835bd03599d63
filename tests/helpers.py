"""Test helpers: drive an executor with hand-built requests, run HF as the reference, load the
repository's tools/ scripts, give Ray workers the path to the tests' modules, and simulate the
CPU kinds whose projection kernels differ."""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata

TESTS = Path(__file__).resolve().parent  # tests/: the helper modules; test files are in folders


def ray_pythonpath(test_file: str) -> str:
    """PYTHONPATH for the Ray workers of a test that starts Ray itself: tests/ (the helper
    modules) and the test's own folder (its module, and the modules beside it it imports:
    cloudpickle sends their functions and classes by name), then the caller's PYTHONPATH.
    (Spawned mp workers get the test process's sys.path, which pytest gave both.)"""
    return os.pathsep.join([str(TESTS), str(Path(test_file).resolve().parent),
                            *filter(None, [os.environ.get("PYTHONPATH")])])


def simulate_no_onednn_bf16(monkeypatch) -> None:
    """A CPU where oneDNN packs no bf16 (AVX2): PyTorch's reorder refuses bf16 weights."""
    from fleetllm.model import linear_kernels as lk

    reorder = torch.ops.mkldnn._reorder_linear_weight

    def without_bf16(weight, *args):
        if weight.dtype == torch.bfloat16:  # what PyTorch says on such a CPU
            raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support "
                               "avx_ne_convert or avx512bw, avx512vl and avx512dq")
        return reorder(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", without_bf16)
    monkeypatch.setattr(lk, "onednn_packs_bf16", lambda: False)


def simulate_onednn_amx(monkeypatch, small_kind: str) -> None:
    """A CPU where oneDNN's bf16 matmul runs on AMX, with the small batches' copy beside it
    for the kernels' AMX tiles (small_kind "amx": this CPU must have them) or by pairs
    ("pairs"). Skips the test where this CPU runs no copies by pairs or oneDNN packs no bf16
    (every CPU with AMX does)."""
    import pytest

    from fleetllm.kernels import cpu_kernels
    from fleetllm.model import linear_kernels as lk

    if not cpu_kernels.gemm_pairs_available() or not lk.onednn_packs_bf16():
        pytest.skip("no copies by pairs, or oneDNN packs no bf16 here (every CPU with AMX does)")
    if small_kind == "amx" and not cpu_kernels.amx_available():
        pytest.skip("no AMX tiles on this CPU")
    if small_kind == "pairs":
        monkeypatch.setattr(lk.Amx, "applies", lambda w: False)
    monkeypatch.setattr(lk, "onednn_amx", lambda: True)


def load_tool(name: str):
    """tools/<name>.py as a module (the tools are scripts, not a package). Registered in
    sys.modules before it runs, as an import would be: dataclasses look their module up."""
    path = TESTS.parent / "tools" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    tool = importlib.util.module_from_spec(spec)
    sys.modules[name] = tool
    spec.loader.exec_module(tool)
    return tool


class BlockAllocator:
    """A trivial block allocator for hand-built requests (the engine has the real one)."""

    def __init__(self, block_size: int, first: int = 1):
        self.block_size = block_size
        self.next = first
        self.tables: dict[int, list[int]] = {}

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.next)
            self.next += 1
        return table


def greedy_run(executor, prompts: list[list[int]], max_tokens: int, block_size: int = 16,
               logprobs: int = 5, chunk: int | None = None):
    """Prefill all prompts in one batch (optionally in chunks), then decode together.
    Returns per prompt: (token ids, list of {token: logprob} dicts)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs)
    alloc = BlockAllocator(block_size)
    datas = {i: SequenceData(list(p)) for i, p in enumerate(prompts)}
    out_lps: dict[int, list[dict]] = {i: [] for i in datas}
    for _ in range(max_tokens + 100):
        groups = []
        for i, d in datas.items():
            if len(d.output_token_ids) >= max_tokens:
                continue
            is_prompt = d.num_computed_tokens < len(d.prompt_token_ids)
            if is_prompt:
                size = min(chunk or len(d.prompt_token_ids),
                           len(d.prompt_token_ids) - d.num_computed_tokens)
                do_sample = d.num_computed_tokens + size == len(d.prompt_token_ids)
            else:
                size, do_sample = 1, True
            table = alloc.ensure(i, d.num_computed_tokens + size)
            groups.append(SequenceGroupMetadata(f"r{i}", is_prompt, {i: d}, params,
                                                {i: list(table)}, size, do_sample))
        if not groups:
            break
        [out] = executor.execute_model(ExecuteModelRequest(groups))
        for g, o in zip(groups, out.outputs, strict=True):
            [seq_id] = g.seq_data
            d = datas[seq_id]
            d.num_computed_tokens += g.token_chunk_size
            if g.do_sample:
                [s] = o.samples
                d.output_token_ids.append(s.output_token)
                out_lps[seq_id].append({k: v.logprob for k, v in s.logprobs.items()})
    return [(datas[i].output_token_ids, out_lps[i]) for i in range(len(prompts))]


def hf_greedy(model, prompt: list[int], max_tokens: int):
    """HF generate, greedy: (token ids, per-step full log-softmax rows)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    tokens = out.sequences[0, len(prompt):].tolist()
    return tokens, [torch.log_softmax(x[0].float(), -1) for x in out.logits]


def load_hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def check_close(ours: tuple[list[int], list[dict]], ref: tuple[list[int], list], top: int = 5,
                atol: float = 1e-3) -> None:
    """Tokens equal and our top-N logprobs within atol of HF's."""
    tokens, lps = ours
    ref_tokens, ref_rows = ref
    assert tokens == ref_tokens, (tokens, ref_tokens)
    for lp, row in zip(lps, ref_rows, strict=True):
        for tok, value in lp.items():
            assert math.isclose(value, row[tok].item(), abs_tol=atol), (tok, value, row[tok])
        ref_top = set(row.topk(top).indices.tolist())
        assert ref_top <= set(lp), (ref_top, set(lp))


def check_logprobs_close(ours_tokens: list[int], ours_lps: list[dict], ref_tokens: list[int],
                         ref_rows: list[torch.Tensor], top: int = 5) -> bool:
    """vLLM's check_logprobs_close: returns True when the tokens are equal; otherwise, at the
    first differing position each side's token must be in the other's top-N."""
    for pos, (a, b) in enumerate(zip(ours_tokens, ref_tokens, strict=True)):
        if a != b:
            assert b in ours_lps[pos], f"pos {pos}: HF's {b} not in our top-{top}"
            assert a in set(ref_rows[pos].topk(top).indices.tolist()), \
                f"pos {pos}: our {a} not in HF's top-{top}"
            return False
    return True
