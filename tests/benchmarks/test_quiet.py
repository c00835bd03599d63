"""The benchmarks' busy-machine warning (fleetllm/benchmarks/quiet.py) from /proc/stat."""

from __future__ import annotations

from fleetllm.benchmarks import quiet


def _stat(user: int, idle: int) -> str:
    # cpu user nice system idle iowait irq softirq steal
    return f"cpu  {user} 0 0 {idle} 0 0 0 0 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n"


def test_the_busy_share_is_what_other_work_took_between_two_reads():
    snapshots = iter([_stat(100, 1000), _stat(160, 1040)])  # 60 busy of 100 jiffies
    share = quiet.busy_share(0.0, lambda: next(snapshots))
    assert abs(share - 0.6) < 1e-9
    assert "not quiet-machine figures" in quiet.busy_warning(share)
    assert "60%" in quiet.busy_warning(share)


def test_a_quiet_machine_or_an_unreadable_stat_gives_no_warning():
    snapshots = iter([_stat(100, 1000), _stat(105, 1095)])
    assert quiet.busy_warning(quiet.busy_share(0.0, lambda: next(snapshots))) is None
    assert quiet.busy_share(0.0, lambda: "garbage") is None
    assert quiet.busy_warning(None) is None


def test_this_machine_reads_as_a_share():
    share = quiet.busy_share(0.05)
    assert share is None or 0.0 <= share <= 1.0
