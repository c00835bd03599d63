"""KVOutputAggregator: a request's transfer finishes once, when the last rank reports it
(issue 74)."""

from __future__ import annotations

from fleetllm.executor.kv_output import KVOutputAggregator, kv_connector_news
from fleetllm.sequence import KVConnectorOutput, SamplerOutput


def test_a_request_finishes_when_its_last_rank_reports_it_even_steps_later():
    agg = KVOutputAggregator(world_size=3)
    # step 0: ranks 0 and 1 finished sending "a"; rank 2 is 4 steps behind
    out = agg.aggregate([KVConnectorOutput({"a"}, {"x"}), KVConnectorOutput({"a"}, {"x"}),
                         KVConnectorOutput(None, {"x"})])
    assert out.finished_sending is None and out.finished_recving == {"x"}
    for step in range(3):  # rank 2 reports nothing (None) or "b" (each rank reports once)
        out = agg.aggregate([None, KVConnectorOutput(),
                             KVConnectorOutput({"b"} if step == 0 else None)])
        assert out.finished_sending is None and out.finished_recving is None
    out = agg.aggregate([KVConnectorOutput({"b"}), KVConnectorOutput({"b"}),
                         KVConnectorOutput({"a"})])
    assert out.finished_sending == {"a", "b"}  # "a": its last rank; "b": all three now
    out = agg.aggregate([KVConnectorOutput({"c"}), None, None])
    assert out.finished_sending is None  # never reported twice, "c" is not done
    assert agg._sending == {"c": 2}


def test_invalid_blocks_are_the_union_over_ranks_and_counters_are_summed():
    agg = KVOutputAggregator(world_size=2)
    out = agg.aggregate([KVConnectorOutput(invalid_block_ids={3}),
                         KVConnectorOutput(invalid_block_ids={3, 7})])
    assert out.invalid_block_ids == {3, 7}
    out = agg.aggregate([KVConnectorOutput(kv_connector_stats={"bytes_loaded": 5}), None])
    assert out.kv_connector_stats == {"bytes_loaded": 5}
    out = agg.aggregate([KVConnectorOutput(kv_connector_stats={"bytes_loaded": 5}),
                         KVConnectorOutput(kv_connector_stats={"bytes_loaded": 7,
                                                               "bytes_saved": 1})])
    assert out.kv_connector_stats == {"bytes_loaded": 12, "bytes_saved": 1}  # summed
    assert agg.aggregate([None, None]).invalid_block_ids == set()


def test_merge_step_puts_every_ranks_news_on_the_output_ranks_result():
    agg = KVOutputAggregator(world_size=2)
    rank0 = [SamplerOutput([], kv_connector_output=KVConnectorOutput(invalid_block_ids={1}))]
    rank1 = [SamplerOutput([], kv_connector_output=KVConnectorOutput(invalid_block_ids={2}))]
    news1 = kv_connector_news(rank1)  # what mp / ray send from a rank that does not sample
    merged = agg.merge_step([rank0, news1], output_rank=0)
    assert merged is rank0 and merged[-1].kv_connector_output.invalid_block_ids == {1, 2}
    assert kv_connector_news(None) is None and kv_connector_news([SamplerOutput([])]) is None
