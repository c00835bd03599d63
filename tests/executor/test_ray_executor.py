"""The "ray" executor on one local Ray instance shared by the whole module: greedy outputs equal
`uni` (TP, PP, TP x PP; executor, LLM and CLI), RPC semantics, failures (killed actor, hung or
raising rank, unplaceable group), cleanup and the benchmarks (set-up without a cluster:
test_ray_setup.py).

Every worker reserves {CPU: 0.5} of a 4-CPU (logical) instance, so the layouts fit beside the
shared TP=2 executor on a 2-core machine. Multi-node placement is test_ray_cluster.py's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from helpers import greedy_run, ray_pythonpath
from test_mp_failures import raise_after_first_all_reduce
from test_multiproc import MAX_TOKENS, assert_same, make_executor, no_new_shm, prompts, shm_entries

from fleetllm import LLM, SamplingParams
from fleetllm.config import EngineConfig
from fleetllm.errors import (
    CommunicationTimeoutError,
    EngineShutdownError,
    RemoteWorkerError,
    WorkerCrashedError,
)
from fleetllm.executor import Executor
from fleetllm.executor.failures import EXEC_ERROR_GRACE_S
from fleetllm.sequence import ExecuteModelRequest

ray = pytest.importorskip("ray")

CPUS = 0.5  # per worker
RAY = dict(distributed_executor_backend="ray", ray_cpus_per_worker=CPUS)


# ------------------------------------------------------------------------------ the cluster


def descendants(pid: int) -> set[int]:
    """Live processes below `pid` (zombies have exited)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def runtime_env() -> dict:
    """Workers import the tests' modules too (faults are injected with functions from them)."""
    return {"env_vars": {"PYTHONPATH": ray_pythonpath(__file__)}}


def ray_processes() -> set[int]:
    """The Ray processes this test process started (GCS, raylets, workers, agents)."""
    return {p for p in descendants(os.getpid()) if "ray" in cmdline(p)}


def check_all_gone(started: set[int], shm_before: set[str]) -> None:
    """After ray.shutdown(): every process in `started` must exit, and nothing of ours be left
    in /dev/shm (Ray's object store files are unlinked by Ray itself)."""
    end = time.monotonic() + 15
    while time.monotonic() < end and any(alive(p) for p in started):
        time.sleep(0.1)
    left = {p: cmdline(p) for p in started if alive(p)}
    assert not left, f"processes still running after ray.shutdown(): {left}"
    assert no_new_shm(shm_before)


@pytest.fixture(scope="module")
def cluster():
    shm_before = shm_entries()
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1",
             num_cpus=4, runtime_env=runtime_env(), log_to_driver=False)
    yield ray
    started = ray_processes()
    ray.shutdown()
    check_all_gone(started, shm_before)


def leftovers(name: str) -> tuple[list[str], list[str]]:
    """(our actors Ray lists as alive, our placement groups not removed) for a name prefix."""
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith(name + "-")]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"] == name and g["state"] != "REMOVED"]
    return actors, groups


def live_groups() -> set[str]:
    return {g["name"] for g in ray.util.placement_group_table().values()
            if g["state"] != "REMOVED"}


def assert_nothing_left(name: str, within: float = 5.0) -> None:
    end = time.monotonic() + within
    while time.monotonic() < end and leftovers(name) != ([], []):
        time.sleep(0.05)
    assert leftovers(name) == ([], [])


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def reference(model):
    """uni's greedy results, per chunking."""
    cache = {}

    def get(chunk: int | None = None):
        if chunk not in cache:
            with make_executor(model) as ex:
                cache[chunk] = greedy_run(ex, prompts(), MAX_TOKENS, chunk=chunk)
        return cache[chunk]
    return get


@pytest.fixture(scope="module")
def tp2(cluster, model):
    """One TP=2 executor for the tests that do not break it (the last test does)."""
    with make_executor(model, tensor_parallel_size=2, **RAY) as ex:
        yield ex


# ------------------------------------------------------------------------------ correctness


def test_tp2_greedy_matches_uni_with_and_without_delta(tp2, reference):
    assert type(tp2).__name__ == "RayDistributedExecutor" and tp2.uses_ray
    assert_same(greedy_run(tp2, prompts(), MAX_TOKENS), reference())
    assert_same(greedy_run(tp2, prompts(), MAX_TOKENS, chunk=7), reference(7))
    tp2.delta_encoding = False
    try:
        assert_same(greedy_run(tp2, prompts(), MAX_TOKENS, chunk=7), reference(7))
    finally:
        tp2.delta_encoding = True


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2)])
def test_pipeline_and_tp_pp_greedy_match_uni(cluster, model, reference, tp, pp):
    with make_executor(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **RAY) as ex:
        assert ex.output_rank == (pp - 1) * tp
        assert ex.collective_rpc(lambda w: w.rank) == list(range(tp * pp))
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS), reference())
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS, chunk=7), reference(7))
        name = ex._group.name
    assert_nothing_left(name, within=0)  # shutdown() returns once Ray has let go of them


