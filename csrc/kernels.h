// The CPU kernels on raw buffers (paged_decode.cpp, fused_ops.cpp, gemv.cpp, ...), in
// float32 or bfloat16 storage with float32 math. Nothing here checks its arguments or
// allocates: ops.cpp checks every tensor against the op's schema and shapes and allocates
// outputs and scratch with at::empty (so an allocation failure is a c10 error, not a null
// pointer), then calls these.
//
// Templates: T is the activations' and weights' storage type, C the KV cache's (float or
// bf16; ops.cpp instantiates every pair). In bfloat16 every kernel rounds where the
// PyTorch/transformers modules it replaces round (after each elementwise op, once after a
// matmul's float32 sum), so a bf16 model gives the same tokens through either; in float32
// the rounding steps are no-ops and the kernels are the float32 kernels they always were.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace fleetllm::kernels {

// Whether the kernels use AVX-512 BF16's dot product of bf16 pairs (vdpbf16ps: the GEMV's bf16
// tile, decode attention's P . V): where the CPU has it (the avx512 variant also runs on
// AVX-512 CPUs without it, such as Ice Lake), unless FLEETLLM_CPU_BF16_DOT=0, which runs
// those CPUs' paths here (tests compare the two).
extern const bool bf16_dot;

// A bfloat16 as stored: the top 16 bits of a float32. A type of its own (not uint16_t), so
// that templates and overloads tell it apart from integers.
enum class bf16 : uint16_t {};

inline float to_f32(float x) { return x; }
inline float to_f32(bf16 x)
{
    return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16);
}

// Round to nearest even, as torch does (a NaN stays a quiet NaN).
template <class T> T from_f32(float x);
template <> inline float from_f32<float>(float x) { return x; }
template <> inline bf16 from_f32<bf16>(float x)
{
    const uint32_t u = __builtin_bit_cast(uint32_t, x);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return static_cast<bf16>(x != x ? 0x7FC0u : r);
}

// x rounded to T's precision, as a float: an intermediate result a T model stores.
template <class T> inline float round_to(float x) { return to_f32(from_f32<T>(x)); }

// Sizes at which work is split: below PAR_MIN elements an op runs on the calling thread alone
// (waking threads costs more); up to SPIN_ROWS rows (a small decode batch) the pool stays
// awake after a call, because the step's next kernel follows within microseconds.
constexpr long PAR_MIN = 32768;
constexpr int SPIN_ROWS = 4;

// The decode batch: seq b's blocks are tables[table_start[b]...], it attends to positions
// [max(0, len - window), len) of its context (window <= 0: all); maxlen: the largest len.
struct DecodeBatch {
    const int32_t *tables, *table_start, *ctx_lens;
    int maxlen;
};

// Floats of scratch paged_decode needs: per thread, scores of H heads over the longest
// context (plus a block at each end), an H x D accumulator, the query in float32 and the
// heads' softmax sums.
long paged_decode_scratch(int H, int D, int bs, int maxlen, int nthreads);

// out[b] = attention of q[b] (H heads of D; rows q_stride elements apart) over sequence b's
// context, read in place from one layer's k and v caches [num_blocks, bs, KVH, D].
// out: [B, H, D] contiguous.
template <class T, class C>
void paged_decode(const T *q, long q_stride, const C *k, const C *v, const DecodeBatch &batch,
                  T *out, int B, int H, int KVH, int D, int bs, int window, float scale,
                  float *scratch, int nthreads);

// Prefill attention over the paged cache (prefill_attention.cpp). spans: S rows of (q_start,
// q_len, ctx_len, slot_start): the span's queries are rows q_start.. of q / out, its context's
// ctx_len tokens (a cached prefix, then the span's own) sit at slots[slot_start..]; query i of
// the span sees the keys (ctx_len - q_len + i - window, ctx_len - q_len + i]. maxctx: the longest
// ctx_len.
int prefill_rows_per_tile(int H, int KVH);
long prefill_attention_scratch(int H, int KVH, int D, int maxctx, int nthreads);
template <class T, class C>
void prefill_attention(const T *q, long q_stride, const C *k, const C *v, const int32_t *spans,
                       int S, const int64_t *slots, T *out, int H, int KVH, int D, int window,
                       float scale, int maxctx, float *scratch, int nthreads);

