/* The work of a Llama layer between its matmuls, one call where torch takes several operators
 * (each a dispatch, an allocation and a pass over memory), in float32 or (bf16 set) bfloat16:
 *
 *   batchd_rms_norm    hidden += delta (when given), out = weight * (hidden * rsqrt(mean(hidden^2) + eps))
 *   batchd_rope_store  rotate the query and key heads of a fused q/k/v row in place
 *                      (x * cos + rotate_half(x) * sin) and write its keys and values to the
 *                      layer's paged cache at each row's slot
 *   batchd_silu_mul    out = silu(gate) * up, gate and up the halves of a fused gate/up row
 *   batchd_argmax      the greedy token of each row of logits (torch.argmax's answer)
 *
 * Each element is rounded where transformers' Llama rounds it (no multiply-add contraction:
 * the build passes -ffp-contract=off for this file on the command line, engine/cpu/kernels.py),
 * in bf16 to the nearest even bf16 after each of its operators (the norm's sums and scale in
 * float32, as it casts them); only the order of the squares' sum differs. Rows are split over
 * `threads` of torch's own OpenMP team where there are enough of them. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "batchd.h"
#include "vector.h"

/* Rows of at least this many elements in all are worth a second thread. */
#define PARALLEL_ELEMENTS 32768

/* bf16 rows: the residual added and rounded in place, the norm in float32, its output rounded
 * as transformers rounds it (hidden.to(bf16), then weight * that). */
static void rms_norm_bf16(uint16_t *hidden, const uint16_t *delta, int64_t delta_row,
                          const uint16_t *weight, float eps, int rows, int dim, uint16_t *out,
                          int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * dim >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        uint16_t *h = hidden + (int64_t)r * dim;
        if (delta != NULL) {
            const uint16_t *d = delta + (int64_t)r * delta_row;
            for (int c = 0; c < dim; c++) h[c] = narrow(widen(h[c]) + widen(d[c]));
        }
        float lanes[16] = {0};
        int c = 0;
        for (; c + 16 <= dim; c += 16)
            for (int l = 0; l < 16; l++) lanes[l] += widen(h[c + l]) * widen(h[c + l]);
        float sum = 0.f;
        for (int l = 0; l < 16; l++) sum += lanes[l];
        for (; c < dim; c++) sum += widen(h[c]) * widen(h[c]);
        const float scale = 1.f / sqrtf(sum / (float)dim + eps);
        uint16_t *o = out + (int64_t)r * dim;
        for (c = 0; c < dim; c++) o[c] = narrow(widen(weight[c]) * widen(narrow(widen(h[c]) * scale)));
    }
}

void batchd_rms_norm(const batchd_norm_args *args) {
    const int64_t delta_row = args->delta_row;
    const float eps = args->eps;
    const int rows = args->rows, dim = args->dim, threads = args->threads;
    if (args->bf16) {
        rms_norm_bf16(args->hidden, args->delta, delta_row, args->weight, eps, rows, dim,
                      args->out, threads);
        return;
    }
    float *hidden = args->hidden, *out = args->out;
    const float *delta = args->delta, *weight = args->weight;
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

/* The same in bf16, each product and the sum rounded as transformers' bf16 operators round. */
static inline void rotate_bf16(uint16_t *x, const uint16_t *cos, const uint16_t *sin, int dim) {
    const int half = dim / 2;
    for (int d = 0; d < half; d++) {
        const float a = widen(x[d]), b = widen(x[d + half]);
        const float lo = widen(narrow(a * widen(cos[d]))) + widen(narrow((-b) * widen(sin[d])));
        const float hi = widen(narrow(b * widen(cos[d + half]))) + widen(narrow(a * widen(sin[d + half])));
        x[d] = narrow(lo);
        x[d + half] = narrow(hi);
    }
}

static void rope_store_bf16(uint16_t *qkv, int64_t qkv_row, int rows, int q_heads, int kv_heads,
                            int dim, const uint16_t *cos, const uint16_t *sin, uint16_t *k_cache,
                            uint16_t *v_cache, int64_t kv_head, const int64_t *slots, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * qkv_row >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        uint16_t *row = qkv + (int64_t)r * qkv_row;
        const uint16_t *c = cos + (int64_t)r * dim, *s = sin + (int64_t)r * dim;
        for (int h = 0; h < q_heads + kv_heads; h++) rotate_bf16(row + (int64_t)h * dim, c, s, dim);
        const uint16_t *k = row + (int64_t)q_heads * dim, *v = k + (int64_t)kv_heads * dim;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t at = h * kv_head + slots[r] * dim;
            memcpy(k_cache + at, k + (int64_t)h * dim, sizeof(uint16_t) * (size_t)dim);
            memcpy(v_cache + at, v + (int64_t)h * dim, sizeof(uint16_t) * (size_t)dim);
        }
    }
}