def test_llm_pipeline_in_a_given_placement_group_matches_uni(cluster, model):
    """Through LLM (PP=2), in a placement group the user made, given by name: it is used and
    left in place; our actors are gone after shutdown."""
    from ray.util.placement_group import placement_group, remove_placement_group

    rng = __import__("random").Random(5)
    requests = [{"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(1, 60))]}
                for _ in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(model, kv_cache_memory=32 << 20) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(requests, params,
                                                                use_tqdm=False)]
    pg = placement_group([{"CPU": CPUS}] * 2, name="user-group")
    try:
        with LLM(model, kv_cache_memory=32 << 20, pipeline_parallel_size=2,
                 placement_group="user-group", **RAY) as llm:
            ex = llm.llm_engine.model_executor
            assert ex.placement_group.id == pg.id
            got = [o.outputs[0].token_ids for o in llm.generate(requests, params,
                                                               use_tqdm=False)]
            name = ex._group.name
        assert got == expected
        assert_nothing_left(name, within=0)
        state = ray.util.placement_group_table(pg)["state"]
        assert state == "CREATED"  # the user's, left alone
    finally:
        remove_placement_group(pg)


def test_cli_generate_joins_the_cluster_and_matches_uni(cluster, tiny_models):
    model = tiny_models["qwen2_bias"]
    with LLM(model, kv_cache_memory=32 << 20) as llm:
        [out] = llm.generate("def f(x):", SamplingParams(temperature=0, max_tokens=12,
                                                         ignore_eos=True), use_tqdm=False)
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": "127.0.0.1:1"}  # the flag wins over the variable
    proc = subprocess.run([
        sys.executable, "-m", "fleetllm.cli", "generate", "--model", str(model), "--max-tokens",
        "12", "--ignore-eos", "--quiet", "--kv-cache-memory", "33554432", "def f(x):",
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray",
        "--ray-address", address, "--ray-cpus-per-worker", str(CPUS),
        "--placement-strategy", "SPREAD"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == out.prompt + out.outputs[0].text + "\n"


# ------------------------------------------------------------------------------ RPC


def test_workers_report_where_they_run(tp2):
    infos = ray.get([w.get_node_info.remote() for w in tp2.workers])
    node = ray.get_runtime_context().get_node_id()
    assert [i["node_id"] for i in infos] == [node, node]
    assert all(i["node_ip"] == "127.0.0.1" and i["gpu_ids"] == [] for i in infos)
    assert [i["status"] for i in infos] == ["ready", "ready"]
    assert [i["pid"] for i in infos] == tp2.collective_rpc(lambda w: os.getpid())
    assert os.getpid() not in [i["pid"] for i in infos]


def test_collective_rpc_semantics(tp2):
    ex = tp2
    assert ex.collective_rpc("check_health") == [None, None]
    assert ex.collective_rpc(lambda w, a, b=0: a + b + w.rank, args=(2,), kwargs={"b": 3}) == \
        [5, 6]
    offset = 10
    assert ex.collective_rpc(lambda w: w.rank + offset) == [10, 11]  # closures too

    def boom(worker):
        if worker.rank == 1:
            raise ValueError("boom from the worker")
        return "fine"

    with pytest.raises(ValueError) as info:
        ex.collective_rpc(boom)
    assert isinstance(info.value, RemoteWorkerError) and info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message and "boom from the worker" in message and "in boom" in message
    ok, err = ex.collective_rpc(boom, return_exceptions=True)
    assert ok == "fine" and isinstance(err, ValueError) and "rank 1" in str(err)
    with pytest.raises(AttributeError, match="rank 0"):
        ex.collective_rpc("no_such_method")


def test_run_workers_has_vllms_arguments(tp2):
    ex = tp2
    assert ex._run_workers(lambda w, x, y=0: (w.rank, x, y), 1, y=2) == [(0, 1, 2), (1, 1, 2)]
    assert ex._run_workers(lambda w, x: (w.rank, x), all_args=[(5,), (6,)],
                           max_concurrent_workers=1) == [(0, 5), (1, 6)]
    assert ex._run_workers(lambda w, x=0: x, all_kwargs=[{"x": 7}, {"x": 8}],
                           use_dummy_driver=True) == [7, 8]
    refs = ex._run_workers(lambda w: w.rank, async_run_tensor_parallel_workers_only=True)
    assert ray.get(refs) == [1]  # every rank but tensor rank 0, asynchronously
    assert ex.parallel_worker_tasks == refs
    ex.stop_remote_worker_execution_loop()
    assert ex.parallel_worker_tasks is None
    assert ex._driver_execute_model(None) is None
    [out] = ex._driver_execute_model(ExecuteModelRequest([]))
    assert out.outputs == []


def test_hung_worker_times_out_and_late_reply_is_discarded(tp2):
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError, match=r"\[1\]"):
        tp2.collective_rpc(lambda w: time.sleep(2.5) if w.rank == 1 else "late", timeout=0.5)
    assert time.monotonic() - start < 0.5 + 1.0
    assert tp2.collective_rpc(lambda w: ("fresh", w.rank), timeout=30) == [("fresh", 0),
                                                                            ("fresh", 1)]


def test_executor_resyncs_when_workers_lack_a_sequence(tp2, reference):
    from fleetllm.sampling_params import SamplingParams as Params
    from fleetllm.sequence import SequenceData, SequenceGroupMetadata

    [ref_tokens, *_] = reference()[0]
    first = prompts()[0]
    tp2._encoder.seqs[4242] = ["resync", first, len(first), 0, None]  # a wrong belief
    group = SequenceGroupMetadata("resync", True, {4242: SequenceData(list(first))},
                                  Params(temperature=0.0, logprobs=5), {4242: [1]})
    [out] = tp2.execute_model(ExecuteModelRequest([group]))
    assert out.outputs[0].samples[0].output_token == ref_tokens[0]
    tp2.execute_model(ExecuteModelRequest([], finished_requests_ids=["resync"]))
    assert 4242 not in tp2._encoder.seqs


# ------------------------------------------------------------------------------ failures


def test_killed_actor_raises_worker_crashed_within_5s(cluster, model):
    ex = make_executor(model, tensor_parallel_size=2, **RAY)
    name, victim = ex._group.name, ex.workers[1]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        ray.kill(victim)

    timer = threading.Timer(0.5, kill)
    timer.start()
    try:
        with pytest.raises(WorkerCrashedError) as info:
            end = time.monotonic() + 60
            while time.monotonic() < end:  # generate until the kill lands mid-generation
                greedy_run(ex, prompts(), MAX_TOKENS)
        latency = time.monotonic() - killed_at[0]
    finally:
        timer.cancel()
    print(f"WorkerCrashedError {latency * 1000:.0f} ms after ray.kill")
    assert latency < 5
    assert info.value.rank == 1
    assert "rank 1" in str(info.value) and "127.0.0.1" in str(info.value)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError):  # later calls fail at once too
        ex.execute_model(ExecuteModelRequest([]))
    assert time.monotonic() - start < 1
    assert_nothing_left(name)  # the other actor was killed, the placement group removed
    ex.shutdown()
    with pytest.raises(EngineShutdownError):
        ex.collective_rpc("check_health")


def test_hung_rank_times_out_and_fails_the_executor(cluster, model):
    def hang(worker) -> None:
        if worker.rank == 1:
            real = worker.execute_model
            worker.execute_model = lambda request: time.sleep(3600) or real(request)

    with make_executor(model, tensor_parallel_size=2, execute_model_timeout=2, **RAY) as ex:
        name = ex._group.name
        ex.collective_rpc(hang)
        start = time.monotonic()
        with pytest.raises(CommunicationTimeoutError,
                           match=r"ranks \[(0, )?1\].*execute_model_timeout"):
            greedy_run(ex, prompts(), MAX_TOKENS)
        elapsed = time.monotonic() - start
        print(f"hung rank: CommunicationTimeoutError after {elapsed * 1000:.0f} ms")
        assert 2 <= elapsed < 2 + 1
        assert ex.step_outstanding  # waiting once more is possible; another call gives up
        with pytest.raises(WorkerCrashedError, match="execute_model_timeout"):
            ex.execute_model(ExecuteModelRequest([]))
        assert_nothing_left(name)


def test_unplaceable_group_fails_at_its_deadline_naming_what_is_missing(cluster, model):
    cfg = EngineConfig.from_kwargs(model=str(model), tensor_parallel_size=2,
                                   pipeline_parallel_size=2, distributed_executor_backend="ray",
                                   ray_cpus_per_worker=3, startup_timeout=2)
    before = live_groups()
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError) as info:
        Executor.get_class(cfg)(cfg)
    elapsed = time.monotonic() - start
    assert 2 <= elapsed < 2 + 1.5
    message = str(info.value)
    assert "placement group needs 4 bundles of {CPU: 3} (PACK)" in message, message
    assert "CPUs free of 4" in message and "on 1 node" in message, message
    assert "startup_timeout=2" in message
    assert live_groups() == before  # the one it made is removed