// residual (if not null) += x, in place; out = rmsnorm(residual or x) * w. [T, H] rows.
template <class T>
void add_rmsnorm(const T *x, T *residual, const T *w, T *out, int rows, int H, float eps,
                 int nthreads);

// out[t, i] = silu(gu[t, i]) * gu[t, I + i]; gu: [T, 2I], out: [T, I].
template <class T>
void silu_mul(const T *gu, T *out, int rows, int I, int nthreads);

// out[r] = the index of row r's largest value, as torch.argmax (argmax.cpp): the first of equal
// maxima, the first NaN of a row with one. x: [rows, n], rows `stride` elements apart.
template <class T>
void argmax(const T *x, long stride, int rows, int n, int64_t *out, int nthreads);

// Neox RoPE of q and k from the fused qkv rows ([T] rows of (H + 2 KVH) * D, row_stride
// apart): q -> q_out [T, H, D], k -> k_out [T, KVH, D]; with caches (not null), k (rotated)
// and v are also written at each token's slot of the [num_slots, KVH, D] caches. cos, sin:
// [T, D/2].
template <class T, class C>
void rope_qk_kv(const T *qkv, long row_stride, const T *cos, const T *sin, T *q_out, T *k_out,
                C *k_cache, C *v_cache, const int64_t *slots, int rows, int H, int KVH, int D,
                int nthreads);

// y = x @ w^T (+ bias): x [M, K], w [N, K], y [M, N], all contiguous; bias may be null.
// xf: M * K floats of scratch (a bfloat16 x widened once per call).
template <class T>
void gemv(const T *x, const T *w, const T *bias, T *y, int M, int N, int K, float *xf,
          int nthreads);

// Outputs per panel of a weight packed by pairs (model/linear_kernels.py, Pairs.PANEL).
constexpr int PAIR_PANEL = 48;

// y = x @ w^T (+ bias) from w packed by pairs ([ceil(N/48)][K/2][48][2], gemm.cpp) on any
// AVX-512 or AVX2 CPU; false (nothing done) in the portable build or where K is odd.
bool gemm_pairs(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int M, int N, int K,
                int nthreads);
// Whether the compute-bound bf16 kernels (gemm_pairs, prompt attention) make their sums of bf16
// pairs with FMAs rather than vdpbf16ps: CPUs without AVX-512 BF16, and those that run it at
// half their FMAs' rate (the same bits; gemm.cpp).
bool pairs_by_fma();

// y = x @ w^T (+ bias) on AMX tiles from w packed for them ([N/32][K/32][2][16][32], see
// model/linear_kernels.py, Amx; gemm_amx.cpp), N and K multiples of 32; false (nothing done) where the
// CPU or the OS gives no AMX.
bool gemm_amx(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int M, int N, int K,
              int nthreads);
bool amx_available();

// MKL's packed sgemm (mkl_sgemm.cpp): float32 y = x @ w^T from w [n, k] packed once by
// mkl_pack into mkl_pack_bytes(n, k) bytes; accumulate: y holds the bias rows and gets the
// product added (beta 1, as F.linear's addmm). Available where torch links MKL and the CPU
// is Intel's.
bool mkl_packed_available();
size_t mkl_pack_bytes(int n, int k);
void mkl_pack(const float *w, int n, int k, void *dest);
void mkl_compute(const float *x, int m, int n, int k, const void *packed, float *y,
                 bool accumulate);

// A projection run by the caller instead of the GEMV kernel: x @ W^T (+ bias) for the layer's
// projection `which` (0 qkv, 1 o, 2 gate_up, 3 down), in the layer's dtype; returns where the
// result is, valid until the layer's call returns (no copy into the layer's buffers).
using ProjectFn = const void *(*)(void *ctx, int which, const void *x);

// One of the kernels' GEMMs on a packed weight: gemm_pairs or gemm_amx.
using PackedGemm = bool (*)(const bf16 *x, const bf16 *wp, const bf16 *bias, bf16 *y, int M,
                            int N, int K, int nthreads);

