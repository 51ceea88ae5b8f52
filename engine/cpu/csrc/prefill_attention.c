/* Causal attention of one prefill chunk: queries at positions first_pos .. first_pos + n_q - 1
 * of a sequence, each attending every key up to its own position. The keys and values are read
 * in place, from the paged cache through the sequence's block table or, for a chunk that starts
 * its sequence, from the step's own strided K/V tensors. float32 or bfloat16 tensors: bf16 is
 * widened on load and every sum kept in float32; the softmax numerators are rounded to bf16
 * before they weight the values, and the output at the end, where torch's CPU flash attention
 * (generate()'s) rounds them.
 *
 * Flash attention in blocks: the keys of each KV head are first transposed into blocks of 64,
 * [dim][64] each (each key row read once per call); a task is then (KV head, QB query positions):
 * the group's query heads at those positions, group x QB rows, score 64 keys at a time
 * (register-blocked rows x 64 keys), fold them into a running softmax (float32, the largest
 * score so far subtracted) and add the weighted values (rows x dim in registers). Only the
 * blocks a row's position reaches are scored; the diagonal block is masked. Tasks run on
 * torch's OpenMP team, the longest first.
 *
 * The keys are transposed TILE_KEYS at a time, and every task runs over one tile before the
 * next is transposed: the transposed keys a calling thread keeps between calls are bounded by
 * the tile (batchd_prefill_attention_bound), whatever the prompt's length, and the engine
 * counts that bound in its memory budget. A task's running softmax carries across tiles
 * exactly (its sums in `out`, its maximum and denominator in a per-call array), over the same
 * blocks in the same order, so the output is the same to the bit for any tile size.
 *
 * Built and loaded by engine/cpu/kernels.py. Returns 0, 1 when scratch memory could not be
 * had, 2 for a head size this build has no loop for (16, 32, 64 and 128 have). Without
 * AVX-512 the sixteen-float vectors are pairs of registers that the row blocks spill (many
 * times slower than torch's flash operator on AVX2), so such a build says it is not worth calling:
 * batchd_prefill_attention_fast() is 0 there, and the engine keeps torch's operator. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "batchd.h"
#include "vector.h"

#define KB 64              /* keys a block */
#define KV (KB / LANES)    /* vectors of scores a row holds for one block */
#define QB 16              /* query positions a task */
#ifndef TILE_KEYS
#define TILE_KEYS 2048 /* keys transposed at a time (a multiple of KB; a build may set another) */
#endif
#if TILE_KEYS % KB || TILE_KEYS <= 0
#error "TILE_KEYS must be a positive multiple of KB"
#endif
#ifdef __AVX512F__
#define QK_ROWS 6 /* rows scored at once: 6 x 4 accumulators */
#define PV_ROWS 6 /* rows of values summed at once (head size 64; 3 for 128) */
#else
#define QK_ROWS 2
#define PV_ROWS 2
#endif

typedef struct {
    const void *q; /* position t, head h at q + t * q_row + h * q_head (elements); dim contiguous */
    int64_t q_row, q_head;
    const void *k, *v; /* key j of KV head h at k + h * kv_head + rows[j - tile0] */
    int64_t kv_head;
    const int64_t *rows; /* the tile's keys */
    const float *kt; /* [kv_heads][kcap / KB][dim][KB]: the tile's blocks of keys transposed,
                      * zero past `keys` (a block's 16 KiB contiguous, never a long stride) */
    int64_t kcap;    /* keys a tile holds */
    int64_t tile0, tile_end; /* the keys of this tile */
    int64_t first_pos, keys; /* keys = first_pos + n_q */
    int n_q, heads, kv_heads, dim;
    float scale;
    void *out; /* position t, head h at out + t * out_row + h * dim */
    int64_t out_row;
    float *carry; /* over more than one tile: position t, head h's running maximum and
                   * denominator at carry + 2 (t * heads + h) */
    float *sums;  /* over more than one tile: its value sums, at sums + t * sum_row + h * dim
                   * (`out` itself in float32, a float32 buffer beside it in bf16) */
    int64_t sum_row;
    int bf16; /* q, k, v and out are bfloat16 */
} job_t;

static inline vf vmax(vf a, vf b) {
    const vi more = a > b;
    return (vf)(((vi)a & more) | ((vi)b & ~more));
}