def test_startup_failure_names_rank_and_cleans_up(cluster, model):
    cfg = EngineConfig.from_kwargs(model=str(model), tensor_parallel_size=2,
                                   worker_cls="test_multiproc.FailingWorker", **RAY)
    before = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    with pytest.raises(OSError) as info:
        Executor.get_class(cfg)(cfg)
    message = str(info.value)
    assert "rank 1" in message and "injected" in message and "during worker startup" in message
    end = time.monotonic() + 5
    while time.monotonic() < end and \
            {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} != before:
        time.sleep(0.05)
    assert {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)} == before


def test_rank_errors_in_execute_model_follow_the_mp_rules(tp2, reference):
    """Last user of tp2: the same error on every rank before any collective keeps it usable;
    one rank raising after a collective fails it (actors killed, group removed)."""
    def fail_once(worker) -> None:
        def fail(request):
            del worker.execute_model  # one shot: the next step runs the real method
            raise ValueError("injected: the same error on every rank")

        worker.execute_model = fail

    tp2.collective_rpc(fail_once)
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0.*the same error") as info:
        greedy_run(tp2, prompts(), MAX_TOKENS)
    assert time.monotonic() - start < EXEC_ERROR_GRACE_S
    assert not isinstance(info.value, WorkerCrashedError) and tp2._encoder.need_reset
    assert_same(greedy_run(tp2, prompts(), MAX_TOKENS), reference())

    name = tp2._group.name
    tp2.collective_rpc(raise_after_first_all_reduce)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError) as info:
        greedy_run(tp2, prompts(), MAX_TOKENS)
    assert time.monotonic() - start < 5
    assert info.value.rank == 1 and "injected failure" in str(info.value)
    assert isinstance(info.value.__cause__, RemoteWorkerError)
    assert_nothing_left(name)
    with pytest.raises(WorkerCrashedError, match="injected failure"):
        tp2.collective_rpc("check_health")
    tp2.shutdown()
    with pytest.raises(EngineShutdownError):
        tp2.execute_model(ExecuteModelRequest([]))