// One decoder layer's weights (contiguous; biases may be null). project: null for the GEMV
// kernel or the kernels' packed GEMMs, else the caller's projections (ops.cpp: oneDNN's packed
// matmul, for batches past the kernel's row limit).
template <class T>
struct LayerWeights {
    const T *w_in, *w_post, *w_qkv, *b_qkv, *w_o, *b_o, *w_gu, *b_gu, *w_down, *b_down;
    float eps;
    ProjectFn project = nullptr;
    void *project_ctx = nullptr;
    // The four projections packed for one of the kernels' GEMMs (bf16 only), or nulls, and
    // that GEMM: by pairs (gemm_pairs) or for AMX tiles (gemm_amx).
    const bf16 *packed[4] = {};
    PackedGemm gemm = gemm_pairs;
};

struct LayerDims {
    int T, hid, H, KVH, D, I, bs, window;
    float scale;
};

// Floats of work space decoder_layer needs (its activations, then paged_decode's scratch).
long decoder_layer_work(const LayerDims &d, int maxlen, int nthreads);

// One decoder layer of a decode step of a few sequences (one new token each), no tensor
// parallelism: the kernels above in sequence. x: the layer input [T, hid]; residual: in/out
// (first: x is copied into it, as the model's first layer does); out: [T, hid].
template <class T, class C>
void decoder_layer(const T *x, T *residual, bool first, T *out, const LayerWeights<T> &w,
                   const LayerDims &d, const T *cos, const T *sin, C *k_cache, C *v_cache,
                   const int64_t *slots, const DecodeBatch &batch, float *work, int nthreads);

// 16 floats as one vector (GCC's vector extension: one AVX-512 register, two AVX2 ones),
// loaded from float or bf16 memory. may_alias: the vector loads read float and bf16 arrays.
// (Vectors pass by reference: a 64-byte vector argument or return value would change the ABI
// of the portable and avx2 builds, which -Wpsabi rejects.)
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef uint16_t h16u __attribute__((vector_size(32), aligned(2), may_alias));
typedef uint32_t u16x32 __attribute__((vector_size(64)));

inline void load16(const float *p, v16 &out) { out = *reinterpret_cast<const v16u *>(p); }
inline void load16(const bf16 *p, v16 &out)
{
#if defined(__AVX512F__)  // one widening load and a shift (GCC splits the generic form)
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(p)));
    out = __builtin_bit_cast(v16, _mm512_slli_epi32(w, 16));
#else
    const h16u h = *reinterpret_cast<const h16u *>(p);
    out = __builtin_bit_cast(v16, __builtin_convertvector(h, u16x32) << 16);
#endif
}

// 8 floats as one vector: one AVX2 register. Builds without AVX-512 use it where a v16 kernel
// would keep several accumulators: GCC splits each v16 into two ymm halves but then spills
// them to the stack on every iteration (seen in the avx2 GEMV: 10 GB/s instead of the memory's
// 14-20).
typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t h8u __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint32_t u8x32 __attribute__((vector_size(32)));

inline void load8(const float *p, v8 &out) { out = *reinterpret_cast<const v8u *>(p); }
inline void load8(const bf16 *p, v8 &out)
{
#if defined(__AVX2__)
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(p)));
    out = __builtin_bit_cast(v8, _mm256_slli_epi32(w, 16));
#else
    const h8u h = *reinterpret_cast<const h8u *>(p);
    out = __builtin_bit_cast(v8, __builtin_convertvector(h, u8x32) << 16);
#endif
}

// The build's own float vector, one register: v16 with AVX-512, v8 with AVX2 (a v16 there is
// two ymm registers, which GCC runs through the stack where a loop keeps several), a generic
// v16 otherwise; its unaligned, unsigned and uint16_t companions and loader.
#if defined(__AVX2__) && !defined(__AVX512F__)
typedef v8 vec;
typedef v8u vecu;
typedef u8x32 vec_u32;
typedef h8u vec_h16;
constexpr int VEC_LANES = 8;
inline void loadv(const float *p, vec &o) { load8(p, o); }
inline void loadv(const bf16 *p, vec &o) { load8(p, o); }
#else
typedef v16 vec;
typedef v16u vecu;
typedef u16x32 vec_u32;
typedef h16u vec_h16;
constexpr int VEC_LANES = 16;
inline void loadv(const float *p, vec &o) { load16(p, o); }
inline void loadv(const bf16 *p, vec &o) { load16(p, o); }
#endif

// The sum of the 16 lanes, as a tree.
inline float hsum16(const v16 &x)
{
    v16 v = x + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    return v[0] + v[1];
}