static inline float hmax(vf v) {
#if defined(__clang__) || __GNUC__ >= 12
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
    return v[0];
#else
    float m = v[0];
    for (int l = 1; l < LANES; l++) m = v[l] > m ? v[l] : m;
    return m;
#endif
}

/* s[r][0..KB) = q[r] . the block's keys, rows r0 .. r0 + QK_ROWS; `kt` the block's [dim][KB]. */
static inline __attribute__((always_inline)) void score(const float *q, const float *kt, int dim,
                                                        float *s) {
    vf acc[QK_ROWS][KV];
    for (int r = 0; r < QK_ROWS; r++)
        for (int c = 0; c < KV; c++) acc[r][c] = (vf){0};
    for (int d = 0; d < dim; d++) {
        const float *row = kt + d * KB;
        vf k[KV];
        for (int c = 0; c < KV; c++) {
            k[c] = vload(row + c * LANES);
            PIN(k[c]); /* loaded once for all the rows */
        }
        for (int r = 0; r < QK_ROWS; r++) {
            const float x = q[r * dim + d];
            for (int c = 0; c < KV; c++) acc[r][c] += x * k[c];
        }
    }
    for (int r = 0; r < QK_ROWS; r++)
        for (int c = 0; c < KV; c++) vstore(s + r * KB + c * LANES, acc[r][c]);
}

/* o[r] += sum_j p[r][j] v[j], rows r0 .. r0 + ROWS, keys 0 .. n. */
static inline __attribute__((always_inline)) void weigh(const float *p, const void *v,
                                                        const int64_t *rows, int n, float *o,
                                                        const int vecs, const int nrows,
                                                        const int bf16) {
    vf acc[PV_ROWS][8]; /* fixed sizes: the loops unroll onto registers */
    for (int r = 0; r < nrows; r++)
        for (int c = 0; c < vecs; c++) acc[r][c] = vload(o + r * vecs * LANES + c * LANES);
    for (int j = 0; j < n; j++) {
        vf x[8];
        for (int c = 0; c < vecs; c++) x[c] = vload_any(v, rows[j] + c * LANES, bf16);
        for (int r = 0; r < nrows; r++) {
            const float w = p[r * KB + j];
            for (int c = 0; c < vecs; c++) acc[r][c] += w * x[c];
        }
    }
    for (int r = 0; r < nrows; r++)
        for (int c = 0; c < vecs; c++) vstore(o + r * vecs * LANES + c * LANES, acc[r][c]);
}

/* One task over the keys of the current tile: KV head h, query positions t0 .. t1. `work`
 * holds nrows x (2 dim + KB + 4) floats; nrows is group x QB rounded up to a multiple of
 * QK_ROWS and PV rows (the rows past group x (t1 - t0) are zero queries whose results are
 * dropped). A task whose keys go on past the tile leaves its running sums where the next tile
 * takes them up: the value sums in its rows of `out`, the maximum and denominator in `carry`. */
