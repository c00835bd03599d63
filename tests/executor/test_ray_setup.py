"""The "ray" backend's set-up without a Ray cluster: the message when Ray is missing, its
settings and CLI flags, how the executor connects (a stand-in `ray` records the calls), rank
assignment, and the output rank every backend uses.
"""

from __future__ import annotations

import sys

import pytest

from fleetllm import LLM
from fleetllm.config import EngineConfig
from fleetllm.errors import ConfigurationError
from fleetllm.executor import Executor
from fleetllm.sequence import ExecuteModelRequest


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


def test_without_ray_choosing_it_says_how_to_install(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now fails
    with pytest.raises(ConfigurationError, match=r"pip install 'fleetllm\[ray\]'"):
        LLM(model, distributed_executor_backend="ray")


def test_ray_settings_are_validated_and_are_cli_flags(model):
    from fleetllm.cli import build_parser

    for key, bad in [("placement_strategy", "SIDEWAYS"), ("ray_cpus_per_worker", 0),
                     ("ray_cpus_per_worker", float("nan")), ("ray_address", ""),
                     ("placement_group", 3)]:
        with pytest.raises(ConfigurationError, match=key):
            EngineConfig.from_kwargs(model=str(model), distributed_executor_backend="ray",
                                     **{key: bad})
    args = build_parser().parse_args([
        "generate", "--distributed-executor-backend", "ray", "--ray-address", "auto",
        "--placement-strategy", "STRICT_SPREAD", "--placement-group", "pg1",
        "--ray-cpus-per-worker", "0.25", "x"])
    assert (args.ray_address, args.placement_strategy, args.placement_group,
            args.ray_cpus_per_worker) == ("auto", "STRICT_SPREAD", "pg1", 0.25)
    text = build_parser()._subparsers._group_actions[0].choices["generate"].format_help()
    for flag in ("--ray-address", "--placement-strategy", "--placement-group",
                 "--ray-cpus-per-worker"):
        assert flag in text


def test_connection_starts_or_joins_and_stops_only_its_own(monkeypatch):
    """RayConnection without a cluster: a stand-in `ray` records what it is asked."""
    from fleetllm.executor.ray_utils import RayConnection

    class FakeRay:
        def __init__(self, initialized: bool) -> None:
            self.initialized, self.calls = initialized, []

        def is_initialized(self) -> bool:
            return self.initialized

        def init(self, **kwargs) -> None:
            self.calls.append(("init", kwargs))
            self.initialized = True

        def shutdown(self) -> None:
            self.calls.append(("shutdown", {}))
            self.initialized = False

    monkeypatch.setattr(RayConnection, "_users", 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    user = FakeRay(initialized=True)  # the user's own connection: used, never shut down
    assert RayConnection.acquire(user, None, 2) is False and user.calls == []
    local = FakeRay(initialized=False)
    assert RayConnection.acquire(local, None, 8) and RayConnection.acquire(local, None, 8)
    [(_, kw)] = local.calls
    assert kw["address"] == "local" and kw["include_dashboard"] is False
    assert kw["_node_ip_address"] == "127.0.0.1" and kw["num_cpus"] >= 8
    assert kw["runtime_env"]["env_vars"]["GLOO_SOCKET_IFNAME"] == "lo"
    RayConnection.release(local)
    assert len(local.calls) == 1  # another executor still uses it
    RayConnection.release(local)
    assert local.calls[-1][0] == "shutdown"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    joined = FakeRay(initialized=False)
    RayConnection.acquire(joined, None, 2)
    assert joined.calls[0][1]["address"] == "10.0.0.1:6379"
    assert "num_cpus" not in joined.calls[0][1]  # an existing cluster is not sized from here
    RayConnection.release(joined)
    flag = FakeRay(initialized=False)
    RayConnection.acquire(flag, "ray://head:10001", 2)  # ray_address wins over RAY_ADDRESS
    assert flag.calls[0][1]["address"] == "ray://head:10001"
    RayConnection.release(flag)


def test_ranks_keep_tensor_parallel_groups_on_one_node():
    from fleetllm.executor.ray_utils import assign_ranks, local_ranks

    nodes = ["a", "b", "a", "c", "c", "a"]  # a: 3 workers, c: 2, b: 1
    order = assign_ranks(nodes, tp_size=2)
    placed = [nodes[i] for i in order]
    assert sorted(order) == list(range(6))
    assert placed[0:2] == ["a", "a"] and placed[2:4] == ["c", "c"]  # two whole TP groups
    assert assign_ranks(["x", "y", "x", "y"], tp_size=2) == [0, 2, 1, 3]
    assert local_ranks(["a", "a", "c", "c", "a", "b"]) == [0, 1, 0, 1, 2, 0]


def test_output_rank_is_decided_once(model):
    """parallel_state.output_rank decides it; the base Executor.execute_model returns that
    rank's result (it returned rank 0's, wrong under pipeline parallelism)."""
    from fleetllm.distributed.parallel_state import output_rank

    assert [output_rank(tp, pp) for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 3)]] == \
        [0, 0, 1, 2, 8]

    class Ranks(Executor):  # every rank answers with its rank
        supports_pp = True

        def _init_executor(self) -> None:
            pass

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None,
                           return_exceptions=False):
            return list(range(self.parallel_config.world_size))

    cfg = EngineConfig.from_kwargs(model=str(model), tensor_parallel_size=2,
                                   pipeline_parallel_size=2, distributed_executor_backend=Ranks)
    assert Ranks(cfg).execute_model(ExecuteModelRequest([])) == 2
