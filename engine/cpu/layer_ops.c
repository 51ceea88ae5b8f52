/* The float32 work of a Llama layer between its matmuls, one call where torch takes several
 * operators (each a dispatch, an allocation and a pass over memory):
 *
 *   batchd_rms_norm    hidden += delta (when given), out = weight * (hidden * rsqrt(mean(hidden^2) + eps))
 *   batchd_rope_store  rotate the query and key heads of a fused q/k/v row in place
 *                      (x * cos + rotate_half(x) * sin) and write its keys and values to the
 *                      layer's paged cache at each row's slot
 *   batchd_silu_mul    out = silu(gate) * up, gate and up the halves of a fused gate/up row
 *   batchd_argmax      the greedy token of each row of logits (torch.argmax's answer)
 *
 * Each element is rounded where transformers' Llama rounds it (no multiply-add contraction);
 * only the order of the squares' sum differs. Built and loaded by engine/cpu/kernels.py; rows
 * are split over `threads` of torch's own OpenMP team where there are enough of them. */
#pragma GCC optimize("fp-contract=off")
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vector.h"

/* Rows of at least this many elements in all are worth a second thread. */
#define PARALLEL_ELEMENTS 32768

void batchd_rms_norm(float *hidden, const float *delta, int64_t delta_row, const float *weight,
                     float eps, int rows, int dim, float *out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        float *h = hidden + (int64_t)r * dim;
        if (delta != NULL) {
            const float *d = delta + (int64_t)r * delta_row;
            for (int c = 0; c < dim; c++) h[c] = h[c] + d[c];
        }
        float lanes[16] = {0};
        int c = 0;
        for (; c + 16 <= dim; c += 16)
            for (int l = 0; l < 16; l++) lanes[l] += h[c + l] * h[c + l];
        float sum = 0.f;
        for (int l = 0; l < 16; l++) sum += lanes[l];
        for (; c < dim; c++) sum += h[c] * h[c];
        const float scale = 1.f / sqrtf(sum / (float)dim + eps);
        float *o = out + (int64_t)r * dim;
        for (c = 0; c < dim; c++) o[c] = weight[c] * (h[c] * scale);
    }
}

/* x * cos + rotate_half(x) * sin for one head, in place: halves of 16 lanes a vector where
 * the half is a multiple of 16, one element at a time otherwise. */
static inline void rotate(float *x, const float *cos, const float *sin, int dim) {
    const int half = dim / 2;
    if (half % LANES == 0) {
        for (int d = 0; d < half; d += LANES) {
            vf a, b, c1, c2, s1, s2;
            memcpy(&a, x + d, sizeof a);
            memcpy(&b, x + d + half, sizeof b);
            memcpy(&c1, cos + d, sizeof c1);
            memcpy(&c2, cos + d + half, sizeof c2);
            memcpy(&s1, sin + d, sizeof s1);
            memcpy(&s2, sin + d + half, sizeof s2);
            const vf lo = a * c1 + (-b) * s1, hi = b * c2 + a * s2;
            memcpy(x + d, &lo, sizeof lo);
            memcpy(x + d + half, &hi, sizeof hi);
        }
        return;
    }
    for (int d = 0; d < half; d++) {
        const float a = x[d], b = x[d + half];
        x[d] = a * cos[d] + (-b) * sin[d];
        x[d + half] = b * cos[d + half] + a * sin[d + half];
    }
}

/* qkv [rows, qkv_row]: q_heads query heads, then kv_heads key heads, then kv_heads value
 * heads, each `dim` wide; cos/sin [rows, dim]; the caches [kv_heads, slots, dim] (a head every
 * kv_head elements); slots [rows]. Returns 2 for a dim over 1,024 or odd. */
