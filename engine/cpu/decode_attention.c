/* Decode attention over the paged KV cache in float32: one call per layer for every decode row.
 *
 * Built and loaded by engine/cpu/kernels.py. A task is one (sequence, KV head): its query heads
 * score the sequence's keys (read in place through its block table), a two-pass softmax in
 * float32, then the weighted sum of the values. Tasks are dealt round-robin to `threads`
 * POSIX threads (the caller is one of them); a thread that cannot start leaves its tasks to
 * the caller. Returns 0, or 1 when scratch memory could not be had. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64

typedef struct {
    const float *q; /* row i, head h at q + i * q_row + h * q_head; D contiguous floats */
    int64_t q_row, q_head;
    const float *k, *v; /* [KV, slots, D]: head kvh, slot s at k + kvh * kv_head + s * D */
    int64_t kv_head;
    const int64_t *blocks; /* [n, max_blocks] block ids of each sequence */
    int64_t max_blocks;
    const int64_t *lens; /* [n] keys of each sequence, the new token included */
    int n, heads, kv_heads, dim, block_size, window;
    float scale;
    float *out; /* [n, heads, dim] contiguous */
    int first, step;
} job_t;

static inline const float *row(const job_t *a, const float *base, const int64_t *table, int64_t p) {
    return base + (table[p / a->block_size] * a->block_size + p % a->block_size) * a->dim;
}

static void run_task(const job_t *a, int task, float *scores) {
    const int i = task / a->kv_heads, kvh = task % a->kv_heads;
    const int group = a->heads / a->kv_heads, dim = a->dim;
    const int64_t len = a->lens[i];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0;
    const int64_t keys = len - lo;
    const int64_t *table = a->blocks + (int64_t)i * a->max_blocks;
    const float *kbase = a->k + kvh * a->kv_head, *vbase = a->v + kvh * a->kv_head;
    for (int g = 0; g < group; g++) {
        const int h = kvh * group + g;
        const float *q = a->q + i * a->q_row + h * a->q_head;
        float *s = scores + (int64_t)g * keys;
        float top = -INFINITY;
        for (int64_t j = 0; j < keys; j++) {
            const float *kr = row(a, kbase, table, lo + j);
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int d = 0; d < dim; d++) acc += q[d] * kr[d];
            s[j] = acc * a->scale;
            if (s[j] > top) top = s[j];
        }
        float sum = 0.f;
        for (int64_t j = 0; j < keys; j++) {
            s[j] = expf(s[j] - top);
            sum += s[j];
        }
        const float inv = 1.f / sum;
        float *o = a->out + ((int64_t)i * a->heads + h) * dim;
        memset(o, 0, sizeof(float) * (size_t)dim);
        for (int64_t j = 0; j < keys; j++) {
            const float *vr = row(a, vbase, table, lo + j);
            const float w = s[j] * inv;
#pragma omp simd
            for (int d = 0; d < dim; d++) o[d] += w * vr[d];
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

int batchd_decode_attention_f32(const float *q, int64_t q_row, int64_t q_head, const float *k,
                                const float *v, int64_t kv_head, const int64_t *blocks,
                                int64_t max_blocks, const int64_t *lens, int n, int heads,
                                int kv_heads, int dim, int block_size, int window, float scale,
                                float *out, int threads) {
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n * kv_heads) threads = n * kv_heads > 0 ? n * kv_heads : 1;
    job_t jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    int rc = 0;
    for (int t = 0; t < threads; t++)
        jobs[t] = (job_t){q, q_row, q_head, k, v, kv_head, blocks, max_blocks, lens, n, heads,
                          kv_heads, dim, block_size, window, scale, out, t, threads};
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