static inline __attribute__((always_inline)) void attend(const job_t *a, int h, int64_t t0,
                                                         int64_t t1, int nrows, float *work,
                                                         const int vecs, const int pv_rows,
                                                         const int bf16) {
    const int dim = vecs * LANES, group = a->heads / a->kv_heads, span = (int)(t1 - t0);
    const int64_t end = a->first_pos + t1; /* keys the task's last position sees */
    if (a->tile0 >= end) return;           /* a tile past them: the task is done */
    const int resume = a->tile0 > 0, done = end <= a->tile_end;
    float *q = work, *s = q + nrows * dim, *o = s + nrows * KB, *m = o + nrows * dim;
    float *l = m + nrows;
    int64_t *last = (int64_t *)(l + nrows); /* each row's last key (its position) */
    for (int r = 0; r < nrows; r++) {
        const int g = r / span, t = r % span;
        float *qr = q + r * dim;
        if (g < group) {
            const int64_t src = (t0 + t) * a->q_row + (int64_t)(h * group + g) * a->q_head;
            for (int d = 0; d < dim; d++) qr[d] = load(a->q, src + d, bf16) * a->scale;
            last[r] = a->first_pos + t0 + t;
            if (resume) { /* the sums of the tiles before */
                const int64_t at = (t0 + t) * a->heads + h * group + g;
                memcpy(o + r * dim, a->sums + (t0 + t) * a->sum_row + (int64_t)(h * group + g) * dim,
                       sizeof(float) * (size_t)dim);
                m[r] = a->carry[2 * at];
                l[r] = a->carry[2 * at + 1];
                continue;
            }
        } else {
            memset(qr, 0, sizeof(float) * (size_t)dim);
            last[r] = a->first_pos + t0;
        }
        memset(o + r * dim, 0, sizeof(float) * (size_t)dim);
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const float *kt = a->kt + (int64_t)h * dim * a->kcap;
    const void *v = bf16 ? (const void *)((const uint16_t *)a->v + h * a->kv_head)
                         : (const void *)((const float *)a->v + h * a->kv_head);
    const int64_t stop = done ? end : a->tile_end; /* a tile ends on a block boundary */
    for (int64_t j0 = a->tile0; j0 < stop; j0 += KB) {
        const int n = end - j0 < KB ? (int)(end - j0) : KB;
        const float *block = kt + (j0 - a->tile0) * dim;
        for (int r = 0; r < nrows; r += QK_ROWS) score(q + r * dim, block, dim, s + r * KB);
        for (int r = 0; r < nrows; r++) {
            float *sr = s + r * KB;
            const int64_t allowed = last[r] - j0 + 1; /* keys of this block the row sees */
            if (allowed <= 0) { /* a row whose position the block is past: weights zero */
                memset(sr, 0, sizeof(float) * KB);
                continue;
            }
            if (allowed < KB)
                for (int j = (int)allowed; j < KB; j++) sr[j] = -INFINITY;
            vf top = vload(sr);
            for (int c = 1; c < KV; c++) top = vmax(top, vload(sr + c * LANES));
            const float mx = hmax(top), m_new = mx > m[r] ? mx : m[r];
            const float alpha = m[r] == -INFINITY ? 0.f : expf(m[r] - m_new);
            vf sum = {0};
            for (int c = 0; c < KV; c++) {
                vf p = vexp_nonpositive(vload(sr + c * LANES) - m_new);
                if (allowed < (c + 1) * LANES) /* masked lanes: exactly zero */
                    for (int x = 0; x < LANES; x++)
                        if (c * LANES + x >= allowed) p[x] = 0.f;
                vstore(sr + c * LANES, bf16 ? vround_bf16(p) : p);
                sum += p;
            }
            l[r] = l[r] * alpha + hsum(sum);
            if (alpha != 1.f) {
                float *orow = o + r * dim;
                for (int c = 0; c < vecs; c++) vstore(orow + c * LANES, vload(orow + c * LANES) * alpha);
            }
            m[r] = m_new;
        }
        for (int r = 0; r < nrows; r += pv_rows)
            weigh(s + r * KB, v, a->rows + (j0 - a->tile0), n, o + r * dim, vecs, pv_rows, bf16);
    }
    if (!done) {
        for (int r = 0; r < group * span; r++) {
            const int g = r / span, t = r % span;
            const int64_t at = (t0 + t) * a->heads + h * group + g;
            memcpy(a->sums + (t0 + t) * a->sum_row + (int64_t)(h * group + g) * dim, o + r * dim,
                   sizeof(float) * (size_t)dim);
            a->carry[2 * at] = m[r];
            a->carry[2 * at + 1] = l[r];
        }
        return;
    }
    for (int r = 0; r < group * span; r++) {
        const int g = r / span, t = r % span;
        const int64_t at = (t0 + t) * a->out_row + (int64_t)(h * group + g) * dim;
        const float inv = 1.f / l[r];
        for (int c = 0; c < vecs; c++) {
            const vf x = vload(o + r * dim + c * LANES) * inv;
            if (bf16)
                for (int e = 0; e < LANES; e++) ((uint16_t *)a->out)[at + c * LANES + e] = narrow(x[e]);
            else
                vstore((float *)a->out + at + c * LANES, x);
        }
    }
}

/* One build of `attend` a head size and element type: the loops unroll on constants. */
#define TASK(name, vecs, pv_rows, bf16)                                                        \
    static void name(const job_t *a, int h, int64_t t0, int64_t t1, int nrows, float *w) {    \
        attend(a, h, t0, t1, nrows, w, vecs, pv_rows, bf16);                                  \
    }
TASK(f32_16, 1, PV_ROWS, 0)
TASK(f32_32, 2, PV_ROWS, 0)
TASK(f32_64, 4, PV_ROWS, 0)
TASK(f32_128, 8, PV_ROWS > 3 ? 3 : PV_ROWS, 0)
TASK(bf16_16, 1, PV_ROWS, 1)
TASK(bf16_32, 2, PV_ROWS, 1)
TASK(bf16_64, 4, PV_ROWS, 1)
TASK(bf16_128, 8, PV_ROWS > 3 ? 3 : PV_ROWS, 1)

/* Scratch a calling thread keeps between calls, at most one tile (TILE_KEYS keys): the
 * transposed keys (kv_heads x dim x TILE_KEYS floats) and the key rows' offsets. Freed when the
 * thread exits (or by batchd_prefill_attention_release); `held` counts every thread's. */
typedef struct {
    void *kt, *rows;
    size_t kt_bytes, rows_bytes;
} scratch_t;

static size_t held; /* bytes, updated atomically */
static pthread_key_t scratch_key;
static pthread_once_t scratch_once = PTHREAD_ONCE_INIT;
static int scratch_key_made;

static void drop_scratch(void *p) {
    scratch_t *s = p;
    __atomic_sub_fetch(&held, s->kt_bytes + s->rows_bytes, __ATOMIC_RELAXED);
    free(s->kt);
    free(s->rows);
    free(s);
}

static void make_scratch_key(void) {
    scratch_key_made = pthread_key_create(&scratch_key, drop_scratch) == 0;
}

/* This thread's scratch, NULL where it cannot be had. */
static scratch_t *scratch(void) {
    pthread_once(&scratch_once, make_scratch_key);
    if (!scratch_key_made) return NULL;
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s == NULL && (s = calloc(1, sizeof *s)) != NULL && pthread_setspecific(scratch_key, s)) {
        free(s);
        s = NULL;
    }
    return s;
}

