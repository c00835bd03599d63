"""The "mp" executor when a rank fails inside execute_model: a worker that raises or hangs
mid-step fails the executor (workers stopped, typed error, later calls refused), unless every
rank raised the same error before any collective; and calls after shutdown().

Faults are injected through collective_rpc with a callable that replaces, on chosen ranks, the
worker's execute_model or its TP group's all_reduce: no timing luck. Every test is bounded by
pytest-timeout as well as by its own assertions on elapsed time.
"""

from __future__ import annotations

import os
import time

import pytest
from helpers import greedy_run
from test_multiproc import (
    MAX_TOKENS,
    alive,
    assert_same,
    make_executor,
    no_new_shm,
    prompts,
    shm_entries,
)

from fleetllm.config import EngineConfig
from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    EngineShutdownError,
    RemoteWorkerError,
    WorkerCrashedError,
)
from fleetllm.executor.failures import EXEC_ERROR_GRACE_S
from fleetllm.sequence import ExecuteModelRequest


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models["llama_gqa"]


@pytest.fixture(scope="module")
def reference(model):
    with make_executor(model) as ex:
        return greedy_run(ex, prompts(), MAX_TOKENS)


def raise_after_first_all_reduce(worker) -> None:
    """Rank 1: the next all_reduce completes on both ranks, then rank 1 raises (rank 0 goes on
    into its next collective and waits there)."""
    if worker.rank != 1:
        return
    from fleetllm.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    real = type(tp).all_reduce

    def all_reduce(x):
        real(tp, x)
        raise RuntimeError("injected failure after an all_reduce")

    tp.all_reduce = all_reduce


def raise_before_any_collective(worker) -> None:
    """Rank 1 raises at the start of execute_model; rank 0 runs into its first all_reduce."""
    if worker.rank == 1:
        def fail(request):
            raise RuntimeError("injected failure before any collective")

        worker.execute_model = fail


def different_errors_before_any_collective(worker) -> None:
    def fail(request):
        raise ValueError(f"injected failure number {worker.rank}")

    worker.execute_model = fail


@pytest.mark.timeout(180)
@pytest.mark.parametrize("inject", [raise_after_first_all_reduce, raise_before_any_collective,
                                    different_errors_before_any_collective])
def test_rank_error_inside_execute_model_fails_the_executor(model, inject):
    shm_before = shm_entries()
    ex = make_executor(model, tensor_parallel_size=2)
    pids, tmpdir = ex.worker_pids, ex.tmpdir
    ex.collective_rpc(inject)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError) as info:
        greedy_run(ex, prompts(), MAX_TOKENS)
    elapsed = time.monotonic() - start
    print(f"{inject.__name__}: WorkerCrashedError after {elapsed * 1000:.0f} ms")
    assert elapsed < 5
    err = info.value
    assert err.rank == 1 or inject is different_errors_before_any_collective
    message = str(err)
    assert f"rank {err.rank}" in message and "injected failure" in message
    assert "Traceback" in message and "remote traceback" in message
    assert isinstance(err.__cause__, RemoteWorkerError)
    # stopped before the error was raised: nothing left running or on disk
    assert not any(alive(p) for p in pids)
    assert not os.path.exists(tmpdir)
    assert no_new_shm(shm_before)
    for call in (lambda: ex.execute_model(ExecuteModelRequest([])),
                 lambda: ex.collective_rpc("check_health")):
        start = time.monotonic()
        with pytest.raises(WorkerCrashedError, match="injected failure"):
            call()
        assert time.monotonic() - start < 1
    ex.shutdown()
    with pytest.raises(EngineShutdownError):
        ex.execute_model(ExecuteModelRequest([]))


@pytest.mark.timeout(240)
def test_same_error_on_every_rank_before_any_collective_keeps_the_executor(model, reference):
    def fail_once(worker) -> None:
        def fail(request):
            del worker.execute_model  # one shot: the next step runs the real method
            raise ValueError("injected: the same error on every rank")

        worker.execute_model = fail

    with make_executor(model, tensor_parallel_size=2) as ex:
        pids = ex.worker_pids
        for delta in (True, False):
            ex.delta_encoding = delta
            ex.collective_rpc(fail_once)
            start = time.monotonic()
            with pytest.raises(ValueError, match="rank 0.*the same error") as info:
                greedy_run(ex, prompts(), MAX_TOKENS)
            assert time.monotonic() - start < EXEC_ERROR_GRACE_S
            assert isinstance(info.value, RemoteWorkerError)
            assert not isinstance(info.value, WorkerCrashedError)
            assert ex._encoder.need_reset  # the next step resends full data
            assert all(alive(p) for p in pids)
            assert_same(greedy_run(ex, prompts(), MAX_TOKENS), reference)


@pytest.mark.timeout(180)
def test_hung_rank_times_out_and_fails_the_executor(model):
    def hang(worker) -> None:
        if worker.rank == 1:
            worker.execute_model = lambda request: time.sleep(3600)

    with make_executor(model, tensor_parallel_size=2, execute_model_timeout=2) as ex:
        pids, tmpdir = ex.worker_pids, ex.tmpdir
        ex.collective_rpc(hang)
        start = time.monotonic()
        with pytest.raises(CommunicationTimeoutError,
                           match=r"ranks \[(0, )?1\].*execute_model_timeout"):
            greedy_run(ex, prompts(), MAX_TOKENS)
        elapsed = time.monotonic() - start
        print(f"hung rank: CommunicationTimeoutError after {elapsed * 1000:.0f} ms")
        assert 2 <= elapsed < 2 + 1.5
        # The step is outstanding (wait_for_timed_out_step could wait once more); any other
        # call gives up on the workers.
        assert ex.step_outstanding and all(alive(p) for p in pids)
        with pytest.raises(WorkerCrashedError, match="execute_model_timeout"):
            ex.execute_model(ExecuteModelRequest([]))
        assert not any(alive(p) for p in pids)
        assert not os.path.exists(tmpdir)


@pytest.mark.timeout(120)
def test_calls_after_shutdown_raise_engine_shutdown_error(model):
    ex = make_executor(model, tensor_parallel_size=2)
    ex.shutdown()
    for call in (lambda: ex.execute_model(ExecuteModelRequest([])),
                 lambda: ex.collective_rpc("check_health")):
        with pytest.raises(EngineShutdownError, match="shut down"):
            call()


def test_execute_model_timeout_is_validated(model):
    for bad in (0, -1.0, float("nan"), float("inf"), "5", True):
        with pytest.raises(ConfigurationError, match="execute_model_timeout"):
            EngineConfig.from_kwargs(model=str(model), execute_model_timeout=bad)
    cfg = EngineConfig.from_kwargs(model=str(model), execute_model_timeout=0.5)
    assert cfg.parallel_config.execute_model_timeout == 0.5
