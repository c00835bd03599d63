// Prefill attention: every prompt span's queries over its context, causal (and windowed), the
// keys and values read in place from the paged KV cache through the context's slots (a fresh
// prompt and one after a cached prefix alike; no gathered copy, no padding between spans).
//
// Why: PyTorch's CPU flash attention runs these short spans at 35-60 GFLOP/s here (small
// GEMMs per 32-query block, a call per padded group); it was 11% of a bf16 throughput run.
// How: one work item is (span, KV head), longest spans first; its K is transposed once into
// float32 [D][keys] (whole vectors, in registers; as far as its tiles of query rows reach), so
// that 8 queries (rows x the G query heads of the KV head) score 16 keys with 8 vector FMAs
// per element of D; then per query the softmax and P . V as PyTorch's flash attention computes
// them (chunk_softmax in kernels.h, which decode attention shares: keys in chunks of 512 from
// position 0, a running max and sum, fexp_u20 on whole vectors of the chunk and expf on its
// tail, the numerators rounded to bfloat16 for a bf16 model, the sum divided at the end), the
// queries' P . V sums in registers while each value row is read. A bf16 model with a bf16
// cache, on CPUs with AVX-512 BF16, runs both products by bf16 pairs (bf16_pairs.h: the same
// bits, two elements per instruction; 1.3-1.5x the kernel's speed here; not where that
// instruction is slow, see by_pairs), and where the CPU
// has AMX both products run on its tiles (attention_amx.h: the values repacked by pairs of
// positions as the keys' transposition reaches them, all of a tile's queries' P . V per
// chunk in one pass; 1.3-2.4x the pairs' speed on an AMX Xeon, in the tiles' own order of
// sums, which PyTorch's flash attention there shares).
// The vector/tail split of a chunk follows the span's whole context (the key count
// transformers' prompt forward has), not the query's visible part: the visible keys past it
// use expf there too. A float32 model takes the accurate exp instead of fexp_u20.
// Here: the tiles of queries, the keys' transposition as far as a tile reaches, the softmax
// and the split of the work; the two products in each of their ways: prefill_products.h.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "prefill_products.h"

