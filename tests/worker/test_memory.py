"""A loaded CPU worker holds its weights and KV cache, not the profile run's peak: the heap's
free pages (kept by the raised trim threshold, cpu_setup.keep_freed_memory) go back to the
system after the profile run, so that a quantized model's resident set after load is about
its file plus its cache (docs/quantization.md, Memory)."""

from __future__ import annotations

import ctypes

import pytest
from conftest import make_checkpoint

from fleetllm import LLM


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_the_profile_runs_peak_is_not_kept_after_load(tmp_path):
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    path = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", hidden_size=256,
                           intermediate_size=1024, head_dim=64)
    # a profile run of 16K tokens: ~160 MB of activations, freed into the heap
    with LLM(str(path), max_num_batched_tokens=16384, max_model_len=1024,
             num_gpu_blocks_override=16, swap_space=0) as llm:
        before = rss_mib()
        trim(ctypes.c_size_t(0))
        assert before - rss_mib() < 32, "the heap kept free memory after load"
        assert llm.generate(["hello"])[0].outputs[0].text is not None
