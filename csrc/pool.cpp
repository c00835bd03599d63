// The kernels' own thread pool. After a job marked `spin` the workers spin for FLEETLLM_SPIN_US
// (default 100 us), then sleep; after other jobs they sleep at once. A small-batch decode step
// calls ~60 kernels a few microseconds apart, all of them ours; OpenMP threads under
// OMP_WAIT_POLICY=PASSIVE (which fleetllm set then; now they spin ~0.3 ms: fleetllm/__init__.py)
// go to sleep after every parallel region, and waking them cost 20-300 us per call here, more
// than a small GEMV's work. Spinning briefly keeps them awake through such a step; in a larger
// batch's step oneDNN's OpenMP threads run between our calls and need the cores, so jobs of
// many rows do not spin. Items are claimed dynamically in chunks.
//
// Fork: pthread_atfork handlers take both locks before fork() (so no job is half published and
// no worker is inside the sleep lock), release them in the parent, and in the child release
// them and forget the parent's workers, which do not exist there; the child's next job starts
// new ones. Without that, a child forked while a worker held the sleep lock, or while a job
// ran, waited forever for a lock or for workers that are not there.
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <ctime>

// A test build defines these to random short sleeps: a worker preempted at these points, and
// a worker slow to go to sleep while it holds the sleep lock (where a fork used to copy the
// lock held, and the child waited for it forever).
#ifndef POOL_TEST_PREEMPT
#define POOL_TEST_PREEMPT()
#endif
#ifndef POOL_TEST_LOCKED
#define POOL_TEST_LOCKED()
#endif