// exp_lanes' steps on whole vectors (the clamp keeps a NaN, as the scalar form does:
// vmaxps/vminps return their second operand when either is NaN).
#if defined(__AVX512F__)
inline v16 clamp_lanes(v16 x, float lo, float hi)
{
    const __m512 v = _mm512_max_ps(_mm512_set1_ps(lo), __builtin_bit_cast(__m512, x));
    return __builtin_bit_cast(v16, _mm512_min_ps(_mm512_set1_ps(hi), v));
}
inline v16 floor_lanes(v16 x)
{
    return __builtin_bit_cast(v16, _mm512_roundscale_ps(__builtin_bit_cast(__m512, x),
                                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
}
inline v16 exp2_lanes(v16 n)
{
    const __m512i i = _mm512_cvttps_epi32(__builtin_bit_cast(__m512, n));
    return __builtin_bit_cast(v16, _mm512_slli_epi32(_mm512_add_epi32(i, _mm512_set1_epi32(127)), 23));
}
#endif
#if defined(__AVX2__)
inline v8 clamp_lanes(v8 x, float lo, float hi)
{
    const __m256 v = _mm256_max_ps(_mm256_set1_ps(lo), __builtin_bit_cast(__m256, x));
    return __builtin_bit_cast(v8, _mm256_min_ps(_mm256_set1_ps(hi), v));
}
inline v8 floor_lanes(v8 x) { return __builtin_bit_cast(v8, _mm256_floor_ps(__builtin_bit_cast(__m256, x))); }
inline v8 exp2_lanes(v8 n)
{
    const __m256i i = _mm256_cvttps_epi32(__builtin_bit_cast(__m256, n));
    return __builtin_bit_cast(v8, _mm256_slli_epi32(_mm256_add_epi32(i, _mm256_set1_epi32(127)), 23));
}
#endif

// round_to and from_f32 on whole vectors (V: v16 or v8; U: the unsigned vector of its width;
// H: the uint16_t vector of its width), lane for lane as the scalar forms.
template <class T, class V, class U>
inline __attribute__((always_inline)) V round_lanes(V x)
{
    if constexpr (std::is_same_v<T, float>) {
        return x;
    } else {
        const U u = __builtin_bit_cast(U, x);
        const U r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        return __builtin_bit_cast(V, x != x ? U{} + 0x7FC00000u : r);
    }
}
template <class T, class V, class U, class H>
inline __attribute__((always_inline)) void store_lanes(T *p, V x)
{
    if constexpr (std::is_same_v<T, float>) {
        std::memcpy(p, &x, sizeof x);
    } else {
        const H h = __builtin_convertvector(__builtin_bit_cast(U, round_lanes<T, V, U>(x)) >> 16, H);
        std::memcpy(p, &h, sizeof h);
    }
}

// exp(x) in float32: Cody-Waite reduction x = n ln2 + r, Cephes' degree-6 polynomial for
// exp(r), times 2^n built in the exponent bits. Within ~2 ulp of expf over [-87, 88]; inputs
// are clamped to that range. One template for a float and for a vector of floats (the
// overloads above), so that every lane takes the same operations in the same order (the same bits): GCC's own
// vectorization of the scalar form ran SiLU * up at 0.68 G elements/s per core here, the
// vector form 1.8.
inline float clamp_lanes(float x, float lo, float hi)
{
    return x < lo ? lo : (x > hi ? hi : x);
}
inline float floor_lanes(float x) { return std::floor(x); }
inline float exp2_lanes(float n)  // 2^n for an integral n in [-126, 128]
{
    return __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}

template <class V>
inline __attribute__((always_inline)) V exp_lanes(V x)
{
    x = clamp_lanes(x, -87.33654f, 88.37626f);
    const V n = floor_lanes(x * 1.44269504f + 0.5f);
    const V r = x - n * 0.693359375f + n * 2.12194440e-4f;
    V p = V{} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const V y = p * r * r + r + 1.0f;
    // n is in [-126, 128] after the clamp, so the shift cannot overflow (128 gives +inf, as
    // in the C original this replaces: only inputs within 0.35 of the clamp reach it).
    return y * exp2_lanes(n);
}

static inline float exp_f32(float x) { return exp_lanes(x); }

// PyTorch's Vectorized<float>::fexp_u20, step for step (the exp of its CPU flash attention's
// whole vectors): 2^(x log2 e) with the fraction's correction as a cubic, assembled in the
// exponent bits by one fused multiply-add and a truncation.
static inline float fexp_u20(float x)
{
    const float lo = __builtin_bit_cast(float, 0xc2aeac50u);
    const float hi = __builtin_bit_cast(float, 0x42b17218u);
    float src = x * __builtin_bit_cast(float, 0x3fb8aa3bu);  // x log2(e)
    const float f = src - std::floor(src);
    float r = std::fma(f, -0.079204240219773236f, -0.22433836478672356f);
    r = std::fma(f, r, 0.30354260500649682f);
    r = std::fma(f, r, 0.00010703434948458272f);
    src -= r;
    int32_t bits = static_cast<int32_t>(std::fma(8388608.0f, src, 1065353216.0f));
    bits = x < lo ? 0 : (x > hi ? 0x7F800000 : bits);
    return __builtin_bit_cast(float, bits);
}

#if defined(__AVX512F__)
constexpr int TORCH_LANES = 16;  // the float vector width of PyTorch's kernels for this CPU
#else
constexpr int TORCH_LANES = 8;
#endif

// fexp_u20 on a whole vector (TORCH_LANES = VEC_LANES floats), the same steps (the same bits).
#if defined(__AVX512F__)
inline v16 fexp_u20_lanes(v16 xv)
{
    const __m512 x = __builtin_bit_cast(__m512, xv);
    __m512 src = _mm512_mul_ps(x, _mm512_set1_ps(__builtin_bit_cast(float, 0x3fb8aa3bu)));
    const __m512 f = _mm512_sub_ps(src, _mm512_roundscale_ps(src, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
    __m512 r = _mm512_fmadd_ps(f, _mm512_set1_ps(-0.079204240219773236f), _mm512_set1_ps(-0.22433836478672356f));
    r = _mm512_fmadd_ps(f, r, _mm512_set1_ps(0.30354260500649682f));
    r = _mm512_fmadd_ps(f, r, _mm512_set1_ps(0.00010703434948458272f));
    src = _mm512_sub_ps(src, r);
    __m512i bits = _mm512_cvttps_epi32(_mm512_fmadd_ps(_mm512_set1_ps(8388608.0f), src, _mm512_set1_ps(1065353216.0f)));
    const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_bit_cast(float, 0xc2aeac50u)), _CMP_LT_OQ);
    const __mmask16 above = _mm512_cmp_ps_mask(x, _mm512_set1_ps(__builtin_bit_cast(float, 0x42b17218u)), _CMP_GT_OQ);
    bits = _mm512_mask_mov_epi32(bits, above, _mm512_set1_epi32(0x7F800000));
    bits = _mm512_mask_mov_epi32(bits, below, _mm512_setzero_si512());
    return __builtin_bit_cast(v16, bits);
}
#elif defined(__AVX2__)
inline v8 fexp_u20_lanes(v8 xv)
{
    const __m256 x = __builtin_bit_cast(__m256, xv);
    __m256 src = _mm256_mul_ps(x, _mm256_set1_ps(__builtin_bit_cast(float, 0x3fb8aa3bu)));
    const __m256 f = _mm256_sub_ps(src, _mm256_floor_ps(src));
    __m256 r = _mm256_fmadd_ps(f, _mm256_set1_ps(-0.079204240219773236f), _mm256_set1_ps(-0.22433836478672356f));
    r = _mm256_fmadd_ps(f, r, _mm256_set1_ps(0.30354260500649682f));
    r = _mm256_fmadd_ps(f, r, _mm256_set1_ps(0.00010703434948458272f));
    src = _mm256_sub_ps(src, r);
    __m256i bits = _mm256_cvttps_epi32(_mm256_fmadd_ps(_mm256_set1_ps(8388608.0f), src, _mm256_set1_ps(1065353216.0f)));
    const __m256 below = _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_bit_cast(float, 0xc2aeac50u)), _CMP_LT_OQ);
    const __m256 above = _mm256_cmp_ps(x, _mm256_set1_ps(__builtin_bit_cast(float, 0x42b17218u)), _CMP_GT_OQ);
    bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7F800000), _mm256_castps_si256(above));
    bits = _mm256_andnot_si256(_mm256_castps_si256(below), bits);
    return __builtin_bit_cast(v8, bits);
}
#endif