# ------------------------------------------------------------------------------ benchmarks


def test_bench_rpc_and_throughput_run_on_ray(cluster, model, capsys):
    from fleetllm.benchmarks import rpc, throughput

    results = rpc.main(["--backend", "ray", "--iters", "20", "--model", str(model)])
    out = capsys.readouterr().out
    assert set(results) == {"uni", "ray", "mp"}
    for backend in ("uni", "ray", "mp"):
        assert {"noop_method", "empty_execute_model"} <= set(results[backend])
        assert f"empty_execute_model   {backend}" in out
    assert throughput.main(["--model", str(model), "--num-prompts", "4", "--input-len", "16",
                            "--output-len", "4", "--hf-batch-size", "0", "--repeat", "1",
                            "--kv-cache-memory", "33554432", "--distributed-executor-backend",
                            "ray", "--ray-cpus-per-worker", str(CPUS),
                            "--compare-backend", "uni"]) == 0
    assert "ratio ray / uni" in capsys.readouterr().out


def test_engine_resumes_every_request_after_ray_kill(cluster, model):
    """Fault tolerance on Ray: an actor killed mid-generation is replaced (a fresh group of
    actors) and every request, greedy and seeded n=2, ends with the undisturbed tokens."""
    requests = [({"prompt_token_ids": list(range(5 + i, 25 + 2 * i))},
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) if i % 2 else
                 SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=12, ignore_eos=True))
                for i in range(8)]
    with LLM(model, tensor_parallel_size=2, kv_cache_memory=16 << 20, **RAY) as llm:
        undisturbed = [[c.token_ids for c in o.outputs] for o in llm.generate(
            [p for p, _ in requests], [sp for _, sp in requests], use_tqdm=False)]
        engine = llm.llm_engine
        executor = engine.model_executor
        old_name = executor._group.name
        for i, (p, sp) in enumerate(requests):
            engine.add_request(str(i), p, sp)
        for _ in range(3):
            engine.step()
        ray.kill(executor.workers[1])
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert [[c.token_ids for c in done[str(i)].outputs] for i in range(8)] == undisturbed
        assert engine.worker_restarts == 1
        assert executor.get_performance_metrics()["workers"]["restarts"] == 1
        assert_nothing_left(old_name)  # the old actors and placement group are gone
        new_name = executor._group.name
    assert_nothing_left(new_name)
