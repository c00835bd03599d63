/* The CPU's arithmetic peak on one core, as a bound for the matmul rates the benchmarks print:
 * float32 FMA (vfmadd231ps, 512-bit with AVX-512, else 256-bit with AVX2 and FMA) and, where
 * the CPU has AVX-512 BF16, the dot product of bf16 pairs (vdpbf16ps: 32 multiply-adds per
 * 512-bit instruction), each with 12 independent
 * accumulators in registers (unrolled: GCC -O2 kept them in memory, at half the rate) so that
 * only the instruction's throughput counts.
 *
 *     cc -O2 -march=native tools/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak [seconds]
 *
 * Prints GFLOP/s per core (2 FLOPs per multiply-add). -march=native suits a measurement run
 * on the machine measured; the engine's kernels never use it. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

static double now(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

#define ACC 12

/* GFLOP/s of STEP(j) (one instruction into acc[j] of MACS multiply-adds) run on ACC
 * accumulators, in blocks of 100,000 rounds until `seconds` have passed. The empty asm keeps
 * GCC from hoisting the operand `a` out of the loop; the final sum keeps the results alive. */
#define PEAK(seconds, MACS, STEP, ZERO, SUM)                                            \
    do {                                                                                \
        for (int j = 0; j < ACC; j++) acc[j] = ZERO();                                  \
        long rounds = 0;                                                                \
        const double t0 = now();                                                        \
        double t;                                                                       \
        do {                                                                            \
            for (int i = 0; i < 100000; i++) {                                          \
                _Pragma("GCC unroll 12") for (int j = 0; j < ACC; j++) STEP(j);         \
                __asm__ volatile("" : "+v"(a));                                         \
            }                                                                           \
            rounds += 100000;                                                           \
        } while ((t = now() - t0) < (seconds));                                         \
        float sink = 0.f;                                                               \
        for (int j = 0; j < ACC; j++) sink += SUM(acc[j]);                              \
        if (sink < 0.f) puts("");                                                       \
        return rounds * ACC * (MACS) * 2.0 / t / 1e9;                                   \
    } while (0)

#if defined(__AVX512F__)
static double fp32_peak(double seconds)
{
    __m512 acc[ACC], a = _mm512_set1_ps(1e-8f), b = _mm512_set1_ps(1.f);
#define FMA(j) acc[j] = _mm512_fmadd_ps(a, b, acc[j])
    PEAK(seconds, 16, FMA, _mm512_setzero_ps, _mm512_reduce_add_ps);
}
#elif defined(__AVX2__) && defined(__FMA__)
static float sum8(__m256 v)
{
    float lanes[8], s = 0.f;
    _mm256_storeu_ps(lanes, v);
    for (int l = 0; l < 8; l++) s += lanes[l];
    return s;
}

static double fp32_peak(double seconds)
{
    __m256 acc[ACC], a = _mm256_set1_ps(1e-8f), b = _mm256_set1_ps(1.f);
#define FMA(j) acc[j] = _mm256_fmadd_ps(a, b, acc[j])
    PEAK(seconds, 8, FMA, _mm256_setzero_ps, sum8);
}
#endif

#if defined(__AVX512BF16__)
static double bf16_peak(double seconds)
{
    __m512 acc[ACC];
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3f80);
#define DOT(j) acc[j] = _mm512_dpbf16_ps(acc[j], a, b)
    PEAK(seconds, 32, DOT, _mm512_setzero_ps, _mm512_reduce_add_ps);
}
#endif

int main(int argc, char **argv)
{
    const double seconds = argc > 1 ? atof(argv[1]) : 1.0;
#if defined(__AVX512F__)
    printf("float32 FMA (AVX-512): %.1f GFLOP/s per core\n", fp32_peak(seconds));
#elif defined(__AVX2__) && defined(__FMA__)
    printf("float32 FMA (AVX2): %.1f GFLOP/s per core\n", fp32_peak(seconds));
#else
    puts("float32 FMA: built without AVX-512 or AVX2 and FMA");
#endif
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
    (void)seconds;
    (void)now;
#endif
#if defined(__AVX512BF16__)
    printf("bf16 dot product (AVX-512 BF16): %.1f GFLOP/s per core\n", bf16_peak(seconds));
#else
    puts("bf16 dot product: this CPU (or compiler) has no AVX-512 BF16");
#endif
    return 0;
}