static int reserve(void **buf, size_t *cap, size_t bytes) {
    if (bytes <= *cap) return 0;
    free(*buf); /* nothing in it is kept between calls */
    __atomic_sub_fetch(&held, *cap, __ATOMIC_RELAXED);
    *buf = malloc(bytes);
    *cap = *buf == NULL ? 0 : bytes;
    __atomic_add_fetch(&held, *cap, __ATOMIC_RELAXED);
    return *buf == NULL;
}

int batchd_prefill_attention_fast(void) { return one_register_vectors(); }

/* Bytes of scratch a calling thread keeps, at most, for this shape. */
int64_t batchd_prefill_attention_bound(int32_t kv_heads, int32_t dim) {
    return (int64_t)sizeof(float) * kv_heads * dim * TILE_KEYS + (int64_t)sizeof(int64_t) * TILE_KEYS;
}

/* Bytes of scratch every thread keeps now. */
int64_t batchd_prefill_attention_held(void) {
    return (int64_t)__atomic_load_n(&held, __ATOMIC_RELAXED);
}

/* Frees the calling thread's scratch (the next call takes it again). */
void batchd_prefill_attention_release(void) {
    pthread_once(&scratch_once, make_scratch_key);
    if (!scratch_key_made) return;
    scratch_t *s = pthread_getspecific(scratch_key);
    if (s != NULL && pthread_setspecific(scratch_key, NULL) == 0) drop_scratch(s);
}

