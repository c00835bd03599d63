"""Shared fixtures: tiny random-weight checkpoints made with transformers (no downloads)."""

from __future__ import annotations

import os
from pathlib import Path

import fleetllm  # noqa: F401  (first: it sets OpenMP's wait before torch loads, as for users)

# isort: split
import numpy as np
import pytest
import torch

# numpy advises MADV_HUGEPAGE on its own large arrays; freed, that memory stays in the heap
# (fleetllm raises glibc's mmap threshold) and torch's next tensors land in it, advised: the
# huge-page tests (tests/model/test_huge_pages.py) would then see THP where fleetllm asked for
# none, whenever a test before them in the process built a GGUF file with numpy.
np._core.multiarray._set_madvise_hugepage(False)

# `make test` runs the suite in two pytest-xdist workers. Each gets a temp dir of its own
# (TMPDIR, which the processes tests start and Ray's session files follow): tests that look
# for leftovers in it (the mp executor's fleetllm-mp-* dirs) then see their own worker's only.
# Short (/tmp/t-gw0-XXXXXXXX): Unix socket paths under it are limited to 107 bytes. Processes
# the tests spawn import this module too (their test module's imports): they inherit the
# worker's dir (FLEETLLM_TEST_TMPDIR) instead of making one.
_WORKER_TMP = None
if os.environ.get("PYTEST_XDIST_WORKER") and "FLEETLLM_TEST_TMPDIR" not in os.environ:
    import tempfile

    _WORKER_TMP = tempfile.mkdtemp(prefix=f"t-{os.environ['PYTEST_XDIST_WORKER']}-",
                                   dir="/tmp")
    os.environ["TMPDIR"] = os.environ["FLEETLLM_TEST_TMPDIR"] = tempfile.tempdir = _WORKER_TMP


def pytest_unconfigure(config):
    if _WORKER_TMP is not None:
        import shutil

        shutil.rmtree(_WORKER_TMP, ignore_errors=True)


# The randomized series (random workloads, pooling, structured outputs, LoRA, the fault soak,
# the server fuzzers) are marked `soak`. `make test` runs each at a short size with a fixed
# seed; `make soak` (`pytest --soak -m soak`) runs them at full size: the same code, more
# workloads, rounds or examples. --soak is the one switch; a test reads it through the `soak`
# fixture (series_size) or, for a parametrization, from metafunc.config.
SOAK_TIMEOUT_S = 4 * 3600  # per test under --soak, instead of the short series' limits


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="run the randomized series (marker `soak`) at full size: make soak")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "soak: a randomized series: short and seeded in make test, full size under "
        "--soak (make soak)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("soak"):
        for item in items:
            if item.get_closest_marker("soak"):  # the item's own marker wins over the module's
                item.add_marker(pytest.mark.timeout(SOAK_TIMEOUT_S), append=False)


@pytest.fixture(scope="session")
def soak(pytestconfig) -> bool:
    """Whether this run is `make soak` (--soak): the randomized series at full size."""
    return pytestconfig.getoption("soak")


def series_size(soak: bool, short: int, full: int, env: str | None = None) -> int:
    """How long a randomized series runs: $env if set (a longer or shorter run by hand), else
    `full` under --soak, else `short` (make test)."""
    value = os.environ.get(env) if env else None
    return int(value) if value else full if soak else short


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download; fail fast if tried
torch.set_num_threads(min(2, os.cpu_count() or 1))

TINY_CONFIGS = {
    # Llama with GQA (4 query heads, 2 KV heads)
    "llama_gqa": ("LlamaForCausalLM", dict(num_key_value_heads=2)),
    # Qwen2: bias on q/k/v
    "qwen2_bias": ("Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    # Llama with tied input/output embeddings
    "llama_tied": ("LlamaForCausalLM", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    # Qwen3: RMSNorm on q and k per head
    "qwen3_qknorm": ("Qwen3ForCausalLM", dict(num_key_value_heads=2)),
    # Llama 3 style rope scaling; small theta and original context so that ignoring the
    # scaling would change the angles by radians within the test prompts
    "llama3_rope": ("LlamaForCausalLM", dict(rope_parameters={
        "rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
}


def make_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    """Save a tiny random-weight HF checkpoint (config.json + model.safetensors) at path."""
    import transformers

    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
               "Qwen2ForCausalLM": transformers.Qwen2Config,
               "Qwen3ForCausalLM": transformers.Qwen3Config,
               "Qwen3MoeForCausalLM": transformers.Qwen3MoeConfig,  # tests/moe/moe_checkpoints.py
               "Qwen2MoeForCausalLM": transformers.Qwen2MoeConfig,
               "MixtralForCausalLM": transformers.MixtralConfig}[arch]
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                  head_dim=16)
    kwargs.update(overrides)
    config = cfg_cls(**kwargs)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():  # random init is tiny; widen it so logits are not all near-equal
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.08)
            if name.endswith("bias"):
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, kwargs["vocab_size"])
    return path


_CORPUS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)\n",
    "The quick brown fox jumps over the lazy dog. Hello world, hello engine!\n",
    "import os\nimport sys\n\nclass Engine:\n    def step(self):\n        pass\n",
    "for i in range(10):\n    print(i, 'tokens per second', i * 2.5)\n",
]


def make_tokenizer(path: Path, vocab_size: int) -> None:
    """A small byte-level BPE tokenizer (ids 0-2 are <pad>, <s>, </s>) saved beside a
    checkpoint, so text prompts and stop strings can be tested without any download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {name: make_checkpoint(root / name, arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(TINY_CONFIGS.items())}


@pytest.fixture(params=[
    dict(tensor_parallel_size=2),
    dict(pipeline_parallel_size=2),
    dict(tensor_parallel_size=2, distributed_executor_backend="ray", ray_cpus_per_worker=0.5),
], ids=["mp-tp2", "mp-pp2", "ray-tp2"])
def distributed(request) -> dict:
    """The layouts a feature is checked on beyond one worker: mp TP=2, mp PP=2 and ray TP=2
    (half a CPU per actor, so that both fit on a 2-core machine). LLM(..., **distributed)."""
    if request.param.get("distributed_executor_backend") == "ray":
        pytest.importorskip("ray")
    return request.param
