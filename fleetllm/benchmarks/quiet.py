"""Whether the machine was quiet when a benchmark started: the share of all CPUs' time that
other work took over half a second, from /proc/stat, printed as a warning by `fleetllm bench
latency|throughput` when it is high. Figures from a busy machine compare engines badly (a peer
whose threads spin at a barrier, as llama.cpp's do, loses 10x on a shared core where fleetllm
loses 2x), and the docs take quiet-machine figures only."""

from __future__ import annotations

import time
from collections.abc import Callable

BUSY = 0.25  # the share of all CPUs' time above which a run is flagged


def _cpu_times(read: Callable[[], str]) -> tuple[int, int] | None:
    """(idle, total) jiffies of all CPUs, from /proc/stat's first line."""
    try:
        fields = read().splitlines()[0].split()
        values = [int(v) for v in fields[1:]]
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] != "cpu" or len(values) < 5:
        return None
    return values[3] + values[4], sum(values[:8])  # idle + iowait; user .. steal


def busy_share(seconds: float = 0.5,
               read: Callable[[], str] = lambda: open("/proc/stat").read()) -> float | None:
    """The share (0..1) of all CPUs' time spent busy over `seconds`; None where /proc/stat
    cannot be read (not Linux)."""
    first = _cpu_times(read)
    time.sleep(seconds)
    second = _cpu_times(read)
    if first is None or second is None or second[1] <= first[1]:
        return None
    return 1.0 - (second[0] - first[0]) / (second[1] - first[1])


def busy_warning(share: float | None) -> str | None:
    """The line the benchmarks print for a busy machine, or None."""
    if share is None or share <= BUSY:
        return None
    return (f"machine busy: {share:.0%} of all CPU time was taken by other work as the run "
            "started; these are not quiet-machine figures")
