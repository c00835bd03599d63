// float32 projections by MKL's packed sgemm: a weight packed once (cblas_sgemm_pack, "B"
// transposed), then y = x . w^T at any number of rows (cblas_sgemm_compute). MKL is
// libtorch_cpu's own (torch's x86 builds link it and export the CBLAS entry points); this
// library declares them weak, so a torch without MKL (aarch64) loads it with null entries and
// mkl_packed_available() says no.
// Why: on Intel CPUs MKL's packed sgemm is faster than oneDNN's packed matmul for float32
// (tools/fp32_gemm_ab.py) and its products are F.linear's bits for most shapes (the unpacked
// sgemm's, which transformers runs), where oneDNN's differ in the last bits. On AMD CPUs MKL
// takes slower paths: Intel only. MKL sizes its buffer at 1.6-4.9x the weight's bytes but
// writes about the weight's bytes of it (the rest is never touched, so never resident).
#include <cstddef>

#include "kernels.h"

extern "C" {
// mkl_cblas.h's prototypes, enums as the ints they are; weak: null where torch has no MKL.
size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k) __attribute__((weak));
void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                      const float *src, int ld, float *dest) __attribute__((weak));
void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k,
                         const float *a, int lda, const float *b, int ldb, float beta, float *c,
                         int ldc) __attribute__((weak));
}

namespace fleetllm::kernels {
namespace {

// mkl_cblas.h: CblasRowMajor, CblasNoTrans, CblasTrans, CblasBMatrix, CblasPacked.
constexpr int ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112, B_MATRIX = 162, PACKED = 151;
// The row count the packing is made for: MKL's packed B serves every row count.
constexpr int PACK_ROWS = 256;

}  // namespace

bool mkl_packed_available()
{
    static const bool ok = cblas_sgemm_pack_get_size != nullptr &&
                           cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr
#if defined(__x86_64__)
                           && __builtin_cpu_is("intel")
#else
                           && false
#endif
        ;
    return ok;
}

size_t mkl_pack_bytes(int n, int k) { return cblas_sgemm_pack_get_size(B_MATRIX, PACK_ROWS, n, k); }

void mkl_pack(const float *w, int n, int k, void *dest)
{
    cblas_sgemm_pack(ROW_MAJOR, B_MATRIX, TRANS, PACK_ROWS, n, k, 1.0f, w, k,
                     static_cast<float *>(dest));
}

void mkl_compute(const float *x, int m, int n, int k, const void *packed, float *y,
                 bool accumulate)
{
    cblas_sgemm_compute(ROW_MAJOR, NO_TRANS, PACKED, m, n, k, x, k,
                        static_cast<const float *>(packed), k, accumulate ? 1.0f : 0.0f, y, n);
}

}  // namespace fleetllm::kernels
