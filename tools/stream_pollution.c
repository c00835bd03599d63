/* What a decode step's stream of weights leaves in the caches for the host code after it: a
 * 4 MiB working set (a random pointer chain, the way Python's objects are reached) is walked
 * once warm, then after each of several ways of reading 200 MiB (a bf16 125M model's weights)
 * once with one thread, and each walk is timed. If some way of reading kept the working set in
 * L2/L3, the walk after it would stay near the warm time.
 *
 *     cc -O2 -march=native tools/stream_pollution.c -o /tmp/stream_pollution && /tmp/stream_pollution
 *
 * Ways of reading: plain 64-byte loads (what the kernels do); the same with prefetchnta 4 KiB
 * ahead; non-temporal loads (vmovntdqa); both; plain loads with clflushopt of each line 4 KiB
 * behind (the line leaves every cache level before L2 evicts it into L3). Needs AVX-512F and
 * CLFLUSHOPT; -march=native suits a measurement run on the machine measured. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

#define STREAM (200L << 20)
#define WORKING (4L << 20)
#define ROUNDS 10

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static long walk(const long *chain, long n)
{
    long p = 0;
    for (long i = 0; i < n; i++)
        p = chain[p];
    return p;
}

static __m512 stream(const char *big, int mode)
{
    __m512 acc = _mm512_setzero_ps();
    for (long i = 0; i < STREAM; i += 64) {
        const char *p = big + i;
        __m512 v;
        if (mode == 1)
            _mm_prefetch(p + 4096, _MM_HINT_NTA);
        if (mode == 2 || mode == 3) {
            if (mode == 3)
                _mm_prefetch(p + 1024, _MM_HINT_NTA);
            v = _mm512_castsi512_ps(_mm512_stream_load_si512((void *)p));
        } else {
            v = _mm512_load_ps((const float *)p);
        }
        acc = _mm512_add_ps(acc, v);
        if (mode == 4 && i >= 4096)
            _mm_clflushopt((void *)(p - 4096));
    }
    return acc;
}

int main(void)
{
    static const char *names[] = {"plain loads", "prefetchnta 4 KiB ahead", "vmovntdqa",
                                  "vmovntdqa + prefetchnta", "clflushopt 4 KiB behind"};
    char *big = mmap(NULL, STREAM, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (big == MAP_FAILED)
        return 1;
    madvise(big, STREAM, MADV_HUGEPAGE);  /* as the engine places its weights */
    for (long i = 0; i < STREAM; i += 64)
        big[i] = 1;
    const long n = WORKING / 64;
    long *chain = aligned_alloc(64, WORKING), *order = malloc(n * sizeof(long));
    if (chain == NULL || order == NULL)
        return 1;
    for (long i = 0; i < n; i++)
        order[i] = i;
    srand(1);
    for (long i = n - 1; i > 0; i--) {
        const long j = rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
    for (long i = 0; i < n; i++)  /* one long per line, lines in random order */
        chain[order[i] * 8] = order[(i + 1) % n] * 8;
    long sink = walk(chain, n);
    double t0 = now();
    sink += walk(chain, n);
    printf("walk of the 4 MiB working set, warm: %.2f ms (%.0f ns a line)\n",
           (now() - t0) * 1e3, (now() - t0) / n * 1e9);
    for (int mode = 0; mode < 5; mode++) {
        double read = 0, after = 0;
        float keep = 0;
        for (int r = 0; r < ROUNDS; r++) {
            sink += walk(chain, n);  /* warm again */
            const double a = now();
            keep += _mm512_reduce_add_ps(stream(big, mode));
            const double b = now();
            sink += walk(chain, n);
            after += now() - b;
            read += b - a;
        }
        printf("%-26s read %.1f GB/s; walk after it %.2f ms (%.0f ns a line)\n", names[mode],
               STREAM / (read / ROUNDS) / 1e9, after / ROUNDS * 1e3, after / ROUNDS / n * 1e9);
        if (keep == 1.5f)
            printf("%ld\n", sink);
    }
    return (int)(sink & 0);
}
