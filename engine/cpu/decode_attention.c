/* Decode attention over the paged KV cache: one call per layer for every decode row, for
 * float32 or bfloat16 tensors (bf16 widened on load, every sum in float32, the output rounded
 * to the nearest even bf16).
 *
 * Built and loaded by engine/cpu/kernels.py. A task is one (sequence, KV head): its query heads
 * score the sequence's keys (read in place through its block table), a two-pass softmax in
 * float32, then the weighted sum of the values. Tasks are dealt round-robin to `threads`
 * POSIX threads (the caller is one of them); a thread that cannot start leaves its tasks to
 * the caller. Returns 0, 1 when scratch memory could not be had, 2 for a head_dim over
 * MAX_DIM. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64
#define MAX_DIM 1024

typedef struct {
    const void *q; /* row i, head h at q + i * q_row + h * q_head (elements); dim contiguous */
    int64_t q_row, q_head;
    const void *k, *v; /* [KV, slots, dim]: head kvh, slot s at k + kvh * kv_head + s * dim */
    int64_t kv_head;
    const int64_t *blocks; /* [n, max_blocks] block ids of each sequence */
    int64_t max_blocks;
    const int64_t *lens; /* [n] keys of each sequence, the new token included */
    int n, heads, kv_heads, dim, block_size, window, bf16;
    float scale;
    void *out; /* [n, heads, dim] contiguous */
    int first, step;
} job_t;

static inline float widen(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline int64_t slot(const job_t *a, const int64_t *table, int64_t p) {
    return table[p / a->block_size] * a->block_size + p % a->block_size;
}

static float dot(const job_t *a, const float *q, const void *base, int64_t offset) {
    float acc = 0.f;
    const int dim = a->dim;
    if (a->bf16) {
        const uint16_t *r = (const uint16_t *)base + offset;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < dim; d++) acc += q[d] * widen(r[d]);
    } else {
        const float *r = (const float *)base + offset;
#pragma omp simd reduction(+ : acc)
        for (int d = 0; d < dim; d++) acc += q[d] * r[d];
    }
    return acc;
}

static void axpy(const job_t *a, float *o, float w, const void *base, int64_t offset) {
    const int dim = a->dim;
    if (a->bf16) {
        const uint16_t *r = (const uint16_t *)base + offset;
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] += w * widen(r[d]);
    } else {
        const float *r = (const float *)base + offset;
#pragma omp simd
        for (int d = 0; d < dim; d++) o[d] += w * r[d];
    }
}

static void run_task(const job_t *a, int task, float *scores) {
    const int i = task / a->kv_heads, kvh = task % a->kv_heads;
    const int group = a->heads / a->kv_heads, dim = a->dim;
    const int64_t len = a->lens[i];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t keys = len - lo;
    const int64_t *table = a->blocks + (int64_t)i * a->max_blocks;
    const int64_t head = kvh * a->kv_head;
    float q[MAX_DIM], o[MAX_DIM];
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        const int64_t qoff = i * a->q_row + h * a->q_head;
        for (int d = 0; d < dim; d++)
            q[d] = a->bf16 ? widen(((const uint16_t *)a->q)[qoff + d]) : ((const float *)a->q)[qoff + d];
        float *s = scores + (int64_t)g * keys;
        float top = -INFINITY;
        for (int64_t j = 0; j < keys; j++) {
            s[j] = dot(a, q, a->k, head + slot(a, table, lo + j) * dim) * a->scale;
            if (s[j] > top) top = s[j];
        }
        float sum = 0.f;
        for (int64_t j = 0; j < keys; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        const float inv = 1.f / sum;
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (int64_t j = 0; j < keys; j++)
            axpy(a, o, s[j] * inv, a->v, head + slot(a, table, lo + j) * dim);
        const int64_t ooff = ((int64_t)i * a->heads + h) * dim;
        if (a->bf16) {
            for (int d = 0; d < dim; d++) ((uint16_t *)a->out)[ooff + d] = narrow(o[d]);
        } else {
            memcpy((float *)a->out + ooff, o, sizeof(float) * (size_t)dim);
        }
    }
}

static void *worker(void *arg) {
    const job_t *a = (const job_t *)arg;
    int64_t longest = 1;
    for (int i = 0; i < a->n; i++)
        if (a->lens[i] > longest) longest = a->lens[i];
    float *scores = malloc(sizeof(float) * (size_t)(a->heads / a->kv_heads) * (size_t)longest);
    if (scores == NULL) return (void *)1;
    for (int t = a->first; t < a->n * a->kv_heads; t += a->step) run_task(a, t, scores);
    free(scores);
    return NULL;
}

int batchd_decode_attention(const void *q, int64_t q_row, int64_t q_head, const void *k,
                            const void *v, int64_t kv_head, const int64_t *blocks,
                            int64_t max_blocks, const int64_t *lens, int n, int heads,
                            int kv_heads, int dim, int block_size, int window, int bf16,
                            float scale, void *out, int threads) {
    if (dim > MAX_DIM) return 2;
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n * kv_heads) threads = n * kv_heads > 0 ? n * kv_heads : 1;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int rc = 0;
    for (int t = 0; t < threads; t++)
        jobs[t] = (job_t){q, q_row, q_head, k, v, kv_head, blocks, max_blocks, lens, n, heads,
                          kv_heads, dim, block_size, window, bf16, scale, out, t, threads};
    for (int t = 1; t < threads; t++)
        started[t] = pthread_create(&ids[t], NULL, worker, &jobs[t]) == 0;
    for (int t = 0; t < threads; t++)
        if (t == 0 || !started[t]) rc |= worker(&jobs[t]) != NULL;
    for (int t = 1; t < threads; t++) {
        void *failed = NULL;
        if (started[t]) pthread_join(ids[t], &failed);
        rc |= failed != NULL;
    }
    return rc;
}
