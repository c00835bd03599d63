"""Automatic prefix caching: block reuse, eviction, accounting, and engine results.

Counts, not times: hits happen exactly where a cached prefix of full blocks exists, cached
blocks nobody owns count as free and are evicted least-recently-released first (a sequence's
tail before its prefix), never-cached blocks are handed out before any cached one, and
results with caching equal results without it.
"""

from __future__ import annotations

import itertools
import random

from fleetllm import LLM, SamplingParams
from fleetllm.config import CacheConfig, SchedulerConfig
from fleetllm.core.block_manager import BlockManager
from fleetllm.core.scheduler import Scheduler
from fleetllm.sequence import Sequence, SequenceGroup, SequenceStatus

_ids = itertools.count(1)
KV = 32 << 20


def group(tokens: list[int], rid: str = "r", **params) -> SequenceGroup:
    return SequenceGroup(rid, [Sequence(next(_ids), None, tokens)], SamplingParams(**params),
                         arrival_time=1.0)


def compute(bm: BlockManager, g: SequenceGroup) -> None:
    """Admit the group through the cache and 'compute' its whole prompt."""
    hits = bm.prefix_hits(g)
    assert bm.can_take_prefix(g, hits, g.seqs[0].get_len() - len(hits) * bm.block_size)
    bm.take_prefix(g, hits)
    seq = g.seqs[0]
    bm.ensure_slots(seq, seq.get_len())
    seq.data.num_computed_tokens = seq.get_len()
    bm.mark_computed(seq)


def test_a_shared_prefix_is_found_in_full_blocks():
    bm = BlockManager(block_size=4, num_gpu_blocks=32, num_cpu_blocks=0,
                      enable_prefix_caching=True)
    prefix = list(range(100, 110))  # 2 full blocks + 2 tokens
    first = group(prefix + [1, 2, 3])
    compute(bm, first)
    table = bm.get_block_table(first.seqs[0])
    second = group(prefix + [7, 8])
    hits = bm.prefix_hits(second)
    assert hits == table[:2]  # the 2 full blocks of the common prefix, not the partial one
    bm.take_prefix(second, hits)
    assert second.seqs[0].data.num_computed_tokens == 8
    assert bm.gpu.ref[table[0]] == 2
    # A prompt that is entirely cached still computes its last token (its logits).
    again = group(list(first.seqs[0].prompt_token_ids[:12]))
    assert bm.prefix_hits(again) == table[:2]  # 12 tokens: 3 full blocks, at most 2 reused
    assert bm.prefix_cache_hit_rate == 8 / (13 + 12)  # prompt tokens admitted, found
    # Different first tokens: nothing in common, nothing found.
    assert bm.prefix_hits(group([5] + prefix)) == []


def test_released_cached_blocks_count_as_free_and_are_evicted_tail_first():
    bm = BlockManager(block_size=2, num_gpu_blocks=6, num_cpu_blocks=0,
                      enable_prefix_caching=True)
    g = group([1, 2, 3, 4, 5, 6, 7])  # 3 full blocks + 1 token
    compute(bm, g)
    table = list(bm.get_block_table(g.seqs[0]))
    bm.free(g.seqs[0])
    assert bm.num_free_gpu_blocks == 6 and bm.num_evictable_gpu_blocks == 3
    assert bm.gpu.usage == 0.0
    # The 2 never-cached blocks go first, then the cached ones, tail block first.
    got = [bm.gpu.allocate() for _ in range(4)]
    assert set(got[:3]) == set(range(6)) - set(table[:3]) and got[3] == table[2]
    assert bm.prefix_hits(group([1, 2, 3, 4, 5, 6, 9])) == table[:2]  # the prefix survives


def test_prompt_logprobs_requests_compute_every_position():
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64),
                      CacheConfig(block_size=4, num_gpu_blocks=32, num_cpu_blocks=0))
    tokens = list(range(50, 70))
    for rid, lp in (("a", None), ("b", 1), ("c", None)):
        g = group(tokens, rid, prompt_logprobs=lp, max_tokens=1)
        sched.add_seq_group(g)
        [meta], out = sched.schedule()
        assert g.seqs[0].data.num_computed_tokens == {"a": 0, "b": 0, "c": 16}[rid], rid
        assert meta.token_chunk_size == 20 - g.seqs[0].data.num_computed_tokens
        sched.complete_step(out)
        g.seqs[0].status = SequenceStatus.FINISHED_LENGTH_CAPPED
        sched.free_finished_seq_groups()


def test_engine_results_equal_with_and_without_caching(tiny_models):
    rng = random.Random(4)
    system = [rng.randrange(3, 500) for _ in range(70)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(3, 500) for _ in range(n)]}
               for n in (1, 5, 30, 17, 0)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2,
                             prompt_logprobs=1),
              SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    results = {}
    for caching in (False, True):
        with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV,
                 enable_prefix_caching=caching) as llm:
            outs = [llm.generate(p, sp, use_tqdm=False)[0]  # one by one: later ones hit
                    for p, sp in zip(prompts, params, strict=True)]
            bm = llm.llm_engine.scheduler.block_manager
            hits = bm.prefix_cache.hit_tokens if caching else 0
        results[caching] = [([c.token_ids for c in o.outputs], o.prompt_logprobs and
                             [d and {k: round(v.logprob, 4) for k, v in d.items()}
                              for d in o.prompt_logprobs]) for o in outs]
        if caching:  # the 4 requests after the first (less the prompt-logprobs one) hit
            assert hits == 3 * 64, hits  # 70 shared tokens: 4 full blocks of 16 each
    assert results[True] == results[False]


def test_recomputed_group_finds_its_own_blocks(tiny_models):
    """Recompute preemption with caching: the preempted request's computed blocks are
    parked, and readmitting it finds them (it recomputes less), with the same tokens."""
    prompts = [{"prompt_token_ids": list(range(10 + 50 * i, 60 + 50 * i))} for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    with LLM(tiny_models["llama_gqa"], kv_cache_memory=KV) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                  use_tqdm=False)]
    with LLM(tiny_models["llama_gqa"], num_gpu_blocks_override=16) as llm:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        sched = llm.llm_engine.scheduler
        assert sched.num_preemptions > 0 and sched.block_manager.prefix_cache.hit_tokens > 0
    assert [o.outputs[0].token_ids for o in outputs] == reference
