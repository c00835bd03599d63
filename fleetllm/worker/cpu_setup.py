"""A worker process's CPU setup, done once before its model loads: torch's intra-op thread
count (the physical cores this process may use, shared by the machine's ranks) and glibc's
malloc tuning (freed step memory stays in the heap; the memory packing freed goes back).
Each does nothing where it does not apply (not Linux, not glibc), and the user's settings
win: FLEETLLM_NUM_THREADS, OMP_NUM_THREADS, FLEETLLM_MALLOC_TUNING=0.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from fleetllm import envs


def available_cores() -> int:
    """Physical cores this process may run on: its CPU affinity, one per core when SMT
    siblings are both allowed (a GEMM gains nothing from a core's second thread), capped by a
    cgroup CPU quota (a container limited to 2 CPUs on a 64-CPU host sees 64 in affinity)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in allowed:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            siblings = (topology / "core_cpus_list").read_text().strip()
        except OSError:
            try:
                siblings = (topology / "thread_siblings_list").read_text().strip()
            except OSError:
                siblings = str(cpu)
        cores.add(siblings)
    count = len(cores) or len(allowed) or 1
    for path, period_path in (("/sys/fs/cgroup/cpu.max", None),
                              ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us",
                               "/sys/fs/cgroup/cpu/cpu.cfs_period_us")):
        try:
            fields = Path(path).read_text().split()
            quota = fields[0]
            period = fields[1] if period_path is None else Path(period_path).read_text()
            if quota not in ("max", "-1"):
                count = min(count, max(1, int(int(quota) / int(period))))
            break
        except (OSError, ValueError, IndexError):
            continue
    return count


def set_intra_op_threads(ranks: int) -> None:
    """torch's intra-op threads: FLEETLLM_NUM_THREADS, else OMP_NUM_THREADS (torch reads it
    itself), else the available physical cores shared by this machine's ranks. torch's own
    default counts every core of the host, also those a container's quota does not give it,
    and oversubscribed threads stall each other at every barrier."""
    threads = envs.get("FLEETLLM_NUM_THREADS")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    elif not envs.get("OMP_NUM_THREADS"):
        torch.set_num_threads(max(1, available_cores() // max(1, ranks)))


def keep_freed_memory() -> None:
    """glibc serves allocations of 32 MiB and more (a prefill step's MLP activations) with
    fresh mmaps and unmaps them when freed, so every step page-faults them in again (the
    figures: docs/performance.md, changelog 8). Raising the mmap and trim thresholds keeps
    freed memory in the heap for the next step (the process keeps its peak footprint, as an
    inference worker does anyway). FLEETLLM_MALLOC_TUNING=0 skips it; not glibc: nothing."""
    if not envs.get("FLEETLLM_MALLOC_TUNING"):
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, ctypes.c_int(1 << 30))
    mallopt(m_trim_threshold, ctypes.c_int(2**31 - 1))


def return_freed_memory() -> None:
    """Give the heap's free memory back to the system once (glibc's malloc_trim): with the
    trim threshold keep_freed_memory raises, the dense weights that packing freed would stay
    in the process for good."""
    if not envs.get("FLEETLLM_MALLOC_TUNING"):
        return
    try:
        ctypes.CDLL(None).malloc_trim(ctypes.c_size_t(0))
    except (OSError, AttributeError):
        pass
