"""The CPU weights and KV cache live in memory advised for transparent huge pages
(fleetllm/model/huge_pages.py): the same tokens either way, nothing kept alive that packing or
sleep frees, and FLEETLLM_HUGE_PAGES=0 leaves both to torch's allocator."""

from __future__ import annotations

import pytest
import torch
from helpers import load_tool

from fleetllm import LLM, SamplingParams
from fleetllm.kernels import cpu_kernels
from fleetllm.model import huge_pages

PROMPTS = [{"prompt_token_ids": [5 + i, 17, 99, 300 + 7 * i, 42, 8 + i]} for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
KV = 64 << 20

needs_thp = pytest.mark.skipif(not huge_pages.enabled(),
                               reason="transparent huge pages are off on this machine")


# With THP "always" every mapping is eligible; the tests of what is NOT placed need "madvise".
needs_madvise_thp = pytest.mark.skipif(huge_pages.thp_mode() != "madvise",
                                       reason="THP is not in 'madvise' mode here")


def mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps entry (its range and fields) of the mapping holding address."""
    entry: dict[str, str] = {}
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
                if entry.get("hit"):
                    break
                start, end = (int(x, 16) for x in head.split("-"))
                entry = {"range": head, "hit": "1" if start <= address < end else ""}
            elif entry.get("hit"):
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert entry.get("hit"), f"{address:#x} is in no mapping"
    return entry


def worker(llm: LLM):
    return llm.llm_engine.model_executor.driver_worker.worker


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@needs_thp
def test_weights_and_kv_cache_are_in_huge_page_mappings(tiny_models, monkeypatch):
    monkeypatch.delenv("FLEETLLM_HUGE_PAGES", raising=False)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        w = worker(llm)
        params = list(w.model_runner.model.parameters())
        first = mapping_of(params[0].data_ptr())
        # one mapping for all of them, eligible for huge pages, starting on a 2 MiB boundary
        assert {mapping_of(p.data_ptr())["range"] for p in params} == {first["range"]}
        assert first["THPeligible"] == "1"
        assert params[0].data_ptr() % huge_pages.HUGE_PAGE == 0
        for cache in w.cache_engine.gpu_cache:  # each layer's cache: its own such mapping
            assert mapping_of(cache.data_ptr())["THPeligible"] == "1"
            assert cache.data_ptr() % huge_pages.HUGE_PAGE == 0
            assert not cache.any()  # zeroed, as torch.zeros was
        placed = greedy(llm)
    monkeypatch.setenv("FLEETLLM_HUGE_PAGES", "0")
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        assert greedy(llm) == placed  # the same tokens with torch's own memory


@needs_madvise_thp
def test_off_leaves_the_weights_and_cache_to_torch(tiny_models, monkeypatch):
    monkeypatch.setenv("FLEETLLM_HUGE_PAGES", "0")
    assert not huge_pages.enabled()
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        w = worker(llm)
        addresses = [p.data_ptr() for p in w.model_runner.model.parameters()]
        addresses += [c.data_ptr() for c in w.cache_engine.gpu_cache]
        assert all(mapping_of(a).get("THPeligible") == "0" for a in addresses)


@needs_madvise_thp
def test_no_mapping_where_packing_frees_the_dense_weights(tiny_models, monkeypatch):
    """Past FLEETLLM_GEMV_MAX_BYTES the packed copies replace the dense weights; a shared
    mapping would stay whole while the norms and embedding live in it, so there is none."""
    monkeypatch.setenv("FLEETLLM_GEMV_MAX_BYTES", "1")
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        model = worker(llm).model_runner.model
        if not any(getattr(m, "weight", 0) is None for m in model.modules()):
            pytest.skip("oneDNN packing is unavailable here: the dense weights stay")
        embed = model.embed_tokens.weight
        assert mapping_of(embed.data_ptr())["THPeligible"] == "0"


@needs_thp
def test_placement_and_zeros_directly(monkeypatch):
    monkeypatch.delenv("FLEETLLM_HUGE_PAGES", raising=False)
    model = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.LayerNorm(200))
    model = model.to(torch.bfloat16)
    shapes = [(n, p.shape, p.dtype) for n, p in model.named_parameters()]
    placed = huge_pages.place_parameters(model)
    params = list(model.parameters())
    assert placed == sum(-(-p.numel() * 2 // 64) * 64 for p in params)
    assert [(n, p.shape, p.dtype) for n, p in model.named_parameters()] == shapes
    assert all(p.data_ptr() % 64 == 0 for p in params)
    for p in params:  # writable, and not overlapping one another
        p.data.fill_(1.0)
    assert sum(int(p.float().sum()) for p in params) == sum(p.numel() for p in params)
    cache = huge_pages.zeros((2, 1024, 16, 4, 16), torch.bfloat16)
    assert cache.shape == (2, 1024, 16, 4, 16) and cache.dtype == torch.bfloat16
    assert mapping_of(cache.data_ptr())["THPeligible"] == "1" and not cache.any()
    small = huge_pages.zeros((4, 4), torch.float32)  # under one huge page: torch's own
    assert small.shape == (4, 4) and not small.any()


@needs_thp
def test_a_refused_mapping_falls_back_to_torch(monkeypatch):
    """mmap failing (a memory limit, an odd kernel) leaves the tensors to torch: the engine
    starts as it did before, and fails as it did if memory is really short."""
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    model = torch.nn.Linear(300, 200)
    assert huge_pages.place_parameters(model) == 0
    cache = huge_pages.zeros((2, 1024, 16, 4, 16), torch.bfloat16)
    assert cache.shape == (2, 1024, 16, 4, 16) and not cache.any()


@needs_thp
def test_the_gemv_tool_places_its_weights_as_the_loader_does(monkeypatch):
    """tools/cpu_gemv_bench.py --huge-pages: the same weights, in a huge-page mapping (its
    "model" setting then streams them as a loaded model's are streamed)."""
    monkeypatch.delenv("FLEETLLM_HUGE_PAGES", raising=False)
    tool = load_tool("cpu_gemv_bench")
    plain = tool.weights("cache", torch.float32)
    placed = tool.weights("cache", torch.float32, huge=True)
    assert all(torch.equal(a, b) for a, b in zip(plain, placed, strict=True))
    assert mapping_of(placed[0].data_ptr())["THPeligible"] == "1"


def test_the_gemv_tools_demo_setting_holds_the_demo_models_projections():
    """tools/cpu_gemv_bench.py --setting demo times the kernel on the weights the demo model's
    decode and speculative steps read: one layer's fused qkv, o, gate/up and down per layer,
    then the (tied) LM head, in the checkpoint's shapes."""
    import json
    from pathlib import Path

    tool = load_tool("cpu_gemv_bench")
    demo = Path(__file__).resolve().parents[2] / "fleetllm" / "demo_model"
    c = json.loads((demo / "config.json").read_text())
    hid, d = c["hidden_size"], c["head_dim"]
    layer = [((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d, hid),
             (hid, c["num_attention_heads"] * d), (2 * c["intermediate_size"], hid),
             (hid, c["intermediate_size"])]
    assert tool.SHAPES["demo"] == layer * c["num_hidden_layers"] + [(c["vocab_size"], hid)]
    assert [tuple(w.shape) for w in tool.weights("demo", torch.float32)] == tool.SHAPES["demo"]


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler here")
def test_the_decode_tool_cold_gives_every_layer_its_own_cache_in_huge_pages(monkeypatch):
    """tools/cpu_decode_bench.py --cold: 12 layers' caches called in turn (a large batch's K/V
    then comes from memory, as in a decode step), each placed as the engine's cache is
    (huge_pages.zeros)."""
    tool = load_tool("cpu_decode_bench")
    placed = []
    real_zeros = tool.huge_pages.zeros
    monkeypatch.setattr(tool.huge_pages, "zeros",
                        lambda *a: placed.append(real_zeros(*a)) or placed[-1])
    ms, gflops, gbs = tool.time_one(torch.bfloat16, 2, 40, 14, 2, 64, cold=True)
    assert len(placed) == tool.LAYERS and placed[0].shape == (2, 2 * 3 + 8, 16, 2, 64)
    assert ms > 0 and gflops > 0 and gbs > 0


@needs_thp
def test_weights_packed_by_pairs_share_one_huge_page_mapping(monkeypatch):
    """On CPUs with AVX-512 BF16 the bf16 projections' copies packed by pairs are what every
    decode step streams: all of them in one huge-page mapping, the same products as without
    it, and no dense weight kept beside them."""
    from torch import nn

    from fleetllm.model import kernel_choice, layers
    from fleetllm.model import linear_kernels as lk

    if not cpu_kernels.gemm_pairs_available():
        pytest.skip("this CPU has neither AVX2 nor AVX-512: no packing by pairs")
    monkeypatch.delenv("FLEETLLM_HUGE_PAGES", raising=False)
    if not lk.onednn_packs_bf16():  # AVX2: the pairs only past the dense budget
        monkeypatch.setenv("FLEETLLM_GEMV_MAX_BYTES", "0")
    g = torch.Generator().manual_seed(0)

    def heads() -> nn.ModuleList:
        out = nn.ModuleList([layers.ParallelLMHead(1000 + 16 * i, 512) for i in range(3)])
        for m in out:
            m.weight.data = torch.randn(m.weight.shape, generator=g).bfloat16()
        return out

    placed = heads()
    dense = [m.weight.detach().clone() for m in placed]
    kernel_choice.select_kernels(placed)
    # (where oneDNN runs on AMX, the copies by pairs sit beside oneDNN's: SmallBatches)
    pairs = [m.kernel.small if isinstance(m.kernel, lk.SmallBatches) else m.kernel
             for m in placed]
    packed = [p.tensor for p in pairs]
    assert all(isinstance(p, lk.Pairs) for p in pairs)
    assert {mapping_of(p.data_ptr())["range"] for p in packed} == {
        mapping_of(packed[0].data_ptr())["range"]}
    assert mapping_of(packed[0].data_ptr())["THPeligible"] == "1"
    assert packed[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    x = torch.randn(lk.Pairs.SMALL_ROWS, 512, generator=g).bfloat16()  # the pairs' rows
    for m, p, w in zip(placed, pairs, dense, strict=True):
        assert m.weight is None  # the packed copies serve every number of rows: no dense one
        assert torch.equal(p.to_dense(), w)
        fresh = lk.Pairs.pack(w)  # torch's memory
        assert torch.equal(m.kernel(x), fresh(x))