int batchd_prefill_attention(const batchd_prefill_args *args) {
    const void *q = args->q, *k = args->k, *v = args->v;
    void *out = args->out;
    const int64_t q_row = args->q_row, q_head = args->q_head, kv_head = args->kv_head;
    const int64_t key_row = args->key_row, first_pos = args->first_pos, out_row = args->out_row;
    const int64_t *blocks = args->blocks;
    const int block_size = args->block_size, n_q = args->n_q, heads = args->heads;
    const int kv_heads = args->kv_heads, dim = args->dim, bf16 = args->bf16;
    const float scale = args->scale;
    int threads = args->threads;
    typedef void (*task_fn)(const job_t *, int, int64_t, int64_t, int, float *);
    const task_fn fn = bf16 ? (dim == 16 ? bf16_16 : dim == 32 ? bf16_32 : dim == 64 ? bf16_64
                               : dim == 128 ? bf16_128 : NULL)
                            : (dim == 16 ? f32_16 : dim == 32 ? f32_32 : dim == 64 ? f32_64
                               : dim == 128 ? f32_128 : NULL);
    if (fn == NULL) return 2;
    const int64_t keys = first_pos + n_q;
    const int64_t kpad = (keys + KB - 1) / KB * KB;
    const int64_t kcap = kpad < TILE_KEYS ? kpad : TILE_KEYS;
    scratch_t *mine = scratch();
    if (mine == NULL ||
        reserve(&mine->kt, &mine->kt_bytes, sizeof(float) * (size_t)kv_heads * (size_t)dim * (size_t)kcap) ||
        reserve(&mine->rows, &mine->rows_bytes, sizeof(int64_t) * (size_t)kcap))
        return 1;
    float *carry = NULL, *sums = bf16 ? NULL : (float *)out;
    int64_t sum_row = bf16 ? (int64_t)heads * dim : out_row;
    if (keys > kcap) {
        carry = malloc(sizeof(float) * 2 * (size_t)n_q * (size_t)heads);
        if (bf16 && carry != NULL && (sums = malloc(sizeof(float) * (size_t)(n_q * sum_row))) == NULL) {
            free(carry);
            return 1;
        }
        if (carry == NULL) return 1;
    }
    /* The buffers are this thread's: the team's other threads reach them through locals. */
    int64_t *rows = mine->rows;
    float *kt = mine->kt;
    const job_t base = {q,        q_row, q_head,   k,     v,     kv_head, rows,    kt,
                        kcap,     0,     0,        first_pos, keys, n_q,  heads,   kv_heads,
                        dim,      scale, out,      out_row, carry, sums,  sum_row, bf16};
    const int group = heads / kv_heads;
    const int step = QK_ROWS % PV_ROWS == 0 ? QK_ROWS : QK_ROWS * PV_ROWS; /* both blocks' multiple */
    const int nrows = (group * QB + step - 1) / step * step;
    const size_t words = (size_t)nrows * (size_t)(2 * dim + KB + 2) + 2 * (size_t)nrows;
    const int qblocks = (n_q + QB - 1) / QB, tasks = qblocks * kv_heads;
    if (threads > tasks) threads = tasks;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *work = malloc(sizeof(float) * words);
        failed = work == NULL;
        /* Every thread meets every worksharing loop below, tile by tile, in the same order. */
        for (int64_t tile0 = 0; tile0 < keys; tile0 += kcap) {
            const int64_t tile_end = tile0 + kcap < keys ? tile0 + kcap : keys;
            const int64_t blocks_t = (tile_end - tile0 + KB - 1) / KB * kv_heads;
#pragma omp for schedule(static)
            for (int64_t j = tile0; j < tile_end; j++)
                rows[j - tile0] = blocks != NULL
                                      ? (blocks[j / block_size] * block_size + j % block_size) * key_row
                                      : j * key_row;
            /* Transpose each head's keys of the tile, a block of KB keys a piece; zeros past
             * the last. */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < blocks_t; b++) {
                const int h = (int)(b % kv_heads);
                const int64_t j0 = b / kv_heads * KB; /* from the tile's first key */
                float *dst = kt + (int64_t)h * dim * kcap + j0 * dim;
                for (int j = 0; j < KB; j++) {
                    if (tile0 + j0 + j < tile_end) {
                        const int64_t src = h * kv_head + rows[j0 + j];
                        for (int d = 0; d < dim; d++) dst[d * KB + j] = load(k, src + d, bf16);
                    } else {
                        for (int d = 0; d < dim; d++) dst[d * KB + j] = 0.f;
                    }
                }
            }
            job_t a = base;
            a.tile0 = tile0;
            a.tile_end = tile_end;
            /* The last query blocks see the most keys: they go first. */
#pragma omp for schedule(dynamic, 1)
            for (int t = 0; t < tasks; t++) {
                if (work == NULL) continue;
                const int h = t % kv_heads, qb = qblocks - 1 - t / kv_heads;
                const int64_t t0 = (int64_t)qb * QB, t1 = t0 + QB < n_q ? t0 + QB : n_q;
                fn(&a, h, t0, t1, nrows, work);
            }
        }
        free(work);
    }
    free(carry);
    if (bf16) free(sums);
    return failed;
}
