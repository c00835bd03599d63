// Quantized projections (quant.cpp; fleetllm/quant/ and model/linear_kernels.py's Gguf): GGUF's
// block types read as the file stores them, and the packed copy a projection keeps: one uint8
// buffer that starts with a header of int64 words, then each part's rows (q, k and v of a
// merged projection may be of different types, as in Q4_K_M files):
//   [0] QPACK_MAGIC, [1] K (in features), [2] parts (| QPACK_INT8_ACTS), [3] perm offset, then
//   per part: type, rows, row bytes, byte offset of its first row; part p's rows are outputs
//   sum(rows of parts < p) + ...
// perm offset 0: no permutation; else the byte offset of K int64 entries perm (GPTQ's
// act-order): stored column i multiplies x's column perm[i] (y = W x[:, perm]^T), so
// gguf_linear gathers x's columns once and every path then runs on the stored order.
// Types are ggml's ids, and fleetllm's own zero-point types (200 up; never in a GGUF file):
// Q4_ZP (fp16 d, uint8 z, a pad byte, Q4_0's nibbles) and Q8_ZP (d, z, pad, 32 uint8 q), both
// w = d * (q - z) with q unsigned: AWQ / GPTQ zero points exactly (Q4_1's m = -d z rounds to
// fp16). F32, F16 and BF16 parts are plain rows.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace fleetllm::kernels::quant {

enum Type : int64_t {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13,
    Q6_K = 14, BF16 = 30, Q4_ZP = 200, Q8_ZP = 201
};
constexpr int64_t QPACK_MAGIC = 0x324b4341505146LL;  // "FQPACK2" (FQPACK1: no perm word)
constexpr int MAX_PARTS = 4;
// A flag in the parts word (bit 32): W8A8 (compressed-tensors int-quantized, quant/groups.py):
// every part Q8_0 with one scale a row, whose GEMMs quantize x per row to int8 as the format does.
constexpr int64_t QPACK_INT8_ACTS = 1LL << 32;

// Elements and bytes of one block of `type`; {0, 0} for a type fleetllm does not read.
struct Layout {
    int elems, bytes;
};
Layout layout(int64_t type);

// Q4_K / Q5_K: sub-block j's 6-bit scale and min, packed in 12 bytes (ggml's
// get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t *q, int &sc, int &m)
{
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

struct Part {
    int64_t type, rows, row_bytes;
    const uint8_t *data;
};

// A packed copy, parsed and checked (parse: nullptr, or what is wrong).
struct Weight {
    int K = 0;
    long N = 0;
    int parts = 0;
    Part part[MAX_PARTS];
    const int64_t *perm = nullptr;  // K entries in [0, K), or none
    bool int8_acts = false;         // QPACK_INT8_ACTS
};
const char *parse(const uint8_t *buf, int64_t nbytes, Weight &w);

// y[m, n] = x[m, :] . w[n, :] for M rows of float32 x [M, K] in the stored column order (x
// gathered by w.perm); y float32 [M, N]. Rows of x in groups of up to 8 share each block's
// unpacking; float32 sums.
void linear(const float *x, int M, const Weight &w, float *y, int nthreads);

// Rows [r0, r0 + rows) of w as float32 [rows, K] in the stored column order (a prompt's chunk
// for a GEMM, an embedding's rows); dequantize_bf16: as bf16 (rounded to nearest even), only
// where fast_dequant_reads every part.
void dequantize(const Weight &w, long r0, long rows, float *out, int nthreads);
void dequantize_bf16(const Weight &w, long r0, long rows, uint16_t *out, int nthreads);

// The AVX-512 dequantizer (quant_dequant.cpp; no VNNI needed): whether this CPU runs it
// (FLEETLLM_QUANT_FAST_DEQUANT=0 turns it off), whether it reads a part of `type`, and one row
// of K elements of such a part: the generic unpacking's values, as float32 or bf16.
bool fast_dequant_available();
bool fast_dequant_reads(int64_t type);
void fast_dequant_row(int64_t type, const uint8_t *row, int K, float *out);
void fast_dequant_row(int64_t type, const uint8_t *row, int K, uint16_t *out);

// The AVX-512 VNNI path (quant_vnni.cpp): whether this CPU runs it (FLEETLLM_QUANT_VNNI=0
// turns it off), whether it reads a part of `type` with K columns, x's rows quantized for it
// (xq int8 [2, M, K]: two planes; dxl, xls: per 4 elements; xqsum: each 16 elements' sum as
// quantized; per_row: W8A8's int8 per row, one plane), and outputs [n0, n1) of one part for
// every row of x (y [M, N], the part's first output at `first`).
bool vnni_available();
bool vnni_reads(int64_t type, int K);
void vnni_quantize(const float *x, int M, int K, int8_t *xq, float *dxl, int32_t *xls,
                   float *xqsum, bool per_row);
void vnni_rows(const Part &p, const int8_t *xq, const float *dxl, const int32_t *xls,
               const float *xqsum, int K, int M, long n0, long n1, float *y, long N, long first);

#if defined(__x86_64__)
// An fp16 at p as float32 by F16C: the x86 kernels' block scales (quant_vnni.cpp,
// quant_dequant.cpp, each built for a target with F16C; quant.cpp converts portably).
__attribute__((target("f16c"), always_inline)) inline float f16c_half_at(const uint8_t *p)
{
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}
#endif

}  // namespace fleetllm::kernels::quant
