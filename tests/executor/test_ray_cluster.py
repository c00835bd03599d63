"""The "ray" executor across nodes, on one machine: a 2-node Ray cluster (ray.cluster_utils:
two raylets, one CPU each) shared by the module. TP=2 with SPREAD puts one rank on each node,
and the greedy outputs still equal `uni`'s; placement that the nodes cannot satisfy fails at
its deadline saying why; nothing of ours (actors, placement groups, raylets) is left.
"""

from __future__ import annotations

import time

import pytest
from helpers import greedy_run
from test_multiproc import MAX_TOKENS, assert_same, make_executor, prompts, shm_entries
from test_ray_executor import assert_nothing_left, check_all_gone, ray_processes, runtime_env

from fleetllm.config import EngineConfig
from fleetllm.errors import CommunicationTimeoutError
from fleetllm.executor import Executor

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    shm_before = shm_entries()
    loopback = {"node_ip_address": "127.0.0.1", "include_dashboard": False}
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, **loopback})
    try:
        cluster.add_node(num_cpus=1, **loopback)
        ray.init(address=cluster.address, runtime_env=runtime_env(), log_to_driver=False)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        started = ray_processes()
        ray.shutdown()
        cluster.shutdown()
        check_all_gone(started, shm_before)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


def test_tp2_spread_runs_one_rank_per_node_and_matches_uni(two_nodes, model):
    with make_executor(model) as ex:
        reference = greedy_run(ex, prompts(), MAX_TOKENS)
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    with make_executor(model, tensor_parallel_size=2, distributed_executor_backend="ray",
                       placement_strategy="SPREAD") as ex:
        infos = ray.get([w.get_node_info.remote() for w in ex.workers])
        assert infos[0]["node_id"] != infos[1]["node_id"]  # one worker on each node
        assert [i["node_id"] for i in infos] == [n["node_id"] for n in ex.node_info]
        assert ex.collective_rpc(lambda w: w.rank) == [0, 1]
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS), reference)
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS, chunk=7), reference)
        name = ex._group.name
    assert_nothing_left(name, within=0)


def test_strict_pack_that_no_node_can_hold_fails_saying_why(two_nodes, model):
    cfg = EngineConfig.from_kwargs(model=str(model), tensor_parallel_size=2,
                                   distributed_executor_backend="ray",
                                   placement_strategy="STRICT_PACK", startup_timeout=1)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError) as info:
        Executor.get_class(cfg)(cfg)
    assert time.monotonic() - start < 1 + 1.5
    message = str(info.value)
    assert "placement group needs 2 bundles of {CPU: 1} (STRICT_PACK)" in message
    assert "2 CPUs free of 2 on 2 nodes" in message
    assert "STRICT_PACK needs one node for all; the largest has 1" in message
