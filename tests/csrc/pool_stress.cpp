// Stress tests of the kernels' thread pool (csrc/pool.cpp), built alone by
// tests/kernels/test_kernel_pool.py (with -DPOOL_TEST_PREEMPT: random sleeps at the race points).
//
//   pool_stress late: 200,000 tiny jobs back to back from two different stack frames, as a
//       fused decoder layer runs them; prints "late N", the accesses of a job after its caller
//       returned (must be 0).
//   pool_stress fork: a second thread runs jobs while the main thread forks 300 times; each
//       child runs jobs on the pool and exits. Prints "hung N failed M": N children did not
//       finish within 10 s (it stops at the first), M exited with an error (both must be 0).
//       Built with -DPOOL_TEST_LOCKED (a worker sleeping while it holds the sleep lock), the
//       pool without fork handlers hung in about 40% of the children. The test's sleeps must
//       not take a lock (rand() does: a child forked while the busy thread held it hung).
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <thread>

#include "pool.h"

namespace {

std::atomic<long> late;

struct Call {
    volatile int live;
};

void body(void *ctx, long, long, int)
{
    auto *c = static_cast<Call *>(ctx);
    if (!c->live) late.fetch_add(1);
    for (int k = 0; k < 50; k++)
        __asm__ volatile("" ::: "memory");  // a little work the compiler keeps
    if (!c->live) late.fetch_add(1);
}

__attribute__((noinline)) void one(long n, bool spin)
{
    Call c{1};
    fleetllm::pool_run(2, body, &c, n, 1, spin);
    c.live = 0;
}

__attribute__((noinline)) void other(long n)
{
    volatile long pad[3];
    Call c{1};
    pad[0] = n;
    fleetllm::pool_run(2, body, &c, n, 1, true);
    c.live = 0;
    (void)pad[0];
}

int run_late()
{
    for (long it = 0; it < 200000; it++) {
        if (it & 1) one(2 + it % 5, true); else other(2 + it % 3);
    }
    std::printf("late %ld\n", late.load());
    return late.load() != 0;
}

double now()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int run_fork()
{
    std::atomic<bool> stop{false};
    // Jobs that do not spin: the workers go to sleep after each, so the sleep lock and the
    // sleeper count change all the time, and a fork lands in the middle of that.
    // Pauses between jobs: a fork also lands where no job holds the pool.
    std::thread busy([&] {
        while (!stop.load()) {
            one(2 + std::rand() % 6, false);
            usleep(std::rand() % 100);
        }
    });
    int hung = 0, failed = 0;
    for (int i = 0; i < 300 && hung == 0; i++) {
        usleep(std::rand() % 200);
        const pid_t pid = fork();
        if (pid == 0) {
            for (int k = 0; k < 20; k++)
                one(4, k & 1);
            _exit(late.load() == 0 ? 0 : 3);
        }
        int status = 0;
        const double deadline = now() + 10;
        pid_t done;
        while ((done = waitpid(pid, &status, WNOHANG)) == 0 && now() < deadline)
            usleep(1000);
        if (done == 0) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            hung++;
        } else if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            failed++;
        }
    }
    stop.store(true);
    busy.join();
    std::printf("hung %d failed %d\n", hung, failed);
    return hung + failed != 0;
}

}  // namespace

int main(int argc, char **argv)
{
    if (argc == 2 && std::strcmp(argv[1], "late") == 0)
        return run_late();
    if (argc == 2 && std::strcmp(argv[1], "fork") == 0)
        return run_fork();
    std::fprintf(stderr, "usage: pool_stress late|fork\n");
    return 2;
}
