/* Decode attention over the paged KV cache: one call per layer for every decode row, for
 * float32 or bfloat16 tensors (bf16 widened on load, every sum in float32, the softmax
 * numerators and the output rounded to the nearest even bf16).
 *
 * Built and loaded by engine/cpu/kernels.py, after torch: its OpenMP runtime is the one torch
 * already loaded, so the kernel runs on torch's own threads and never beside them. A task is
 * one (sequence, KV head): its query heads score the sequence's keys, read in place block by
 * block through its block table, each key row read once for the whole group; a two-pass
 * softmax in float32; then the weighted sum of the values, one read of each value row for
 * every head (three or two heads at once where AVX-512 has the registers), the rows
 * prefetched during the key pass. Head sizes 64 and 128 have their own builds (the head's loops
 * unrolled). Returns 0, 1 when scratch memory could not be had, 2 for a head_dim over MAX_DIM. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "batchd.h"
#include "vector.h"

#define MAX_DIM 1024
#define KEY_AHEAD 32 /* how many keys ahead the key pass prefetches a key row */

typedef batchd_decode_args job_t; /* the call's arguments are the tasks' job */

/* e^x for x <= 0 (a score less the largest), to about 1 ulp: x = n ln2 + r, |r| <= ln2/2, a
 * degree-6 polynomial for e^r, 2^n put into the exponent bits. Branch-free, so the loops that
 * call it vectorize (the C library's expf does not). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

#define MAX_VECS (MAX_DIM / LANES)

/* Softmax numerators of `keys` scores in place; returns 1 / their sum. */
static inline float softmax(float *s, int64_t keys) {
    float top = -INFINITY;
    for (int64_t x = 0; x < keys; x++) top = s[x] > top ? s[x] : top;
    vf sums = {0};
    int64_t x = 0;
    for (; x + LANES <= keys; x += LANES) {
        vf v;
        memcpy(&v, s + x, sizeof v);
        v = vexp_nonpositive(v - top);
        memcpy(s + x, &v, sizeof v);
        sums += v;
    }
    float sum = hsum(sums);
    for (; x < keys; x++) {
        s[x] = exp_nonpositive(s[x] - top);
        sum += s[x];
    }
    return 1.f / sum;
}

/* bf16: the softmax numerators rounded to bf16 before they weight the values, their sum kept
 * from the unrounded ones, as torch's CPU flash attention (generate()'s decode) rounds them. */
static inline void round_weights(float *w, int64_t n) {
    for (int64_t x = 0; x < n; x++) w[x] = widen(narrow(w[x]));
}

/* One head's output: its value sums times 1 / the softmax sum, float32 or rounded to bf16. */
static inline void store_head(void *out, int64_t at, const vf *o, float inv, const int vecs,
                              const int bf16) {
    for (int c = 0; c < vecs; c++) {
        const vf r = o[c] * inv;
        if (bf16) {
            for (int l = 0; l < LANES; l++) ((uint16_t *)out)[at + c * LANES + l] = narrow(r[l]);
        } else {
            memcpy((float *)out + at + c * LANES, &r, sizeof r);
        }
    }
}

/* The outputs of query heads g .. g + n - 1 of a task: one pass over its value rows, each row
 * read once for the n heads, weighted by their softmax numerators (`scores`, `keys` a head);
 * n (at most 3), `vecs` and `bf16` are constants where it is inlined. */
static inline __attribute__((always_inline)) void values(const job_t *a, const int64_t *rows,
                                                         const float *scores, int64_t keys,
                                                         const float *inv, int64_t out_head,
                                                         int g, const int n, const int vecs,
                                                         const int bf16) {
    const int dim = vecs * LANES;
    vf o[3][vecs];
    for (int h = 0; h < n; h++)
        for (int c = 0; c < vecs; c++) o[h][c] = (vf){0};
    for (int64_t y = 0; y < keys; y++)
        for (int c = 0; c < vecs; c++) {
            const vf v = vload_any(a->v, rows[y] + c * LANES, bf16);
            for (int h = 0; h < n; h++) o[h][c] += scores[(g + h) * keys + y] * v;
        }
    for (int h = 0; h < n; h++)
        store_head(a->out, out_head + (g + h) * dim, o[h], inv[g + h], vecs, bf16);
}

