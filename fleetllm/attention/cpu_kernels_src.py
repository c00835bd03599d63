"""The C source of fleetllm's CPU kernels, part 1: the thread pool and helpers (cpu_kernels.py
builds RUNTIME + cpu_kernels_ops.OPS and calls it)."""

RUNTIME = r"""
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------- thread pool
   The kernels' own workers. After a job marked `spin` they spin for FLEETLLM_SPIN_US
   (default 100 us), then sleep; after other jobs they sleep at once. A small-batch decode
   step calls ~60 kernels a few microseconds apart, all of them ours; OpenMP threads under
   OMP_WAIT_POLICY=PASSIVE (which fleetllm sets, for processes sharing cores) go to sleep
   after every parallel region, and waking them cost 20-300 us per call here, more than a
   small GEMV's work. Spinning briefly keeps them awake through such a step; in a larger
   batch's step oneDNN's OpenMP threads run between our calls and need the cores, so jobs of
   many rows do not spin. Items are claimed dynamically in chunks. */

typedef void (*pool_fn)(void *ctx, long begin, long end, int tid);

/* A test build defines it to a random short sleep: a worker preempted at these points. */
#ifndef POOL_TEST_PREEMPT
#define POOL_TEST_PREEMPT()
#endif

typedef struct {
    pool_fn fn;
    void *ctx;
    long n, chunk;
    atomic_long next, done;
} job_t;

static struct {
    pid_t pid;  /* the process that started the workers (a fork has none) */
    int size;   /* worker threads; the caller is the other participant */
    pthread_t *threads;
    /* The job lives here, not on the caller's stack: a worker that wakes late may still
       look at it after its caller returned (a stack job then was a dangling pointer, and a
       worker's increment of it corrupted the caller's next frame). `job` is &slot while a
       job is published, else NULL; `active` counts workers between deciding to look at
       `job` and leaving it, and the caller unpublishes, then waits for it to reach 0. */
    job_t slot;
    _Atomic(job_t *) job;
    atomic_int active;
    atomic_uint gen;
    atomic_int sleepers, quit, spin;  /* spin: the last job asked workers to stay awake */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    long spin_ns;
} P = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};
static pthread_mutex_t run_mu = PTHREAD_MUTEX_INITIALIZER;  /* one job at a time */

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static inline void relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

static void work(job_t *j, int tid)
{
    long i;
    while ((i = atomic_fetch_add(&j->next, j->chunk)) < j->n) {
        const long end = i + j->chunk < j->n ? i + j->chunk : j->n;
        j->fn(j->ctx, i, end, tid);
        atomic_fetch_add(&j->done, end - i);
    }
}

static void *worker_main(void *arg)
{
    const int tid = (int)(intptr_t)arg;
    unsigned seen = atomic_load(&P.gen);
    while (!atomic_load(&P.quit)) {
        const long deadline = now_ns() + (atomic_load(&P.spin) ? P.spin_ns : 0);
        int spins = 0;
        while (atomic_load(&P.gen) == seen) {
            relax();
            if ((++spins & 127) == 0 && now_ns() > deadline) {
                pthread_mutex_lock(&P.mu);
                atomic_fetch_add(&P.sleepers, 1);
                while (atomic_load(&P.gen) == seen)
                    pthread_cond_wait(&P.cv, &P.mu);
                atomic_fetch_sub(&P.sleepers, 1);
                pthread_mutex_unlock(&P.mu);
            }
        }
        seen = atomic_load(&P.gen);
        POOL_TEST_PREEMPT();
        atomic_fetch_add(&P.active, 1);  /* before reading P.job: the caller waits for it */
        job_t *j = atomic_load(&P.job);
        POOL_TEST_PREEMPT();
        if (j)
            work(j, tid);
        atomic_fetch_sub(&P.active, 1);
    }
    return NULL;
}

static void wake_all(void)
{
    atomic_fetch_add(&P.gen, 1);
    if (atomic_load(&P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
}

static void pool_resize(int size)
{
    if (P.pid == getpid() && P.size > 0) {  /* stop the old workers */
        atomic_store(&P.quit, 1);
        wake_all();
        for (int i = 0; i < P.size; i++)
            pthread_join(P.threads[i], NULL);
    }
    free(P.threads);  /* after a fork: the parent's workers do not exist here */
    P.threads = NULL;
    P.size = 0;
    P.pid = getpid();
    atomic_store(&P.quit, 0);
    atomic_store(&P.job, NULL);
    const char *spin = getenv("FLEETLLM_SPIN_US");
    P.spin_ns = (spin ? atol(spin) : 100) * 1000L;
    if (size <= 0)
        return;
    P.threads = calloc((size_t)size, sizeof(pthread_t));
    for (int i = 0; i < size; i++) {
        if (pthread_create(&P.threads[i], NULL, worker_main, (void *)(intptr_t)(i + 1)))
            break;
        P.size = i + 1;
    }
}

/* fn(ctx, begin, end, tid) over [0, n) in chunks, on nthreads participants (tid 0 is the
   caller, tids are < nthreads). Runs inline for one thread, or if another job is running.
   spin: the workers stay awake for FLEETLLM_SPIN_US after it (another call is coming). */
static void pool_run(int nthreads, pool_fn fn, void *ctx, long n, long chunk, int spin)
{
    if (chunk < 1)
        chunk = 1;
    if (nthreads <= 1 || n <= chunk || pthread_mutex_trylock(&run_mu) != 0) {
        for (long i = 0; i < n; i += chunk)
            fn(ctx, i, i + chunk < n ? i + chunk : n, 0);
        return;
    }
    if (P.pid != getpid() || P.size != nthreads - 1)
        pool_resize(nthreads - 1);
    /* No worker is inside P.slot now: the previous caller waited for P.active == 0 after
       unpublishing it, and a worker arriving since finds P.job NULL until the store below. */
    job_t *j = &P.slot;
    j->fn = fn;
    j->ctx = ctx;
    j->n = n;
    j->chunk = chunk;
    atomic_store(&j->next, 0);
    atomic_store(&j->done, 0);
    atomic_store(&P.spin, spin);
    atomic_store(&P.job, j);
    wake_all();
    work(j, 0);
    for (long spins = 0; atomic_load(&j->done) < n; spins++)
        if (spins > 100000) sched_yield(); else relax();
    atomic_store(&P.job, NULL);
    for (long spins = 0; atomic_load(&P.active) > 0; spins++)  /* ctx stays valid till then */
        if (spins > 100000) sched_yield(); else relax();
    pthread_mutex_unlock(&run_mu);
}

/* exp(x) for float, vectorizable (glibc's expf is not, without -ffast-math): Cody-Waite
   reduction x = n ln2 + r, Cephes' degree-6 polynomial for exp(r), times 2^n built in the
   exponent bits. Within ~2 ulp of expf over [-87, 88]; inputs are clamped to that range. */
static inline float exp_f32(float x)
{
    x = x < -87.33654f ? -87.33654f : (x > 88.37626f ? 88.37626f : x);
    const float n = floorf(x * 1.44269504f + 0.5f);
    const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float y = p * r * r + r + 1.0f;
    union { int32_t i; float f; } scale = { .i = ((int32_t)n + 127) << 23 };
    return y * scale.f;
}
"""