/* qkv [rows, qkv_row]: q_heads query heads, then kv_heads key heads, then kv_heads value
 * heads, each `dim` wide; cos/sin [rows, dim]; the caches [kv_heads, slots, dim] (a head every
 * kv_head elements); slots [rows]. Returns 2 for a dim over 1,024 or odd. */
int batchd_rope_store(const batchd_rope_args *args) {
    const int64_t qkv_row = args->qkv_row, kv_head = args->kv_head;
    const int rows = args->rows, q_heads = args->q_heads, kv_heads = args->kv_heads;
    const int dim = args->dim, threads = args->threads;
    const int64_t *slots = args->slots;
    if (dim > 1024 || dim % 2) return 2;
    if (args->bf16) {
        rope_store_bf16(args->qkv, qkv_row, rows, q_heads, kv_heads, dim, args->cos, args->sin,
                        args->k_cache, args->v_cache, kv_head, slots, threads);
        return 0;
    }
    float *qkv = args->qkv, *k_cache = args->k_cache, *v_cache = args->v_cache;
    const float *cos = args->cos, *sin = args->sin;
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

/* bf16: silu(g) in float32 rounded to bf16 (torch's bf16 SiLU), then times up, rounded. */
static void silu_mul_bf16(const uint16_t *gu, int64_t gu_row, int rows, int inner, uint16_t *out,
                          int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && (int64_t)rows * inner >= PARALLEL_ELEMENTS)
    for (int r = 0; r < rows; r++) {
        const uint16_t *g = gu + (int64_t)r * gu_row, *u = g + inner;
        uint16_t *o = out + (int64_t)r * inner;
        int c = 0;
        for (; c + LANES <= inner; c += LANES) {
            const vf gv = vload_any(g, c, 1), uv = vload_any(u, c, 1);
            const vf act = vround_bf16(gv / (1.0f + vexp((vf){0} - gv)));
            const vu ov = (vu)vround_bf16(act * uv) >> 16;
            const vh packed = __builtin_convertvector(ov, vh);
            memcpy(o + c, &packed, sizeof packed);
        }
        for (; c < inner; c++) {
            vf gv = (vf){0} + widen(g[c]);
            const vf act = gv / (1.0f + vexp((vf){0} - gv));
            o[c] = narrow(widen(narrow(act[0])) * widen(u[c]));
        }
    }
}

/* gu [rows, gu_row]: gate in columns 0 .. inner - 1, up in inner .. 2 inner - 1; out [rows,
 * inner] contiguous. silu(g) = g / (1 + e^-g), as torch computes it. */
void batchd_silu_mul(const batchd_silu_args *args) {
    const int64_t gu_row = args->gate_up_row;
    const int rows = args->rows, inner = args->inner, threads = args->threads;
    if (args->bf16) {
        silu_mul_bf16(args->gate_up, gu_row, rows, inner, args->out, threads);
        return;
    }
    const float *gu = args->gate_up;
    float *out = args->out;
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
void batchd_argmax(const float *x, int64_t row, int32_t rows, int64_t cols, int64_t *out,
                   int32_t threads) {
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