/* One task, for a head size that is a multiple of LANES: `vecs` (dim / LANES) and `bf16` are
 * constants in each build below (always inlined), so the head's loops unroll; `work` holds
 * keys int64 and group * keys floats. */
static inline __attribute__((always_inline)) void attend(const job_t *a, int task, float *work,
                                                         const int vecs, const int bf16) {
    const int i = task / a->kv_heads, kvh = task % a->kv_heads;
    const int group = a->heads / a->kv_heads, bs = a->block_size, dim = vecs * LANES;
    const int64_t len = a->lens[i];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t keys = len - lo;
    const int64_t *table = a->blocks + (int64_t)i * a->max_blocks;
    const int64_t head = kvh * a->kv_head;
    int64_t *rows = (int64_t *)work; /* each key's row, found once through the block table */
    float *scores = (float *)(rows + keys);
    vf q[group][vecs];
    float inv[group];
    for (int g = 0; g < group; g++) {
        const int64_t qoff = i * a->q_row + (int64_t)(kvh * group + g) * a->q_head;
        for (int c = 0; c < vecs; c++) q[g][c] = vload_any(a->q, qoff + c * LANES, bf16) * a->scale;
    }
    int64_t j = 0;
    for (int64_t p = lo; p < len;) {
        const int64_t off = p % bs, run = bs - off < len - p ? bs - off : len - p;
        const int64_t first = head + (table[p / bs] * bs + off) * dim;
        for (int64_t r = 0; r < run; r++, j++) rows[j] = first + r * dim;
        p += run;
    }
    /* Scores: each key row once, against every query head of the group; each value row is
     * fetched beside its key row, as the second pass wants it (two streams keep more reads in
     * flight than one: 1.1-1.2x here), and the key row KEY_AHEAD keys on, across the block
     * boundaries the CPU's own prefetcher stops at. Both into L2, not L1 (locality 1), so
     * more reads stay in flight (a prefetch to L1 likely holds one of the core's few L1 miss
     * buffers until its line arrives): L2 and 32 keys ahead rather than L1 and 8 made the
     * kernel 1.07-1.25x faster over blocks in order, 1.24-1.46x over scattered ones (Zen 4). */
    for (int64_t x = 0; x < keys; x++) {
        const char *vrow = (const char *)a->v + rows[x] * (bf16 ? 2 : 4);
        for (int c = 0; c < dim * (bf16 ? 2 : 4); c += 64) __builtin_prefetch(vrow + c, 0, 1);
        if (x + KEY_AHEAD < keys) {
            const char *krow = (const char *)a->k + rows[x + KEY_AHEAD] * (bf16 ? 2 : 4);
            for (int c = 0; c < dim * (bf16 ? 2 : 4); c += 64) __builtin_prefetch(krow + c, 0, 1);
        }
        vf k[vecs];
        for (int c = 0; c < vecs; c++) k[c] = vload_any(a->k, rows[x] + c * LANES, bf16);
        for (int g = 0; g < group; g++) {
            vf acc = q[g][0] * k[0];
            for (int c = 1; c < vecs; c++) acc += q[g][c] * k[c];
            scores[g * keys + x] = hsum(acc);
        }
    }
    for (int g = 0; g < group; g++) inv[g] = softmax(scores + g * keys, keys);
    if (bf16) round_weights(scores, group * keys);
    /* Values: the sums in registers (the task's rows stay in cache); three heads a pass (head
     * size 64) or two where the CPU has the registers (AVX-512), each value row then read a
     * third or half as often. */
    const int64_t out_head = ((int64_t)i * a->heads + kvh * group) * dim;
    int g = 0;
#ifdef __AVX512F__
    if (vecs <= 4) /* three heads' sums and a value row: 16 of the 32 registers */
        for (; g + 3 <= group; g += 3) values(a, rows, scores, keys, inv, out_head, g, 3, vecs, bf16);
    for (; g + 2 <= group; g += 2) values(a, rows, scores, keys, inv, out_head, g, 2, vecs, bf16);
#endif
    for (; g < group; g++) values(a, rows, scores, keys, inv, out_head, g, 1, vecs, bf16);
}

