/* float32 linear layers on weights packed once: out[m][n] = a[m] . w[n] (+ bias[n]).
 *
 *   batchd_sgemm_pack  w [n][k] into panels of 32 output columns, [panels][k][32] (the last
 *                      panel zero-padded)
 *   batchd_sgemm       a [m][k] (row stride lda) times the packed weights into out [m][n]
 *                      (row stride ldc)
 *   batchd_sgemm_fast  1 where this build has AVX-512 (see below)
 *
 * A tile is 12 rows x 32 columns in 24 vector accumulators: per k the panel's two weight
 * vectors are loaded once (pinned to registers: a compiler that folds them into the twelve
 * multiply-adds reloads them twelve times) and each row's element is broadcast; the panel is
 * prefetched 8 k ahead. Panels are split over torch's OpenMP team; the rows left after
 * whole tiles make one tile of their own size (8-, 4- and 1-row tails kept too few
 * multiply-add chains in flight on the rows past the eighth or fourth). Every tile adds the k
 * terms in the same order, so a row's result does not depend on the rows beside it. Without
 * AVX-512 the accumulators do not fit the registers, so batchd_sgemm_fast() is 0 there and the
 * engine keeps oneDNN. Built and loaded by engine/cpu/kernels.py; what it measured:
 * docs/benchmarks/history.md. */
#include <stdint.h>
#include <string.h>

#include "batchd.h"
#include "vector.h"

#define NB 32 /* output columns a panel */
#define MR 12 /* rows a tile */

int batchd_sgemm_fast(void) { return one_register_vectors(); }

void batchd_sgemm_pack(const float *w, int32_t n, int32_t k, float *out) {
    const int panels = (n + NB - 1) / NB;
    for (int p = 0; p < panels; p++)
        for (int kk = 0; kk < k; kk++)
            for (int j = 0; j < NB; j++) {
                const int col = p * NB + j;
                out[((int64_t)p * k + kk) * NB + j] = col < n ? w[(int64_t)col * k + kk] : 0.f;
            }
}

/* rows x 32 of out (cols of them kept) from `rows` rows of a and one panel b [k][32]. */
static inline __attribute__((always_inline)) void tile(const float *a, int64_t lda,
                                                       const float *b, int k, const float *bias,
                                                       float *c, int64_t ldc, int cols,
                                                       const int rows) {
    vf acc[MR][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = (vf){0};
    for (int kk = 0; kk < k; kk++) {
        vf b0 = vload(b + kk * NB), b1 = vload(b + kk * NB + LANES);
        PIN(b0);
        PIN(b1);
        __builtin_prefetch(b + (kk + 8) * NB, 0, 3);
        __builtin_prefetch(b + (kk + 8) * NB + LANES, 0, 3);
        for (int r = 0; r < rows; r++) {
            const float x = a[r * lda + kk];
            acc[r][0] += x * b0;
            acc[r][1] += x * b1;
        }
    }
    for (int r = 0; r < rows; r++) {
        float row[NB];
        memcpy(row, &acc[r][0], sizeof acc[r][0]);
        memcpy(row + LANES, &acc[r][1], sizeof acc[r][1]);
        if (bias != NULL)
            for (int j = 0; j < cols; j++) row[j] += bias[j];
        memcpy(c + r * ldc, row, sizeof(float) * (size_t)cols);
    }
}

void batchd_sgemm(const batchd_gemm_args *args) {
    const float *a = args->a, *packed = args->packed, *bias = args->bias;
    float *out = args->out;
    const int64_t lda = args->lda, ldc = args->ldc;
    const int m = args->m, k = args->k, n = args->n, threads = args->threads;
    const int panels = (n + NB - 1) / NB;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && panels > 1)
    for (int p = 0; p < panels; p++) {
        const float *b = packed + (int64_t)p * k * NB;
        const float *pb = bias != NULL ? bias + p * NB : NULL;
        const int cols = n - p * NB < NB ? n - p * NB : NB;
        float *c = out + p * NB;
        /* Whole tiles of MR rows, then the rest as one tile of exactly its rows: a tile of
         * two or more rows keeps four or more multiply-add chains in flight, where 1-row
         * tails kept two. Every tile adds in the same order, so a row's result does not
         * depend on the tile it falls in. */
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
}
