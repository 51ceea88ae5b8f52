/* bfloat16 linear layers on weights packed once, on the CPU's bf16 dot-product unit
 * (AVX-512 BF16): out[m][n] = a[m] . w[n] (+ bias[n]), summed in float32, rounded once to the
 * nearest even bf16 at the end, as oneDNN's bf16 linear rounds.
 *
 *   batchd_bgemm_pack  w [n][k] into panels of 32 output columns of k pairs, [panels][k/2][32][2]
 *                      (an odd k's last pair and the last panel zero-padded)
 *   batchd_bgemm       a [m][k] (row stride lda) times the packed weights into out [m][n]
 *                      (row stride ldc)
 *   batchd_bgemm_fast  1 where this build has AVX-512 BF16 (0 elsewhere: nothing to call)
 *
 * The float32 GEMM's tile (sgemm.c), two k at a time: per pair of k the panel's two weight
 * vectors (16 columns x 2 k each) are loaded once and each row's two elements are broadcast as
 * one 32-bit word into VDPBF16PS, 12 rows x 32 columns in 24 accumulators. Every row is summed
 * over k in the same order whatever tile it falls in, so a row's result does not depend on the
 * rows beside it in the call (oneDNN's bf16 GEMM splits k differently from about 30 rows:
 * a sequence's logits would depend on what else the step holds). Built and loaded by
 * engine/cpu/kernels.py. */
#include <stdint.h>
#include <string.h>

#include "batchd.h"
#include "vector.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define NATIVE 1
#else
#define NATIVE 0
#endif

#define NB 32 /* output columns a panel */
#define MR 12 /* rows a tile */

int batchd_bgemm_fast(void) { return NATIVE; }

void batchd_bgemm_pack(const uint16_t *w, int32_t n, int32_t k, uint16_t *out) {
    const int panels = (n + NB - 1) / NB, pairs = (k + 1) / 2;
    for (int p = 0; p < panels; p++)
        for (int kk = 0; kk < pairs; kk++)
            for (int j = 0; j < NB; j++)
                for (int e = 0; e < 2; e++) {
                    const int col = p * NB + j, at = 2 * kk + e;
                    out[(((int64_t)p * pairs + kk) * NB + j) * 2 + e] =
                        col < n && at < k ? w[(int64_t)col * k + at] : 0;
                }
}

#if NATIVE
/* rows x 32 of out (cols of them kept) from `rows` rows of a and one panel b [pairs][32][2]. */
static inline __attribute__((always_inline)) void tile(const uint16_t *a, int64_t lda,
                                                       const uint16_t *b, int k,
                                                       const uint16_t *bias, uint16_t *c,
                                                       int64_t ldc, int cols, const int rows) {
    __m512 acc[MR][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int whole = k / 2, pairs = (k + 1) / 2;
    for (int kk = 0; kk < pairs; kk++) {
        const uint16_t *bk = b + (int64_t)kk * NB * 2;
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
        PIN(b0);
        PIN(b1);
        __builtin_prefetch(bk + 8 * NB * 2, 0, 3);
        __builtin_prefetch(bk + 8 * NB * 2 + 32, 0, 3);
        for (int r = 0; r < rows; r++) {
            uint32_t pair;
            if (kk < whole) {
                memcpy(&pair, a + r * lda + 2 * kk, sizeof pair);
            } else { /* an odd k's last element, its partner zero (the panel's is zero too) */
                pair = a[r * lda + 2 * kk];
            }
            const __m512bh x = (__m512bh)_mm512_set1_epi32((int)pair);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b1);
        }
    }
    for (int r = 0; r < rows; r++) {
        float row[NB];
        _mm512_storeu_ps(row, acc[r][0]);
        _mm512_storeu_ps(row + LANES, acc[r][1]);
        if (bias != NULL)
            for (int j = 0; j < cols; j++) row[j] += widen(bias[j]);
        for (int j = 0; j < cols; j++) c[r * ldc + j] = narrow(row[j]);
    }
}
#endif

void batchd_bgemm(const batchd_gemm_args *args) {
#if NATIVE
    const uint16_t *a = args->a, *packed = args->packed, *bias = args->bias;
    uint16_t *out = args->out;
    const int64_t lda = args->lda, ldc = args->ldc;
    const int m = args->m, k = args->k, n = args->n, threads = args->threads;
    const int panels = (n + NB - 1) / NB, pairs = (k + 1) / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels > 1)
    for (int p = 0; p < panels; p++) {
        const uint16_t *b = packed + (int64_t)p * pairs * NB * 2;
        const uint16_t *pb = bias != NULL ? bias + p * NB : NULL;
        const int cols = n - p * NB < NB ? n - p * NB : NB;
        uint16_t *c = out + p * NB;
        int r = 0;
        for (; r + MR <= m; r += MR) tile(a + r * lda, lda, b, k, pb, c + r * ldc, ldc, cols, MR);
        switch (m - r) {
#define REST(rows)                                                               \
    case rows:                                                                   \
        tile(a + r * lda, lda, b, k, pb, c + r * ldc, ldc, cols, rows);          \
        break;
            REST(1) REST(2) REST(3) REST(4) REST(5) REST(6)
            REST(7) REST(8) REST(9) REST(10) REST(11)
#undef REST
        default:
            break;
        }
    }
#else
    (void)args;
#endif
}