int batchd_rope_store(float *qkv, int64_t qkv_row, int rows, int q_heads, int kv_heads, int dim,
                      const float *cos, const float *sin, float *k_cache, float *v_cache,
                      int64_t kv_head, const int64_t *slots, int threads) {
    if (dim > 1024 || dim % 2) return 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * qkv_row >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        float *row = qkv + (int64_t)r * qkv_row;
        const float *c = cos + (int64_t)r * dim, *s = sin + (int64_t)r * dim;
        for (int h = 0; h < q_heads + kv_heads; h++) rotate(row + (int64_t)h * dim, c, s, dim);
        const float *k = row + (int64_t)q_heads * dim, *v = k + (int64_t)kv_heads * dim;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = h * kv_head + slots[r] * dim;
            memcpy(k_cache + at, k + (int64_t)h * dim, sizeof(float) * (size_t)dim);
            memcpy(v_cache + at, v + (int64_t)h * dim, sizeof(float) * (size_t)dim);
        }
    }
    return 0;
}

/* e^x to about 1 ulp on sixteen lanes, for any x (clamped where it would overflow or vanish):
 * x = n ln2 + r, a degree-6 polynomial for e^r, 2^n put into the exponent bits. */
static inline vf vexp(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    x = (vf)(((vi)x & ~(vi)(x < lo)) | ((vi)lo & (vi)(x < lo)));
    x = (vf)(((vi)x & ~(vi)(x > hi)) | ((vi)hi & (vi)(x > hi)));
    const vf t = x * 1.44269504088896341f + 0.5f;
    vi ni = __builtin_convertvector(t, vi); /* toward zero, then down where t was negative */
    ni += (vi)(t < __builtin_convertvector(ni, vf));
    return vexp_reduced(x, ni);
}

/* gu [rows, gu_row]: gate in columns 0 .. inner - 1, up in inner .. 2 inner - 1; out [rows,
 * inner] contiguous. silu(g) = g / (1 + e^-g), as torch computes it. */
void batchd_silu_mul(const float *gu, int64_t gu_row, int rows, int inner, float *out,
                     int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * inner >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *g = gu + (int64_t)r * gu_row, *u = g + inner;
        float *o = out + (int64_t)r * inner;
        int c = 0;
        for (; c + LANES <= inner; c += LANES) {
            vf gv, uv;
            memcpy(&gv, g + c, sizeof gv);
            memcpy(&uv, u + c, sizeof uv);
            const vf ov = (gv / (1.0f + vexp((vf){0} - gv))) * uv;
            memcpy(o + c, &ov, sizeof ov);
        }
        for (; c < inner; c++) {
            vf gv = (vf){0} + g[c];
            const vf ov = gv / (1.0f + vexp((vf){0} - gv));
            o[c] = ov[0] * u[c];
        }
    }
}

/* out[r] = the first column of row r holding its largest value (a NaN counts as largest), as
 * torch.argmax gives it: the greedy token of each row of logits [rows, cols], row stride
 * `row`. One pass for the largest value in 16 lanes, one for where it first is. */
void batchd_argmax(const float *x, int64_t row, int rows, int64_t cols, int64_t *out,
                   int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * cols >= 4 * PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const float *v = x + (int64_t)r * row;
        vf top = (vf){0} - INFINITY;
        vi nan = {0};
        int64_t c = 0;
        for (; c + LANES <= cols; c += LANES) {
            vf a;
            memcpy(&a, v + c, sizeof a);
            nan |= a != a;
            const vi more = a > top;
            top = (vf)(((vi)a & more) | ((vi)top & ~more));
        }
        float best = -INFINITY;
        int any_nan = 0;
        for (int l = 0; l < LANES; l++) {
            best = top[l] > best ? top[l] : best;
            any_nan |= nan[l];
        }
        for (; c < cols; c++) {
            any_nan |= v[c] != v[c];
            best = v[c] > best ? v[c] : best;
        }
        int64_t at = 0;
        if (any_nan) {
            while (v[at] == v[at]) at++;
        } else {
            while (v[at] != best) at++;
        }
        out[r] = at;
    }
}
