"""The C source of fleetllm's CPU kernels, part 2: the operations (after cpu_kernels_src's
RUNTIME: the thread pool `pool_run`, `exp_f32`). Every entry point takes the thread count."""

OPS = r"""
#define PAR_MIN 32768  /* elements below which an op runs on the calling thread alone */
#define SPIN_ROWS 4    /* up to this many rows (a small decode batch) the pool stays awake */

/* ---------------------------------------------------------------- paged decode attention
   One query per sequence over its context, read in place from the KV blocks. One work item
   is (sequence, group of KV heads); D is a literal in the specialized calls, so the inner
   loops vectorize with known trip counts. */
static inline __attribute__((always_inline)) void decode_item(
    const float *q, const float *k, const float *v, const int32_t *table,
    int start, int len, int kh0, int nkv, float *out, int H, int KVH, const int D, int bs,
    float scale, float *scores, float *acc)
{
    const int G = H / KVH, nh = nkv * G;
    const long tok = (long)KVH * D;          /* floats per token slot in a block */
    const int b0 = start / bs, b1 = (len + bs - 1) / bs;
    const int n = (b1 - b0) * bs;            /* whole blocks; the ends are masked */
    const int lo = start - b0 * bs, hi = len - b0 * bs;
    const float *qb = q + (long)kh0 * G * D;
    for (int blk = b0; blk < b1; blk++) {    /* scores = q . K, block by block */
        const float *kb = k + (long)table[blk] * bs * tok + (long)kh0 * D;
        const int base = (blk - b0) * bs;
        for (int o = 0; o < bs; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *kp = kb + o * tok + (long)kh * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float *qh = qb + (long)h * D;
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int d = 0; d < D; d++) s += qh[d] * kp[d];
                    scores[(long)h * n + base + o] = s * scale;
                }
            }
        }
    }
    for (int h = 0; h < nh; h++) {            /* softmax over the visible positions */
        float *sh = scores + (long)h * n;
        float m = -INFINITY, sum = 0.f;
        for (int t = lo; t < hi; t++) m = sh[t] > m ? sh[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int t = lo; t < hi; t++) { const float e = exp_f32(sh[t] - m); sh[t] = e; sum += e; }
        const float inv = 1.f / sum;
        #pragma omp simd
        for (int t = lo; t < hi; t++) sh[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)nh * D);
    for (int blk = b0; blk < b1; blk++) {    /* out = P . V */
        const float *vb = v + (long)table[blk] * bs * tok + (long)kh0 * D;
        const int base = (blk - b0) * bs;
        const int o0 = base < lo ? lo - base : 0;
        const int o1 = base + bs <= hi ? bs : hi - base;
        for (int o = o0; o < o1; o++) {
            for (int kh = 0; kh < nkv; kh++) {
                const float *vp = vb + o * tok + (long)kh * D;
                for (int g = 0; g < G; g++) {
                    const int h = kh * G + g;
                    const float w = scores[(long)h * n + base + o];
                    float *ah = acc + (long)h * D;
                    #pragma omp simd
                    for (int d = 0; d < D; d++) ah[d] += w * vp[d];
                }
            }
        }
    }
    memcpy(out + (long)kh0 * G * D, acc, sizeof(float) * (size_t)nh * D);
}

typedef struct {
    const float *q, *k, *v;
    long q_stride, scratch_per;
    const int32_t *tables, *table_start, *ctx_lens;
    float *out, *scratch, scale;
    int H, KVH, D, bs, window, split, nkv, maxlen;
} decode_ctx;

static void decode_body(void *arg, long begin, long end, int tid)
{
    const decode_ctx *c = arg;
    float *scores = c->scratch + tid * c->scratch_per;
    float *acc = scores + (long)c->H * (c->maxlen + 2 * c->bs);
    for (long item = begin; item < end; item++) {
        const int b = item / c->split, kh0 = (item % c->split) * c->nkv, len = c->ctx_lens[b];
        const int start = c->window > 0 && len > c->window ? len - c->window : 0;
        const float *qb = c->q + (long)b * c->q_stride;
        float *ob = c->out + (long)b * c->H * c->D;
        const int32_t *table = c->tables + c->table_start[b];
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

/* q: B rows of H*D floats, q_stride floats apart; out: [B, H, D] contiguous; k, v: one
   layer's [num_blocks, bs, KVH, D] caches; seq b's blocks are tables[table_start[b]...],
   it attends to positions [max(0, len - window), len) (window <= 0: all). */
void paged_decode_f32(const float *q, long q_stride, const float *k, const float *v,
                      const int32_t *tables, const int32_t *table_start,
                      const int32_t *ctx_lens, float *out, int B, int H, int KVH, int D,
                      int bs, int window, float scale, int nthreads)
{
    decode_ctx c = {.q = q, .k = k, .v = v, .q_stride = q_stride, .tables = tables,
                    .table_start = table_start, .ctx_lens = ctx_lens, .out = out,
                    .scale = scale, .H = H, .KVH = KVH, .D = D, .bs = bs, .window = window};
    for (int b = 0; b < B; b++) c.maxlen = ctx_lens[b] > c.maxlen ? ctx_lens[b] : c.maxlen;
    /* Whole sequences per item read whole token rows (better prefetching); a small batch
       splits by KV head so that every thread has work. */
    c.split = B >= 4 * nthreads ? 1 : KVH;
    c.nkv = KVH / c.split;
    c.scratch_per = (long)H * (c.maxlen + 2 * bs) + (long)H * D;
    c.scratch = malloc(sizeof(float) * (size_t)c.scratch_per * (nthreads > 0 ? nthreads : 1));
    pool_run(nthreads, decode_body, &c, (long)B * c.split, 1, B <= SPIN_ROWS);
    free(c.scratch);
}

/* ------------------------------------------------------------------ fused elementwise ops
   One pass over the data instead of several torch kernels and their temporaries. */

typedef struct {
    const float *x, *w, *cos, *sin, *qkv;
    float *residual, *out, *q_out, *k_out, *k_cache, *v_cache;
    const int64_t *slots;
    long row_stride;
    int H, I, KVH, D;
    float eps;
} rows_ctx;

static void rmsnorm_body(void *arg, long begin, long end, int tid)
{
    const rows_ctx *c = arg;
    const int H = c->H;
    for (long t = begin; t < end; t++) {
        const float *xr = c->x + t * H;
        float *r = c->residual ? c->residual + t * H : (float *)xr;
        float ss = 0.f;
        if (c->residual) {
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) { const float v = xr[i] + r[i]; r[i] = v; ss += v * v; }
        } else {
            #pragma omp simd reduction(+:ss)
            for (int i = 0; i < H; i++) ss += r[i] * r[i];
        }
        const float inv = 1.f / sqrtf(ss / H + c->eps);
        float *o = c->out + t * H;
        #pragma omp simd
        for (int i = 0; i < H; i++) o[i] = (r[i] * inv) * c->w[i];
    }
}

/* residual (if not NULL) += x, in place; out = rmsnorm(residual or x) * w. [T, H] rows. */
void add_rmsnorm_f32(const float *x, float *residual, const float *w, float *out, int T,
                     int H, float eps, int nthreads)
{
    rows_ctx c = {.x = x, .residual = residual, .w = w, .out = out, .H = H, .eps = eps};
    pool_run(nthreads, rmsnorm_body, &c, T, 1 + PAR_MIN / H, T <= SPIN_ROWS);
}

static void silu_body(void *arg, long begin, long end, int tid)
{
    const rows_ctx *c = arg;
    const int I = c->I;
    for (long t = begin; t < end; t++) {
        const float *g = c->x + t * 2 * I, *u = g + I;
        float *o = c->out + t * I;
        #pragma omp simd
        for (int i = 0; i < I; i++) o[i] = g[i] / (1.f + exp_f32(-g[i])) * u[i];
    }
}

/* out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: [T, 2I], out: [T, I]. */
void silu_mul_f32(const float *gu, float *out, int T, int I, int nthreads)
{
    rows_ctx c = {.x = gu, .out = out, .I = I};
    pool_run(nthreads, silu_body, &c, T, 1 + PAR_MIN / I, T <= SPIN_ROWS);
}

static inline void rope_row(const float *x, float *o, const float *c, const float *s, int half)
{
    #pragma omp simd
    for (int i = 0; i < half; i++) {
        o[i] = x[i] * c[i] - x[i + half] * s[i];
        o[i + half] = x[i + half] * c[i] + x[i] * s[i];
    }
}

static void rope_body(void *arg, long begin, long end, int tid)
{
    const rows_ctx *c = arg;
    const int H = c->H, KVH = c->KVH, D = c->D, half = D / 2;
    for (long t = begin; t < end; t++) {
        const float *row = c->qkv + t * c->row_stride;
        const float *cs = c->cos + t * half, *sn = c->sin + t * half;
        for (int h = 0; h < H; h++)
            rope_row(row + (long)h * D, c->q_out + (t * H + h) * D, cs, sn, half);
        float *ko = c->k_out + t * KVH * D;
        for (int h = 0; h < KVH; h++)
            rope_row(row + (long)(H + h) * D, ko + (long)h * D, cs, sn, half);
        if (c->k_cache) {
            const long slot = c->slots[t] * KVH * D;
            memcpy(c->k_cache + slot, ko, sizeof(float) * (size_t)KVH * D);
            memcpy(c->v_cache + slot, row + (long)(H + KVH) * D,
                   sizeof(float) * (size_t)KVH * D);
        }
    }
}

/* Neox RoPE of q and k from the fused qkv rows ([T] rows of (H + 2 KVH) * D floats, row_stride
   apart): q -> q_out [T, H, D], k -> k_out [T, KVH, D]; with caches, k (rotated) and v are
   also written at each token's slot of the [num_slots, KVH, D] caches. cos, sin: [T, D/2]. */
void rope_qk_kv_f32(const float *qkv, long row_stride, const float *cos, const float *sin,
                    float *q_out, float *k_out, float *k_cache, float *v_cache,
                    const int64_t *slots, int T, int H, int KVH, int D, int nthreads)
{
    rows_ctx c = {.qkv = qkv, .row_stride = row_stride, .cos = cos, .sin = sin,
                  .q_out = q_out, .k_out = k_out, .k_cache = k_cache, .v_cache = v_cache,
                  .slots = slots, .H = H, .KVH = KVH, .D = D};
    pool_run(nthreads, rope_body, &c, T, 1 + PAR_MIN / ((H + 2 * KVH) * D), T <= SPIN_ROWS);
}

/* ------------------------------------------------------------------------- small-M GEMV
   y[m, n] = x[m, :] . w[n, :] (+ bias[n]) for a few rows m: each weight row is streamed once
   per 4 rows of x, 4 weight rows at a time (16 independent FMA chains). Memory-bound: it
   runs at the machine's read bandwidth where a GEMM library re-packs or underuses it. */
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4)));

#define GEMV_TILE(MT)                                                                        \
static void gemv_tile_##MT(const float *x, const float *w, const float *bias, float *y,     \
                           long n0, int N, int K)                                            \
{                                                                                            \
    v16 acc[4][MT];                                                                          \
    memset(acc, 0, sizeof(acc));                                                             \
    const int rows = N - n0 < 4 ? N - n0 : 4, kv = K & ~15;                                  \
    const float *wr[4];                                                                      \
    for (int r = 0; r < 4; r++) wr[r] = w + (n0 + (r < rows ? r : 0)) * K;                    \
    for (int k = 0; k < kv; k += 16) {                                                       \
        v16 xv[MT];                                                                          \
        for (int m = 0; m < MT; m++) xv[m] = *(const v16u *)(x + (long)m * K + k);          \
        for (int r = 0; r < 4; r++) {                                                        \
            const v16 wv = *(const v16u *)(wr[r] + k);                                       \
            for (int m = 0; m < MT; m++) acc[r][m] += xv[m] * wv;                            \
        }                                                                                    \
    }                                                                                        \
    for (int r = 0; r < rows; r++)                                                           \
        for (int m = 0; m < MT; m++) {                                                       \
            float s = bias ? bias[n0 + r] : 0.f;                                             \
            for (int i = 0; i < 16; i++) s += acc[r][m][i];                                  \
            for (int k = kv; k < K; k++) s += x[(long)m * K + k] * wr[r][k];                 \
            y[(long)m * N + n0 + r] = s;                                                     \
        }                                                                                    \
}
GEMV_TILE(1)
GEMV_TILE(2)
GEMV_TILE(3)
GEMV_TILE(4)

typedef struct {
    const float *x, *w, *bias;
    float *y;
    int mt, N, K;
} gemv_ctx;

static void gemv_body(void *arg, long begin, long end, int tid)
{
    const gemv_ctx *c = arg;
    for (long tile = begin; tile < end; tile++) {
        const long n0 = tile * 4;
        switch (c->mt) {
        case 1: gemv_tile_1(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        case 2: gemv_tile_2(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        case 3: gemv_tile_3(c->x, c->w, c->bias, c->y, n0, c->N, c->K); break;
        default: gemv_tile_4(c->x, c->w, c->bias, c->y, n0, c->N, c->K);
        }
    }
}

/* x: [M, K], w: [N, K], y: [M, N], all contiguous; bias may be NULL. */
void gemv_f32(const float *x, const float *w, const float *bias, float *y, int M, int N, int K,
              int nthreads)
{
    const long tiles = (N + 3) / 4;
    /* ~4 chunks per thread: long sequential streams, some balance; inline if small */
    const long chunk = (long)N * K < 4 * PAR_MIN ? tiles
                       : 1 + tiles / (4 * (nthreads > 0 ? nthreads : 1));
    for (int m0 = 0; m0 < M; m0 += 4) {
        gemv_ctx c = {.x = x + (long)m0 * K, .w = w, .bias = bias, .y = y + (long)m0 * N,
                      .mt = M - m0 < 4 ? M - m0 : 4, .N = N, .K = K};
        pool_run(nthreads, gemv_body, &c, tiles, chunk, 1);
    }
}

/* ------------------------------------------------------------ a whole small-batch layer
   One decoder layer of a decode step of a few sequences (one new token each), no tensor
   parallelism: the ops above in sequence, called from C so that the step costs one Python
   call per layer instead of ~10 kernel calls, their tensors and their glue (about 3 of the
   21 ms of a batch-1 step on the 125M preset). x: the layer input [T, hid]; residual: in/out
   (first: x is copied into it, as the model's first layer does); out: [T, hid]. Biases may
   be NULL. */
void decoder_layer_f32(
    const float *x, float *residual, int first, float *out, const float *w_in,
    const float *w_post, float eps, const float *w_qkv, const float *b_qkv, const float *w_o,
    const float *b_o, const float *w_gu, const float *b_gu, const float *w_down,
    const float *b_down, const float *cos, const float *sin, float *k_cache, float *v_cache,
    const int64_t *slots, const int32_t *tables, const int32_t *table_start,
    const int32_t *ctx_lens, int T, int hid, int H, int KVH, int D, int I, int bs, int window,
    float scale, int nthreads)
{
    const int qkv_dim = (H + 2 * KVH) * D;
    float *normed = malloc(sizeof(float) * (size_t)T *
                           (2 * hid + qkv_dim + 2 * H * D + KVH * D + 3 * I));
    float *qkv = normed + (long)T * hid, *q = qkv + (long)T * qkv_dim;
    float *k = q + (long)T * H * D, *att = k + (long)T * KVH * D, *o = att + (long)T * H * D;
    float *gu = o + (long)T * hid, *act = gu + (long)T * 2 * I;
    if (first) {
        memcpy(residual, x, sizeof(float) * (size_t)T * hid);
        add_rmsnorm_f32(residual, NULL, w_in, normed, T, hid, eps, nthreads);
    } else {
        add_rmsnorm_f32(x, residual, w_in, normed, T, hid, eps, nthreads);
    }
    gemv_f32(normed, w_qkv, b_qkv, qkv, T, qkv_dim, hid, nthreads);
    rope_qk_kv_f32(qkv, qkv_dim, cos, sin, q, k, k_cache, v_cache, slots, T, H, KVH, D,
                   nthreads);
    paged_decode_f32(q, (long)H * D, k_cache, v_cache, tables, table_start, ctx_lens, att, T,
                     H, KVH, D, bs, window, scale, nthreads);
    gemv_f32(att, w_o, b_o, o, T, hid, H * D, nthreads);
    add_rmsnorm_f32(o, residual, w_post, normed, T, hid, eps, nthreads);
    gemv_f32(normed, w_gu, b_gu, gu, T, 2 * I, hid, nthreads);
    silu_mul_f32(gu, act, T, I, nthreads);
    gemv_f32(act, w_down, b_down, out, T, hid, I, nthreads);
    free(normed);
}
"""