namespace fleetllm {
namespace {

struct Job {
    PoolFn fn;
    void *ctx;
    long n, chunk;
    std::atomic<long> next, done;
};

// The job lives here, not on the caller's stack: a worker that wakes late may still look at it
// after its caller returned (a stack job then was a dangling pointer, and a worker's increment
// of it corrupted the caller's next frame). `job` is &slot while a job is published, else null;
// `active` counts workers between deciding to look at `job` and leaving it, and the caller
// unpublishes, then waits for it to reach 0.
struct Pool {
    pid_t pid;         // the process that started the workers (a forked child has none)
    int want;          // workers asked for: nthreads - 1
    int size;          // workers running (fewer than `want` if creating one failed)
    pthread_t *threads;
    Job slot;
    std::atomic<Job *> job;
    std::atomic<int> active;
    std::atomic<unsigned> gen;
    std::atomic<int> sleepers, quit, spin;  // spin: the last job asked workers to stay awake
    long spin_ns;
};

Pool P;
pthread_mutex_t sleep_mu = PTHREAD_MUTEX_INITIALIZER;  // with sleep_cv: workers sleep here
pthread_cond_t sleep_cv = PTHREAD_COND_INITIALIZER;
pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;    // one job at a time

long now_ns()
{
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

inline void relax()
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

void work(Job *j, int tid)
{
    long i;
    while ((i = j->next.fetch_add(j->chunk)) < j->n) {
        const long end = i + j->chunk < j->n ? i + j->chunk : j->n;
        j->fn(j->ctx, i, end, tid);
        j->done.fetch_add(end - i);
    }
}

void *worker_main(void *arg)
{
    const int tid = static_cast<int>(reinterpret_cast<intptr_t>(arg));
    unsigned seen = P.gen.load();
    while (!P.quit.load()) {
        const long deadline = now_ns() + (P.spin.load() ? P.spin_ns : 0);
        int spins = 0;
        while (P.gen.load() == seen) {
            relax();
            if ((++spins & 127) == 0 && now_ns() > deadline) {
                pthread_mutex_lock(&sleep_mu);
                P.sleepers.fetch_add(1);
                POOL_TEST_LOCKED();
                while (P.gen.load() == seen)
                    pthread_cond_wait(&sleep_cv, &sleep_mu);
                P.sleepers.fetch_sub(1);
                pthread_mutex_unlock(&sleep_mu);
            }
        }
        seen = P.gen.load();
        POOL_TEST_PREEMPT();
        P.active.fetch_add(1);  // before reading P.job: the caller waits for it
        Job *j = P.job.load();
        POOL_TEST_PREEMPT();
        if (j)
            work(j, tid);
        P.active.fetch_sub(1);
    }
    return nullptr;
}

void wake_all()
{
    P.gen.fetch_add(1);
    if (P.sleepers.load() > 0) {
        pthread_mutex_lock(&sleep_mu);
        pthread_cond_broadcast(&sleep_cv);
        pthread_mutex_unlock(&sleep_mu);
    }
}

// Stops this process's workers (none to join after a fork: they were the parent's), then
// starts `want` new ones. Every allocation is checked: without workers every job runs inline.
void restart_workers(int want)
{
    if (P.pid == getpid() && P.size > 0) {
        P.quit.store(1);
        wake_all();
        for (int i = 0; i < P.size; i++)
            pthread_join(P.threads[i], nullptr);
    }
    std::free(P.threads);
    P.threads = nullptr;
    P.size = 0;
    P.want = want;
    P.pid = getpid();
    P.quit.store(0);
    P.job.store(nullptr);
    const char *spin = std::getenv("FLEETLLM_SPIN_US");
    P.spin_ns = (spin ? std::atol(spin) : 100) * 1000L;
    if (want <= 0)
        return;
    auto *threads = static_cast<pthread_t *>(std::calloc(static_cast<size_t>(want),
                                                         sizeof(pthread_t)));
    if (threads == nullptr)
        return;
    P.threads = threads;
    for (int i = 0; i < want; i++) {
        if (pthread_create(&P.threads[i], nullptr, worker_main,
                           reinterpret_cast<void *>(static_cast<intptr_t>(i + 1))))
            break;
        P.size = i + 1;
    }
}

void before_fork()
{
    pthread_mutex_lock(&run_mu);    // waits for a job in flight on another thread
    pthread_mutex_lock(&sleep_mu);  // no worker is between counting itself and sleeping
}

void after_fork_in_parent()
{
    pthread_mutex_unlock(&sleep_mu);
    pthread_mutex_unlock(&run_mu);
}

void after_fork_in_child()
{
    // Only the forking thread exists here. The parent's sleeping workers are still counted in
    // the condition variable and in `sleepers`, and a worker may have been counted `active`:
    // start those from nothing. P.pid is the parent's, so the next job starts new workers.
    sleep_cv = PTHREAD_COND_INITIALIZER;
    P.sleepers.store(0);
    P.active.store(0);
    P.job.store(nullptr);
    pthread_mutex_unlock(&sleep_mu);
    pthread_mutex_unlock(&run_mu);
}

// Installed when the library is loaded, before any worker exists.
const int fork_handlers = pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child);

}  // namespace

void pool_run(int nthreads, PoolFn fn, void *ctx, long n, long chunk, bool spin)
{
    (void)fork_handlers;
    if (chunk < 1)
        chunk = 1;
    if (nthreads <= 1 || n <= chunk || pthread_mutex_trylock(&run_mu) != 0) {
        for (long i = 0; i < n; i += chunk)
            fn(ctx, i, i + chunk < n ? i + chunk : n, 0);
        return;
    }
    if (P.pid != getpid() || P.want != nthreads - 1)
        restart_workers(nthreads - 1);
    if (P.size == 0) {  // no worker could be started
        pthread_mutex_unlock(&run_mu);
        for (long i = 0; i < n; i += chunk)
            fn(ctx, i, i + chunk < n ? i + chunk : n, 0);
        return;
    }
    // No worker is inside P.slot now: the previous caller waited for P.active == 0 after
    // unpublishing it, and a worker arriving since finds P.job null until the store below.
    Job *j = &P.slot;
    j->fn = fn;
    j->ctx = ctx;
    j->n = n;
    j->chunk = chunk;
    j->next.store(0);
    j->done.store(0);
    P.spin.store(spin ? 1 : 0);
    P.job.store(j);
    wake_all();
    work(j, 0);
    for (long spins = 0; j->done.load() < n; spins++)
        if (spins > 100000) sched_yield(); else relax();
    P.job.store(nullptr);
    for (long spins = 0; P.active.load() > 0; spins++)  // ctx stays valid till then
        if (spins > 100000) sched_yield(); else relax();
    pthread_mutex_unlock(&run_mu);
}

}  // namespace fleetllm