namespace fleetllm::kernels {
namespace {

using namespace prefill;

struct Item {
    int span, kh, r0, r1;  // query rows [r0, r1) of the span (whole tiles), KV head kh
};

template <class T, class C>
struct PrefillCtx {
    const T *q;
    const C *k, *v;
    const int32_t *spans;  // [S, 4]: q_start, q_len, ctx_len, slot_start
    const int64_t *slots;
    const Item *items;
    T *out;
    float *scratch, scale;
    long q_stride, scratch_per;
    int H, KVH, D, window, rows_per_tile, maxctx;
};

inline void zero(float *s, int a, int b)
{
    if (a < b) std::memset(s + a, 0, sizeof(float) * static_cast<size_t>(b - a));
}

template <class T, class C>
void prefill_body(void *arg, long begin, long end, int tid)
{
    const auto *c = static_cast<const PrefillCtx<T, C> *>(arg);
    const int H = c->H, D = c->D, G = H / c->KVH, R = c->rows_per_tile;
    const long tok = static_cast<long>(c->KVH) * D;
    const int nqmax = tile_queries(R * G), npmax = c->maxctx + 16;
    float *qf = c->scratch + tid * c->scratch_per, *kt = qf + static_cast<long>(nqmax) * D;
    float *s = kt + static_cast<long>(D) * npmax, *acc = s + static_cast<long>(nqmax) * npmax;
    float *run_max = acc + static_cast<long>(nqmax) * D, *run_sum = run_max + nqmax;
    // By bf16 pairs (above): K transposed by pairs into kt, q's pairs into qf.
    bool by_amx = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    constexpr bool pair_types = std::is_same_v<T, bf16> && std::is_same_v<C, bf16>;
    const bool pairs_fit = pair_types && bf16_dot && (D == 64 || D == 128);
    // On AMX tiles (attention_amx.h): the values by pairs of positions into vt2, P in bf16
    // into pb. Not by vdpbf16ps where it runs at under two thirds of the FMAs' rate
    // (pairs_by_fma, gemm.cpp): the float32 loops give its bits in less time there.
    by_amx = pairs_fit && amx_available();
    const bool by_pairs = by_amx || (pairs_fit && !pairs_by_fma());
    uint32_t *kt2 = reinterpret_cast<uint32_t *>(kt), *q2 = reinterpret_cast<uint32_t *>(qf);
    uint32_t *vt2 = reinterpret_cast<uint32_t *>(run_sum + nqmax);
    uint16_t *pb = reinterpret_cast<uint16_t *>(vt2 + (c->maxctx + 32L) / 2 * D);
    amx::TileConfig tiles;
    if (by_amx)
        amx::configure_attention(tiles);
#endif
    for (long it = begin; it < end; it++) {
        const Item &item = c->items[it];
        const int32_t *sp = c->spans + 4L * item.span;
        const int q_start = sp[0], q_len = sp[1], ctx = sp[2];
        const int64_t *slots = c->slots + sp[3];
        const int prefix = ctx - q_len, kstride = (ctx + 15) / 16 * 16;
        const C *kh = c->k + static_cast<long>(item.kh) * D;
        int ready = 0;  // keys [0, ready) are in kt ([D][kstride], float32)
        [[maybe_unused]] int vready = 0;  // on AMX tiles: values [0, vready) in vt2
        for (int r0 = item.r0; r0 < item.r1; r0 += R) {
            const int nrows = std::min(R, q_len - r0), nq = nrows * G;
            auto row_len = [&](int r) { return prefix + r0 + r + 1; };  // keys row r sees
            auto row_start = [&](int r) {
                const int len = row_len(r);
                return c->window > 0 && len > c->window ? len - c->window : 0;
            };
            const int lo = row_start(0) / 16 * 16, n = row_len(nrows - 1);
            const int npad = (n - lo + 15) / 16 * 16;
            for (; ready < (n + 15) / 16 * 16; ready += W) {  // whole 16s, zeros past ctx
                const C *rows[W];
                for (int j = 0; j < W; j++)
                    rows[j] = ready + j < ctx ? kh + slots[ready + j] * tok : nullptr;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                if constexpr (pair_types)
                    if (by_pairs) {
                        transpose_key_pairs(rows, D, kt2 + ready, kstride);
                        continue;
                    }
#endif
                transpose_keys(rows, D, kt + ready, kstride);
            }
#if defined(__AVX512F__) && defined(__AVX512BW__)
            for (; by_amx && vready < (n + 31) / 32 * 32; vready += 32) {
                const bf16 *rows[32];
                for (int j = 0; j < 32; j++)
                    rows[j] = vready + j < ctx ? reinterpret_cast<const bf16 *>(c->v) +
                                                     item.kh * D + slots[vready + j] * tok
                                               : nullptr;
                amx::value_pairs(rows, D, vt2 + static_cast<long>(vready) / 2 * D);
            }
#endif
            for (int r = 0; r < nrows; r++) {  // query i = row i / G, head i % G, in float32
                const T *qr = c->q + (q_start + r0 + r) * c->q_stride +
                              static_cast<long>(item.kh) * G * D;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                if constexpr (pair_types)
                    if (by_pairs) {
                        const uint16_t *qu = reinterpret_cast<const uint16_t *>(qr);
                        uint32_t *qp = q2 + static_cast<long>(r) * G * D / 2;
                        for (long p = 0; p < static_cast<long>(G) * D / 2; p++)
                            qp[p] = pairs::pair_at(qu, p);
                        continue;
                    }
#endif
                convert(qr, qf + static_cast<long>(r) * G * D, static_cast<long>(G) * D);
            }
            bool scored = false;
#if defined(__AVX512F__) && defined(__AVX512BW__)
            if (by_amx)
                amx::scores(q2, kt2, kstride, s, npad, D, nq, lo, npad, c->scale);
            else if (by_pairs)
                scores_pairs(q2, kt2 + lo, kstride, s, D, npad, c->scale, nq);
            scored = by_pairs;
#endif
            if (!scored)
                scores_tile(qf, kt + lo, kstride, s, D, npad, c->scale, nq);
            std::memset(acc, 0, sizeof(float) * static_cast<size_t>(tile_queries(nq)) * D);
            for (int q = 0; q < nq; q++) { run_max[q] = -INFINITY; run_sum[q] = 0.f; }
            // Chunk by chunk (a query's later chunks rescale what its earlier ones summed),
            // groups of PV_GROUP queries sharing the value rows (on AMX tiles, all of them).
            const int group = by_amx ? nq : PV_GROUP;
            for (int c0 = lo / TORCH_CHUNK * TORCH_CHUNK; c0 < n; c0 += TORCH_CHUNK) {
                const int c1 = c0 + TORCH_CHUNK < ctx ? c0 + TORCH_CHUNK : ctx;
                for (int g0 = 0; g0 < nq; g0 += group) {
                    const int g1 = g0 + group < nq ? g0 + group : nq;
                    int t0 = c1, t1 = c0;  // the keys of this chunk any query of the group sees
                    for (int q = g0; q < g1; q++) {
                        const int r = q / G, len = row_len(r), st = row_start(r);
                        const int vis = c0 > st ? c0 : st, e = c1 < len ? c1 : len;
                        float *sq = s + static_cast<long>(q) * npad;
                        if (vis < e) {
                            chunk_softmax<!std::is_same_v<T, float>>(
                                sq, lo, c0, c1, vis, e, run_max[q], run_sum[q],
                                acc + static_cast<long>(q) * D, D,
                                c0 <= st / TORCH_CHUNK * TORCH_CHUNK);
                            t0 = vis < t0 ? vis : t0;
                            t1 = e > t1 ? e : t1;
                        }
                        // zeros where this query does not see a key the group reads
                        const int z0 = c0 > lo ? c0 : lo, z1 = c1 < n ? c1 : n;
                        if (vis < e) {
                            zero(sq, z0 - lo, vis - lo);
                            zero(sq, e - lo, z1 - lo);
                        } else {
                            zero(sq, z0 - lo, z1 - lo);
                        }
                    }
                    if (t0 >= t1) continue;
                    const C *vh = c->v + static_cast<long>(item.kh) * D;
#if defined(__AVX512F__) && defined(__AVX512BW__)
                    if (by_amx) {
                        amx_pv(s, npad, lo, t0, t1, pb, vt2, acc, D, nq);
                        continue;
                    }
                    if constexpr (pair_types)
                        if (by_pairs) {
                            const float *sg = s + static_cast<long>(g0) * npad;
                            float *ag = acc + static_cast<long>(g0) * D;
                            (D == 64 ? pv_pairs<64> : pv_pairs<128>)(vh, slots, tok, sg, npad,
                                                                     lo, t0, t1, ag, g1 - g0);
                            continue;
                        }
#endif
                    pv_tile(vh, slots, tok, s, npad, lo, t0, t1, acc, g0, g1, D);
                }
            }
            for (int q = 0; q < nq; q++) {  // out = acc / sum
                const int r = q / G, h = item.kh * G + q % G;
                const float inv = 1.f / run_sum[q];
                const float *aq = acc + static_cast<long>(q) * D;
                T *o = c->out + (static_cast<long>(q_start + r0 + r) * H + h) * D;
                #pragma omp simd
                for (int d = 0; d < D; d++) o[d] = from_f32<T>(aq[d] * inv);
            }
        }
    }
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (by_amx)
        amx::release();
#endif
}

}  // namespace

int prefill_rows_per_tile(int H, int KVH)
{
    // About 32 queries per tile, a whole number of QK groups (rows * G a multiple of it).
    const int G = H / KVH, step = QK_GROUP / std::gcd(G, QK_GROUP);
    return std::max(step, 32 / G / step * step);
}

long prefill_attention_scratch(int H, int KVH, int D, int maxctx, int nthreads)
{
    // as prefill_body lays it out: q, K^T, scores, sums, softmax max and sum; the values by
    // pairs and P in bf16 for AMX tiles
    const long nq = tile_queries(prefill_rows_per_tile(H, KVH) * (H / KVH));
    const long np = maxctx + 16L;
    const long per = nq * D + static_cast<long>(D) * np + nq * np + nq * D + 2 * nq +
                     (maxctx + 32L) / 2 * D + nq * TORCH_CHUNK / 2;
    return per * (nthreads > 0 ? nthreads : 1);
}

template <class T, class C>
void prefill_attention(const T *q, long q_stride, const C *k, const C *v, const int32_t *spans,
                       int S, const int64_t *slots, T *out, int H, int KVH, int D, int window,
                       float scale, int maxctx, float *scratch, int nthreads)
{
    const int rows = prefill_rows_per_tile(H, KVH);
    // One item per (span, KV head) shares its K transposition across all of the span's rows;
    // where that leaves fewer than 4 items per thread (one long prompt, few KV heads, many
    // cores), spans of 256 rows or more split into row ranges of about equal work (causal:
    // later rows see more keys; at least 128 rows each: shorter ranges measured slower than
    // none), each transposing the keys it reaches. A query's result does not depend on the
    // split.
    const int parts_wanted = std::max(1, (4 * nthreads + S * KVH - 1) / (S * KVH));
    auto work = [&](int sp, long r) {  // keys seen by rows [0, r) of span sp
        const long prefix = spans[4 * sp + 2] - spans[4 * sp + 1];
        return r * prefix + r * (r + 1) / 2;
    };
    std::vector<Item> items;
    for (int sp = 0; sp < S; sp++) {
        const int ql = spans[4 * sp + 1];
        const int parts = std::max(1, std::min(parts_wanted, ql / 128));
        const long total = work(sp, ql);
        int r0 = 0;
        for (int part = 1; part <= parts && r0 < ql; part++) {
            int r1 = r0;  // whole tiles up to this part's share of the work
            while (r1 < ql && (part == parts || work(sp, r1) * parts < total * part))
                r1 = std::min(r1 + rows, ql);
            for (int kh = 0; kh < KVH; kh++) items.push_back({sp, kh, r0, r1});
            r0 = r1;
        }
    }
    // Most work first: a late long item would leave the other threads idle.
    auto cost = [&](const Item &a) { return work(a.span, a.r1) - work(a.span, a.r0); };
    std::stable_sort(items.begin(), items.end(),
                     [&](const Item &a, const Item &b) { return cost(a) > cost(b); });
    PrefillCtx<T, C> c{};
    c.q = q;
    c.k = k;
    c.v = v;
    c.spans = spans;
    c.slots = slots;
    c.items = items.data();
    c.out = out;
    c.scratch = scratch;
    c.scale = scale;
    c.q_stride = q_stride;
    c.scratch_per = prefill_attention_scratch(H, KVH, D, maxctx, 1);
    c.H = H;
    c.KVH = KVH;
    c.D = D;
    c.window = window;
    c.rows_per_tile = rows;
    c.maxctx = maxctx;
    parallel_run(nthreads, prefill_body<T, C>, &c, static_cast<long>(items.size()), 1, false);
}

#define FLEETLLM_PREFILL(T, C)                                                                \
    template void prefill_attention<T, C>(const T *, long, const C *, const C *,              \
                                          const int32_t *, int, const int64_t *, T *, int,    \
                                          int, int, int, float, int, float *, int);
FLEETLLM_PREFILL(float, float)
FLEETLLM_PREFILL(float, bf16)
FLEETLLM_PREFILL(bf16, float)
FLEETLLM_PREFILL(bf16, bf16)

}  // namespace fleetllm::kernels
