"""The "mp" executor: worker processes, RPC semantics, delta encoding, crashes and cleanup.

Every wait here is bounded. A rank that raises or hangs inside execute_model (which fails the
executor) is tested in test_mp_failures.py. (End-to-end 32-prompt tests through fleetllm.LLM with
tensor/pipeline parallelism belong with the engine's tests once LLM is complete.)
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import pickle
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import make_checkpoint
from helpers import greedy_run

from fleetllm.config import EngineConfig
from fleetllm.errors import (
    CommunicationTimeoutError,
    ConfigurationError,
    RemoteWorkerError,
    WorkerCrashedError,
)
from fleetllm.executor import Executor
from fleetllm.executor.multiproc import MultiprocExecutor
from fleetllm.sampling_params import SamplingParams
from fleetllm.sequence import ExecuteModelRequest, SequenceData, SequenceGroupMetadata
from fleetllm.worker.delta import DeltaDecoder, DeltaDesync, DeltaEncoder
from fleetllm.worker.worker import Worker

REPO = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8


def make_executor(path, **kwargs) -> Executor:
    cfg = EngineConfig.from_kwargs(model=str(path), kv_cache_memory=16 << 20, **kwargs)
    executor = Executor.get_class(cfg)(cfg)
    executor.initialize_cache(*executor.determine_num_available_blocks())
    return executor


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40, 1, 23)]


def alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it has exited, its parent just has not reaped it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def wait_until(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def shm_entries() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if "fleetllm" in n or n.startswith("torch_")}
    except FileNotFoundError:
        return set()


def no_new_shm(before: set[str]) -> bool:
    """No /dev/shm entry beyond `before` stays. /dev/shm is the machine's: a test in the other
    pytest-xdist worker may hold one for a moment, a leak stays."""
    return wait_until(lambda: shm_entries() <= before, 5)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("mp_ckpt")
    return {"kv1": make_checkpoint(root / "kv1", "LlamaForCausalLM", seed=7, num_key_value_heads=1),
            "tied": tiny_models["llama_tied"]}


@pytest.fixture(scope="module")
def reference(models):
    """Greedy results of the uni executor, per model and chunking."""
    cache = {}

    def get(name: str, chunk: int | None):
        if (name, chunk) not in cache:
            with make_executor(models[name]) as ex:
                cache[name, chunk] = greedy_run(ex, prompts(), MAX_TOKENS, chunk=chunk)
        return cache[name, chunk]
    return get


@pytest.fixture(scope="module")
def tp2(models):
    """One TP=2 executor shared by the RPC tests (none of them breaks it)."""
    with make_executor(models["kv1"], tensor_parallel_size=2) as ex:
        yield ex


def assert_same(ours, ref, atol: float = 1e-4) -> None:
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, ref, strict=True):
        assert tokens == ref_tokens
        for lp, ref_lp in zip(lps, ref_lps, strict=True):
            assert lp.keys() == ref_lp.keys()
            assert all(abs(lp[k] - ref_lp[k]) < atol for k in lp)


# ------------------------------------------------------------------------------ correctness


def test_tp2_greedy_matches_uni_with_and_without_delta(tp2, reference):
    assert_same(greedy_run(tp2, prompts(), MAX_TOKENS), reference("kv1", None))
    assert_same(greedy_run(tp2, prompts(), MAX_TOKENS, chunk=7), reference("kv1", 7))
    tp2.delta_encoding = False
    try:
        assert_same(greedy_run(tp2, prompts(), MAX_TOKENS, chunk=7), reference("kv1", 7))
    finally:
        tp2.delta_encoding = True


@pytest.mark.parametrize("name,tp,pp", [("kv1", 1, 2), ("kv1", 2, 2), ("tied", 2, 2)])
def test_pipeline_and_tp_pp_greedy_match_uni(models, reference, name, tp, pp):
    with make_executor(models[name], tensor_parallel_size=tp, pipeline_parallel_size=pp) as ex:
        assert ex.output_rank == (pp - 1) * tp
        assert ex.collective_rpc(lambda w: (w.rank, w.local_rank)) == [
            (r, r) for r in range(tp * pp)]
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS), reference(name, None))
        assert_same(greedy_run(ex, prompts(), MAX_TOKENS, chunk=7), reference(name, 7))


def test_invalid_layouts_fail_before_any_process_starts(models):
    before = set(multiprocessing.active_children())
    with pytest.raises(ConfigurationError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(model=str(models["kv1"]), tensor_parallel_size=3)
    with pytest.raises(ConfigurationError, match="pipeline_parallel_size"):
        EngineConfig.from_kwargs(model=str(models["kv1"]), pipeline_parallel_size=3)
    assert set(multiprocessing.active_children()) == before


# ------------------------------------------------------------------------------ delta encoding


def _step_requests(prompt_len: int, steps: int) -> Iterator[ExecuteModelRequest]:
    """One sequence: its prefill, then decode steps (the engine's updates in between)."""
    params = SamplingParams(temperature=0.0, max_tokens=steps)
    rng = random.Random(prompt_len)
    data = SequenceData([rng.randrange(3, 32000) for _ in range(prompt_len)])
    for step in range(steps):
        table = list(range(1, 2 + data.get_len() // 16))
        group = SequenceGroupMetadata("req-a", step == 0, {7: data}, params, {7: table})
        yield ExecuteModelRequest([group])
        data.num_computed_tokens = data.get_len()
        data.output_token_ids.append(100 + step)


def test_delta_round_trip_small_messages_and_finished_cleanup():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    sizes = []
    for req in _step_requests(2000, 6):
        full = pickle.dumps(req)
        message = pickle.dumps(enc.encode(req))
        decoded = dec.decode(pickle.loads(message))
        assert decoded == pickle.loads(full)  # same request, rebuilt from the worker's cache
        sizes.append((len(full), len(message)))
    full_size, delta_size = sizes[-1]
    print("decode step message: full", full_size, "bytes, delta", delta_size, "bytes")
    assert delta_size * 15 < full_size, sizes  # a decode step sends no token history
    assert sizes[0][1] >= 4000  # the first step sends the prompt
    done = ExecuteModelRequest([], finished_requests_ids=["req-a"])
    dec.decode(enc.encode(done))
    assert not enc.seqs and not enc.req_seqs and not dec.seqs and not dec.req_seqs
    assert not enc.params and not dec.params


def test_delta_falls_back_to_full_data():
    enc, dec = DeltaEncoder(), DeltaDecoder()
    steps = _step_requests(50, 3)
    message = enc.encode(next(steps))
    with pytest.raises(DeltaDesync):  # a worker that missed the first message
        DeltaDecoder().decode(enc.encode(next(steps)))
    dec.decode(message)
    full = enc.encode(next(steps), full=True)
    assert full.reset and all(kind == 0 for _, kind, *_ in full.groups[0][2])
    assert dec.decode(full).seq_group_metadata_list[0].seq_data[7].output_token_ids == [100, 101]
    # the same seq id with a different prompt of the same length: never a delta
    params = SamplingParams(temperature=0.0)
    other = SequenceGroupMetadata("req-a", False, {7: SequenceData(list(range(50)), [100, 101])},
                                  params, {7: [1, 2, 3, 4]})
    encoded = enc.encode(ExecuteModelRequest([other]))
    assert encoded.groups[0][2][0][1] == 0
    assert dec.decode(encoded).seq_group_metadata_list[0].seq_data[7].prompt_token_ids == \
        list(range(50))


def test_executor_resyncs_when_workers_lack_a_sequence(tp2, reference):
    [ref_tokens, *_] = reference("kv1", None)[0]
    first_prompt = prompts()[0]
    # The driver wrongly believes the workers already hold seq 4242: they answer RESYNC and
    # the step is resent in full.
    tp2._encoder.seqs[4242] = ["resync", first_prompt, len(first_prompt), 0, None]
    group = SequenceGroupMetadata("resync", True, {4242: SequenceData(list(first_prompt))},
                                  SamplingParams(temperature=0.0, logprobs=5), {4242: [1]})
    calls = tp2._call_id
    [out] = tp2.execute_model(ExecuteModelRequest([group], finished_requests_ids=[]))
    assert tp2._call_id == calls + 2
    assert out.outputs[0].samples[0].output_token == ref_tokens[0]
    tp2.execute_model(ExecuteModelRequest([], finished_requests_ids=["resync"]))
    assert 4242 not in tp2._encoder.seqs


# ------------------------------------------------------------------------------ collective_rpc


def tcp_local_addresses(worker=None) -> list[str]:
    """Local IPv4/IPv6 addresses (hex, as in /proc/net/tcp*) of this process's TCP sockets."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    addresses = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[9] in inodes:
                    addresses.append(cols[1].split(":")[0])
    return addresses


def test_workers_use_loopback_only(tp2):
    if "GLOO_SOCKET_IFNAME" not in os.environ:
        assert tp2.collective_rpc(lambda w: os.environ["GLOO_SOCKET_IFNAME"]) == ["lo", "lo"]
    # 127.0.0.1, ::1 and ::ffff:127.0.0.1 as /proc/net/tcp{,6} write them
    loopback = {"0100007F", "00000000000000000000000001000000",
                "0000000000000000FFFF00000100007F"}
    for addresses in tp2.collective_rpc(tcp_local_addresses):
        assert addresses and set(addresses) <= loopback, addresses  # gloo's sockets


def test_collective_rpc_semantics(tp2):
    ex = tp2
    assert ex.collective_rpc("check_health") == [None, None]
    assert ex.collective_rpc(lambda w: w.rank) == [0, 1]
    assert ex.collective_rpc(lambda w, a, b=0: a + b + w.rank, args=(2,), kwargs={"b": 3}) == \
        [5, 6]
    offset = 10
    assert ex.collective_rpc(lambda w: w.rank + offset) == [10, 11]  # closures too
    pids = ex.collective_rpc(lambda w: os.getpid())
    assert pids == ex.worker_pids and os.getpid() not in pids
    assert [f(1) for f in ex.collective_rpc(lambda w: lambda x: x + 1)] == [2, 2]

    def boom(worker):
        if worker.rank == 1:
            raise ValueError("boom from the worker")
        return "fine"

    with pytest.raises(ValueError) as info:
        ex.collective_rpc(boom)
    assert isinstance(info.value, RemoteWorkerError) and info.value.rank == 1
    message = str(info.value)
    assert "rank 1" in message and "boom from the worker" in message
    assert "Traceback" in message and "in boom" in message
    ok, err = ex.collective_rpc(boom, return_exceptions=True)
    assert ok == "fine" and isinstance(err, ValueError) and "rank 1" in str(err)
    with pytest.raises(AttributeError, match="rank 0"):
        ex.collective_rpc("no_such_method")


def test_hung_worker_times_out_and_late_reply_is_discarded(tp2):
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError, match=r"\[1\]"):
        tp2.collective_rpc(lambda w: time.sleep(2.5) if w.rank == 1 else "late", timeout=0.5)
    assert time.monotonic() - start < 0.5 + 1.0
    # rank 0's reply to the timed-out call (and rank 1's, once it wakes) must be dropped
    assert tp2.collective_rpc(lambda w: ("fresh", w.rank), timeout=30) == [("fresh", 0),
                                                                            ("fresh", 1)]


# ------------------------------------------------------------------------------ failures


class FailingWorker(Worker):
    def init_device(self) -> None:
        if self.rank == 1:
            raise OSError("no device for this rank (injected)")
        super().init_device()


def late_rank0_worker_main(rank: int, *args) -> None:
    """Rank 0 connects only after rank 1 has failed and exited: a loaded machine's order."""
    from fleetllm.executor import mp_worker
    if rank == 0:
        time.sleep(4.0)
    mp_worker.worker_main(rank, *args)


@pytest.mark.parametrize("order", ["any", "rank0-late"])
def test_startup_failure_names_rank_and_cause(models, monkeypatch, order):
    if order == "rank0-late":  # the death is seen before every rank has connected
        monkeypatch.setattr("fleetllm.executor.multiproc.worker_main", late_rank0_worker_main)
    cfg = EngineConfig.from_kwargs(model=str(models["kv1"]), tensor_parallel_size=2,
                                   worker_cls="test_multiproc.FailingWorker")
    start = time.monotonic()
    with pytest.raises(OSError) as info:
        MultiprocExecutor(cfg)
    assert time.monotonic() - start < 60
    message = str(info.value)
    assert "rank 1" in message and "injected" in message and "in init_device" in message


def test_startup_timeout(models):
    cfg = EngineConfig.from_kwargs(model=str(models["kv1"]), tensor_parallel_size=2,
                                   startup_timeout=0.5)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeoutError, match="startup_timeout"):
        MultiprocExecutor(cfg)
    assert time.monotonic() - start < 10


def test_the_temp_dir_is_removed_before_workers_are_stopped(models, monkeypatch):
    """Stopping workers can take seconds (SIGTERM, waits): a driver SIGKILLed meanwhile left
    its temp dir behind (found after a core process was killed during a worker restart).
    Whichever path stops them (a worker's death, close) removes the dir first."""
    from fleetllm.executor.mp_group import WorkerGroup

    seen: list[bool] = []
    stop = WorkerGroup.stop_processes

    def recording_stop(group, grace):
        seen.append(os.path.exists(group.tmpdir))
        return stop(group, grace)

    monkeypatch.setattr(WorkerGroup, "stop_processes", recording_stop)
    for how in ("worker death", "close"):
        ex = make_executor(models["kv1"], tensor_parallel_size=2)
        tmpdir = ex.tmpdir
        if how == "worker death":
            os.kill(ex.worker_pids[1], signal.SIGKILL)
            wait_until(lambda: seen, 10)
        ex.shutdown()
        assert seen and not any(seen), (how, seen)
        assert not os.path.exists(tmpdir)
        seen.clear()


def test_a_dead_drivers_temp_dir_is_removed_by_the_next_group(monkeypatch):
    """A driver SIGKILLed after making its temp dir but before its workers watch it (during a
    worker restart) left the dir behind (found after CI runs). Each dir holds a lock its
    driver keeps; the next group made on the machine removes the dirs whose lock is free and
    keeps those of live drivers and those without a lock file."""
    import shutil
    import tempfile

    from fleetllm.executor import mp_group

    base = tempfile.mkdtemp(prefix="mpt-", dir="/tmp")  # short: socket paths are limited
    monkeypatch.setattr(tempfile, "tempdir", base)
    make = ("import os, signal, sys, time; from fleetllm.executor import mp_group; "
            "path, fd = mp_group._private_tmpdir(); print(path, flush=True); "
            "os.kill(os.getpid(), signal.SIGKILL) if sys.argv[1] == 'die' else time.sleep(60)")
    env = {**os.environ, "TMPDIR": base}
    fds = []
    living = subprocess.Popen([sys.executable, "-c", make, "live"], env=env, text=True,
                              stdout=subprocess.PIPE)
    try:
        alive_dir = living.stdout.readline().strip()
        dead = subprocess.run([sys.executable, "-c", make, "die"], env=env, text=True,
                              capture_output=True, timeout=60).stdout.strip()
        unlocked = os.path.join(base, "fleetllm-mp-old")  # made before the lock existed
        os.mkdir(unlocked)
        assert all(os.path.isdir(p) for p in (dead, alive_dir, unlocked))
        path, fd = mp_group._private_tmpdir()
        fds.append(fd)
        assert not os.path.exists(dead)
        assert all(os.path.isdir(p) for p in (alive_dir, unlocked, path))
        path2, fd2 = mp_group._private_tmpdir()  # our own first dir's lock is held too
        fds.append(fd2)
        assert os.path.isdir(path) and os.path.isdir(alive_dir)
        living.kill()
        living.wait(10)  # its lock goes with it
        _, fd3 = mp_group._private_tmpdir()
        fds.append(fd3)
        assert not os.path.exists(alive_dir) and os.path.isdir(path)
    finally:
        for fd in fds:
            os.close(fd)
        living.kill()
        living.wait(10)
        living.stdout.close()
        shutil.rmtree(base, ignore_errors=True)


def test_killed_worker_raises_crash_error_quickly_and_cleans_up(models):
    shm_before = shm_entries()
    ex = make_executor(models["kv1"], tensor_parallel_size=2)
    pids, tmpdir = ex.worker_pids, ex.tmpdir
    assert os.stat(tmpdir).st_mode & 0o777 == 0o700
    killed_at = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    timer = threading.Timer(1.0, kill)
    timer.start()
    try:
        with pytest.raises(WorkerCrashedError) as info:
            ex.collective_rpc(lambda w: time.sleep(30), timeout=20)
        latency = time.monotonic() - killed_at[0]
    finally:
        timer.cancel()
    print(f"crash detected {latency * 1000:.0f} ms after kill -9")
    assert latency < 1.0
    assert info.value.rank == 1 and info.value.exitcode == -signal.SIGKILL
    assert "rank 1" in str(info.value)
    start = time.monotonic()
    with pytest.raises(WorkerCrashedError):  # later calls fail at once too
        ex.execute_model(ExecuteModelRequest([]))
    assert time.monotonic() - start < 1.0
    assert wait_until(lambda: not any(alive(p) for p in pids), 10)
    assert wait_until(lambda: not os.path.exists(tmpdir), 10)
    assert wait_until(lambda: not [p for p in multiprocessing.active_children()
                                   if p.pid in pids], 10)  # reaped
    ex.shutdown()
    ex.shutdown()  # idempotent
    assert no_new_shm(shm_before)


def test_garbage_collection_ends_workers(models):
    ex = make_executor(models["kv1"], pipeline_parallel_size=2)
    pids, tmpdir = ex.worker_pids, ex.tmpdir
    del ex
    gc.collect()
    assert wait_until(lambda: not any(alive(p) for p in pids), 10)
    assert not os.path.exists(tmpdir)
    assert not [p for p in multiprocessing.active_children() if p.pid in pids]


# ------------------------------------------------------------------------------ driver signals

DRIVER = """
import json, os, signal, sys, time
from fleetllm.config import EngineConfig
from fleetllm.executor import Executor

if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    cfg = EngineConfig.from_kwargs(model=sys.argv[1], tensor_parallel_size=2,
                                   kv_cache_memory=16 << 20)
    ex = Executor.get_class(cfg)(cfg)
    pids = ex.collective_rpc(lambda w: os.getpid())
    print(json.dumps({"pids": pids, "tmpdir": ex.tmpdir}), flush=True)
    if sys.argv[2] == "exit":  # no shutdown(): the interpreter-exit finalizer must clean up
        sys.exit(0)
    time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL, None],
                         ids=["SIGTERM", "SIGINT", "SIGKILL", "exit"])
def test_driver_signal_or_exit_ends_every_worker(models, tmp_path, sig):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    shm_before = shm_entries()
    proc = subprocess.Popen([sys.executable, str(script), str(models["kv1"]),
                             "exit" if sig is None else "sleep"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "the driver did not start its workers in 120 s"
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        info = json.loads(line)
        pids = info["pids"]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        if sig is not None:
            proc.send_signal(sig)
        sent = time.monotonic()
        proc.wait(timeout=15)
        if sig == signal.SIGTERM:
            assert proc.returncode == -signal.SIGTERM  # the default action, after cleanup
        elif sig is None:
            assert proc.returncode == 0, proc.stderr.read()
        assert wait_until(lambda: not any(alive(p) for p in pids), 10 - (time.monotonic() - sent))
        assert wait_until(lambda: not os.path.exists(info["tmpdir"]), 5)
        assert no_new_shm(shm_before)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_timeout_also_bounds_sending_to_a_worker_that_stopped_reading(models):
    """A worker stuck in a call stops reading; a big message then cannot be delivered. The
    call's timeout bounds the send too (it used to wait forever)."""
    with make_executor(models["kv1"], tensor_parallel_size=2) as ex:
        with pytest.raises(CommunicationTimeoutError):
            ex.collective_rpc(lambda w: time.sleep(30 if w.rank == 1 else 0), timeout=0.5)
        start = time.monotonic()
        with pytest.raises(CommunicationTimeoutError, match="stopped reading"):
            ex.collective_rpc(lambda w, blob: None, args=(b"x" * (64 << 20),), timeout=2)
        assert time.monotonic() - start < 3
