"""The C kernels' thread pool under preemption: a worker that wakes late (descheduled between
noticing a job and joining it) must never touch a job, or its caller's stack, after the call
returned. The test builds the pool alone with a random sleep at those points and runs 200,000
tiny jobs back to back from two different stack frames, as a decode step's fused layer does.
The first pool kept each job on its caller's stack and counted its workers there: with the
same sleeps put in by hand it hung (one run of two), and in a fresh-clone run of the suite it
crashed once (a segfault in the fused decoder layer, which runs ~10 jobs back to back)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from fleetllm.attention.cpu_kernels_src import RUNTIME

_MAIN = r"""
#include <stdio.h>
static atomic_long late;
typedef struct { volatile int live; } call_t;

static void body(void *ctx, long begin, long end, int tid)
{
    call_t *c = ctx;
    if (!c->live) atomic_fetch_add(&late, 1);
    for (volatile int k = 0; k < 50; k++) {}
    if (!c->live) atomic_fetch_add(&late, 1);
}

__attribute__((noinline)) static void one(long n)
{
    call_t c = {1};
    pool_run(2, body, &c, n, 1, 1);
    c.live = 0;
}

__attribute__((noinline)) static void other(long n)
{
    volatile long pad[3];
    call_t c = {1};
    pad[0] = n;
    pool_run(2, body, &c, n, 1, 1);
    c.live = 0;
    (void)pad[0];
}

int main(void)
{
    for (long it = 0; it < 200000; it++) {
        if (it & 1) one(2 + it % 5); else other(2 + it % 3);
    }
    printf("late %ld\n", atomic_load(&late));
    return atomic_load(&late) != 0;
}
"""


def test_late_workers_never_touch_a_finished_job(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler: the kernels are not built here either")
    src = tmp_path / "pool.c"
    src.write_text(RUNTIME + _MAIN)
    exe = tmp_path / "pool"
    subprocess.run([cc, "-O2", "-pthread", "-DPOOL_TEST_PREEMPT()=if (rand() % 16 == 0) "
                    "usleep(rand() % 30)", str(src), "-o", str(exe), "-lm"], check=True,
                   timeout=120)
    try:
        run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the pool hung: a late worker corrupted a job's bookkeeping")
    assert run.returncode == 0 and run.stdout.strip() == "late 0", (run.returncode,
                                                                     run.stdout)