/* The same for any head size, one element at a time. */
static void attend_any(const job_t *a, int task, float *work) {
    const int i = task / a->kv_heads, kvh = task % a->kv_heads;
    const int group = a->heads / a->kv_heads, bs = a->block_size, dim = a->dim, bf16 = a->bf16;
    const int64_t len = a->lens[i];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t keys = len - lo;
    const int64_t *table = a->blocks + (int64_t)i * a->max_blocks;
    const int64_t head = kvh * a->kv_head;
    float *scores = work, *q = work + group * keys, *o = q + dim;
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        const int64_t qoff = i * a->q_row + (int64_t)h * a->q_head;
        for (int d = 0; d < dim; d++) q[d] = load(a->q, qoff + d, bf16) * a->scale;
        float *s = scores + g * keys;
        for (int64_t x = 0; x < keys; x++) {
            const int64_t p = lo + x, row = head + (table[p / bs] * bs + p % bs) * dim;
            float acc = 0.f;
            for (int d = 0; d < dim; d++) acc += q[d] * load(a->k, row + d, bf16);
            s[x] = acc;
        }
        const float inv = softmax(s, keys);
        if (bf16) round_weights(s, keys);
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (int64_t x = 0; x < keys; x++) {
            const int64_t p = lo + x, row = head + (table[p / bs] * bs + p % bs) * dim;
            for (int d = 0; d < dim; d++) o[d] += s[x] * load(a->v, row + d, bf16);
        }
        const int64_t ooff = ((int64_t)i * a->heads + h) * dim;
        for (int d = 0; d < dim; d++) {
            if (bf16)
                ((uint16_t *)a->out)[ooff + d] = narrow(o[d] * inv);
            else
                ((float *)a->out)[ooff + d] = o[d] * inv;
        }
    }
}

typedef void (*task_fn)(const job_t *, int, float *);

static void f32_64(const job_t *a, int t, float *w) { attend(a, t, w, 4, 0); }
static void f32_128(const job_t *a, int t, float *w) { attend(a, t, w, 8, 0); }
static void bf16_64(const job_t *a, int t, float *w) { attend(a, t, w, 4, 1); }
static void bf16_128(const job_t *a, int t, float *w) { attend(a, t, w, 8, 1); }

int batchd_decode_attention(const batchd_decode_args *args) {
    const job_t a = *args;
    const int dim = a.dim, n = a.n, heads = a.heads, kv_heads = a.kv_heads, bf16 = a.bf16;
    const int64_t *lens = a.lens;
    int threads = a.threads;
    if (dim > MAX_DIM) return 2;
    const task_fn fn = dim == 64    ? (bf16 ? bf16_64 : f32_64)
                       : dim == 128 ? (bf16 ? bf16_128 : f32_128)
                                    : attend_any;
    int64_t longest = 1;
    for (int i = 0; i < n; i++)
        if (lens[i] > longest) longest = lens[i];
    const size_t words = (size_t)(heads / kv_heads + 2) * (size_t)longest + 2 * (size_t)dim;
    const int tasks = n * kv_heads;
    if (threads > tasks) threads = tasks;
    int failed = 0;
    if (threads <= 1) {
        float *work = malloc(sizeof(float) * words);
        if (work == NULL) return 1;
        for (int t = 0; t < tasks; t++) fn(&a, t, work);
        free(work);
        return 0;
    }
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *work = malloc(sizeof(float) * words);
        failed = work == NULL;
        /* Every thread takes part in the loop (a worksharing loop must be met by all); one
         * without scratch memory skips its tasks and the call reports it. */
#pragma omp for schedule(dynamic, 1)
        for (int t = 0; t < tasks; t++)
            if (work != NULL) fn(&a, t, work);
        free(work);
    }
    return failed;
}
