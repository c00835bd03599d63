// Paged decode attention: one query per sequence over its context, read in place from the KV
// blocks (no gathered copy, no padding to the longest context), each K/V byte read once per
// step and layer. One work item is (sequence, group of KV heads); D is a literal in the
// specialized calls, so the inner loops vectorize with known trip counts.
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "parallel.h"

namespace fleetllm::kernels {
namespace {

inline __attribute__((always_inline)) void decode_item(
    const float *q, const float *k, const float *v, const int32_t *table, int start, int len,
    int kh0, int nkv, float *out, int H, int KVH, const int D, int bs, float scale,
    float *scores, float *acc)
{
    const int G = H / KVH, nh = nkv * G;
    const long tok = static_cast<long>(KVH) * D;  // floats per token slot in a block
    const int b0 = start / bs, b1 = (len + bs - 1) / bs;
    const int n = (b1 - b0) * bs;                  // whole blocks; the ends are masked
    const int lo = start - b0 * bs, hi = len - b0 * bs;
    const float *qb = q + static_cast<long>(kh0) * G * D;
    for (int blk = b0; blk < b1; blk++) {  // scores = q . K, block by block
        const float *kb = k + static_cast<long>(table[blk]) * bs * tok + static_cast<long>(kh0) * D;
        const int base = (blk - b0) * bs;
        for (int o = 0; o < bs; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kp = kb + o * tok + static_cast<long>(kh) * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float *qh = qb + static_cast<long>(h) * D;
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int d = 0; d < D; d++) s += qh[d] * kp[d];
                    scores[static_cast<long>(h) * n + base + o] = s * scale;
                }
            }
        }
    }
    for (int h = 0; h < nh; h++) {  // softmax over the visible positions
        float *sh = scores + static_cast<long>(h) * n;
        float m = -INFINITY, sum = 0.f;
        for (int t = lo; t < hi; t++) m = sh[t] > m ? sh[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = lo; t < hi; t++) { const float e = exp_f32(sh[t] - m); sh[t] = e; sum += e; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = lo; t < hi; t++) sh[t] *= inv;
    }
    std::memset(acc, 0, sizeof(float) * static_cast<size_t>(nh) * D);
    for (int blk = b0; blk < b1; blk++) {  // out = P . V
        const float *vb = v + static_cast<long>(table[blk]) * bs * tok + static_cast<long>(kh0) * D;
        const int base = (blk - b0) * bs;
        const int o0 = base < lo ? lo - base : 0;
        const int o1 = base + bs <= hi ? bs : hi - base;
        for (int o = o0; o < o1; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *vp = vb + o * tok + static_cast<long>(kh) * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float w = scores[static_cast<long>(h) * n + base + o];
                    float *ah = acc + static_cast<long>(h) * D;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += w * vp[d];
                }
            }
        }
    }
    std::memcpy(out + static_cast<long>(kh0) * G * D, acc,
                sizeof(float) * static_cast<size_t>(nh) * D);
}

struct DecodeCtx {
    const float *q, *k, *v;
    long q_stride, scratch_per;
    const DecodeBatch *batch;
    float *out, *scratch, scale;
    int H, KVH, D, bs, window, split, nkv;
};

void decode_body(void *arg, long begin, long end, int tid)
{
    const auto *c = static_cast<const DecodeCtx *>(arg);
    float *scores = c->scratch + tid * c->scratch_per;
    float *acc = scores + static_cast<long>(c->H) * (c->batch->maxlen + 2 * c->bs);
    for (long item = begin; item < end; item++) {
        const int b = static_cast<int>(item / c->split);
        const int kh0 = static_cast<int>(item % c->split) * c->nkv;
        const int len = c->batch->ctx_lens[b];
        const int start = c->window > 0 && len > c->window ? len - c->window : 0;
        const float *qb = c->q + static_cast<long>(b) * c->q_stride;
        float *ob = c->out + static_cast<long>(b) * c->H * c->D;
        const int32_t *table = c->batch->tables + c->batch->table_start[b];
        if (c->D == 64)
            decode_item(qb, c->k, c->v, table, start, len, kh0, c->nkv, ob, c->H, c->KVH, 64,
                        c->bs, c->scale, scores, acc);
        else if (c->D == 128)
            decode_item(qb, c->k, c->v, table, start, len, kh0, c->nkv, ob, c->H, c->KVH, 128,
                        c->bs, c->scale, scores, acc);
        else
            decode_item(qb, c->k, c->v, table, start, len, kh0, c->nkv, ob, c->H, c->KVH,
                        c->D, c->bs, c->scale, scores, acc);
    }
}

}  // namespace

long paged_decode_scratch(int H, int D, int bs, int maxlen, int nthreads)
{
    const long per = static_cast<long>(H) * (maxlen + 2L * bs) + static_cast<long>(H) * D;
    return per * (nthreads > 0 ? nthreads : 1);
}

void paged_decode_f32(const float *q, long q_stride, const float *k, const float *v,
                      const DecodeBatch &batch, float *out, int B, int H, int KVH, int D, int bs,
                      int window, float scale, float *scratch, int nthreads)
{
    DecodeCtx c{};
    c.q = q;
    c.k = k;
    c.v = v;
    c.q_stride = q_stride;
    c.batch = &batch;
    c.out = out;
    c.scratch = scratch;
    c.scale = scale;
    c.H = H;
    c.KVH = KVH;
    c.D = D;
    c.bs = bs;
    c.window = window;
    // Whole sequences per item read whole token rows (better prefetching); a small batch
    // splits by KV head so that every thread has work.
    c.split = B >= 4 * nthreads ? 1 : KVH;
    c.nkv = KVH / c.split;
    c.scratch_per = paged_decode_scratch(H, D, bs, batch.maxlen, 1);
    parallel_run(nthreads, decode_body, &c, static_cast<long>(B) * c.split, 1, B <= SPIN_ROWS);
}

}  // namespace fleetllm::kernels