// PyTorch's CPU flash attention (what transformers' models call) in chunks of this many keys
// from position 0: its kvSplitSize.
constexpr int TORCH_CHUNK = 512;

// One chunk's softmax step for one query as PyTorch's CPU flash attention takes it (decode and
// prompt attention share it, so that a bf16 model's attention follows transformers'): keys
// [vis, end) of the chunk [c0, c1) are visible, c1 counted from the whole context; s holds the
// query's scores from key lo. Updates the running max and sum, leaves the numerators in s
// (rounded to bfloat16 with RoundP) and rescales acc (D floats) unless this is the query's
// first chunk. fexp_u20 on the chunk's whole vectors of TORCH_LANES, summed lane by lane then
// as a tree, expf on the rest; whole vectors where the chunk's lanes allow, lane by lane around
// them (the same exp, the same per-lane order of the sums).
template <bool RoundP>
inline void chunk_softmax(float *s, int lo, int c0, int c1, int vis, int end, float &run_max,
                          float &run_sum, float *acc, int D, bool first)
{
    constexpr int L = TORCH_LANES;
    const int vec_end = c0 + (c1 - c0) / L * L, vend = vec_end < end ? vec_end : end;
    float m = run_max;
    #pragma omp simd reduction(max:m)
    for (int t = vis; t < end; t++) m = s[t - lo] > m ? s[t - lo] : m;
    float lanes[L] = {};
    int t = vis;
    // float32 models take the accurate exp: PyTorch's float32 kernel is ~1e-6 from exact, and
    // fexp_u20 (~2e-5 relative) would put such outputs ~1e-4 off.
    auto one = [&](int u) {
        const float e = RoundP ? fexp_u20(s[u - lo] - m) : exp_f32(s[u - lo] - m);
        s[u - lo] = RoundP ? round_to<bf16>(e) : e;
        lanes[(u - c0) % L] += e;
    };
    const int aligned = c0 + (vis - c0 + L - 1) / L * L;
    for (; t < vend && t < aligned; t++) one(t);
#if defined(__AVX512F__) || defined(__AVX2__)
    if (t + L <= vend) {
        vec sum_v, x;
        std::memcpy(&sum_v, lanes, sizeof sum_v);
        for (; t + L <= vend; t += L) {
            loadv(s + t - lo, x);
            const vec e = RoundP ? fexp_u20_lanes(x - m) : exp_lanes(x - m);
            sum_v += e;
            *reinterpret_cast<vecu *>(s + t - lo) = RoundP ? round_lanes<bf16, vec, vec_u32>(e) : e;
        }
        std::memcpy(lanes, &sum_v, sizeof sum_v);
    }
#endif
    for (; t < vend; t++) one(t);
    for (int d = L / 2; d >= 1; d /= 2)
        for (int l = 0; l < d; l++) lanes[l] += lanes[l + d];
    float sum = lanes[0];
    for (t = vend > vis ? vend : vis; t < end; t++) {
        const float e = std::exp(s[t - lo] - m);
        sum += e;
        s[t - lo] = RoundP ? round_to<bf16>(e) : e;
    }
    const float rescale = std::exp(run_max - m);
    run_sum = std::fma(rescale, run_sum, sum);
    run_max = m;
    if (!first)
        for (int d = 0; d < D; d++) acc[d] *= rescale;
}

// Element-wise copy with conversion (a memcpy when the types agree).
template <class S, class D>
inline void convert(const S *src, D *dst, long n)
{
    #pragma omp simd
    for (long i = 0; i < n; i++) dst[i] = from_f32<D>(to_f32(src[i]));
}

#if defined(__AVX512F__)
// 16 sums + bias rounded once to bf16 and stored (the first n of them).
inline void finish16(__m512 s, const bf16 *bias, bf16 *y, int n)
{
    const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    if (bias) {
        const __m256i b = _mm256_maskz_loadu_epi16(mask, bias);
        s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)));
    }
    const v16 r = round_lanes<bf16, v16, u16x32>(reinterpret_cast<const v16 &>(s));
    const __m512i u = _mm512_srli_epi32(reinterpret_cast<const __m512i &>(r), 16);
    _mm256_mask_storeu_epi16(y, mask, _mm512_cvtepi32_epi16(u));
}

#endif

}  // namespace fleetllm::kernels
