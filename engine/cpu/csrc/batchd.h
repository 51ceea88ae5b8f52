/* The interface of batchd's CPU kernels: every function the engine calls, and the argument
 * struct of each call that takes more than a few arguments. engine/cpu/abi.py declares the
 * same structs and prototypes for ctypes, once; tests/engine/cpu/test_kernel_abi.py reads this
 * header and checks that they agree, field by field.
 *
 * Element types: `bf16` set, the tensors a call names as `void *` hold bfloat16 (uint16_t),
 * otherwise float32. Strides are in elements. `threads` is the OpenMP team a call may use
 * (torch's own runtime: the libraries are loaded after torch). Functions that can fail return
 * 0, 1 when scratch memory could not be had, 2 for a shape they have no loop for. */
#ifndef BATCHD_H
#define BATCHD_H
#include <stdint.h>

/* Decode attention over the paged cache (decode_attention.c). */
typedef struct {
    const void *q;           /* row i, head h at q + i * q_row + h * q_head; dim contiguous */
    int64_t q_row, q_head;
    const void *k, *v;       /* [kv_heads, slots, dim]: head kvh at k + kvh * kv_head */
    int64_t kv_head;
    const int64_t *blocks;   /* [n, max_blocks] block ids of each sequence */
    int64_t max_blocks;
    const int64_t *lens;     /* [n] keys of each sequence, the new token included */
    int32_t n, heads, kv_heads, dim, block_size, window, bf16;
    float scale;
    void *out;               /* [n, heads, dim] contiguous */
    int32_t threads;
} batchd_decode_args;

int batchd_decode_attention(const batchd_decode_args *args);

/* Causal attention of one prefill chunk (prefill_attention.c). */
typedef struct {
    const void *q;           /* position t, head h at q + t * q_row + h * q_head */
    int64_t q_row, q_head;
    const void *k, *v;       /* key j of head h at k + h * kv_head + row(j) * key_row */
    int64_t kv_head, key_row;
    const int64_t *blocks;   /* the sequence's block ids, or NULL: the chunk's own keys */
    int32_t block_size;
    int64_t first_pos;       /* the chunk's first position; keys = first_pos + n_q */
    int32_t n_q, heads, kv_heads, dim;
    float scale;
    void *out;               /* position t, head h at out + t * out_row + h * dim */
    int64_t out_row;
    int32_t threads, bf16;
} batchd_prefill_args;

int batchd_prefill_attention(const batchd_prefill_args *args);
int batchd_prefill_attention_fast(void);
int64_t batchd_prefill_attention_bound(int32_t kv_heads, int32_t dim);
int64_t batchd_prefill_attention_held(void);
void batchd_prefill_attention_release(void);

/* Linear layers on weights packed once: float32 (sgemm.c), bfloat16 (bgemm.c). */
typedef struct {
    const void *a;           /* [m, k], row stride lda */
    int64_t lda;
    int32_t m, k;
    const void *packed;      /* the weight as batchd_*gemm_pack left it */
    int32_t n;
    const void *bias;        /* [n] or NULL */
    void *out;               /* [m, n], row stride ldc */
    int64_t ldc;
    int32_t threads;
} batchd_gemm_args;

void batchd_sgemm(const batchd_gemm_args *args);
void batchd_sgemm_pack(const float *w, int32_t n, int32_t k, float *out);
int batchd_sgemm_fast(void);
void batchd_bgemm(const batchd_gemm_args *args);
void batchd_bgemm_pack(const uint16_t *w, int32_t n, int32_t k, uint16_t *out);
int batchd_bgemm_fast(void);

/* A Llama layer's work between its matmuls (layer_ops.c). */
typedef struct {
    void *hidden;            /* [rows, dim], the residual stream, updated in place */
    const void *delta;       /* added to it first (row stride delta_row), or NULL */
    int64_t delta_row;
    const void *weight;      /* [dim] */
    float eps;
    int32_t rows, dim;
    void *out;               /* [rows, dim] */
    int32_t threads, bf16;
} batchd_norm_args;

typedef struct {
    void *qkv;               /* [rows, qkv_row]: q_heads, kv_heads, kv_heads heads of dim */
    int64_t qkv_row;
    int32_t rows, q_heads, kv_heads, dim;
    const void *cos, *sin;   /* [rows, dim] */
    void *k_cache, *v_cache; /* [kv_heads, slots, dim], a head every kv_head elements */
    int64_t kv_head;
    const int64_t *slots;    /* [rows] */
    int32_t threads, bf16;
} batchd_rope_args;

typedef struct {
    const void *gate_up;     /* [rows, gate_up_row]: gate, then up, `inner` each */
    int64_t gate_up_row;
    int32_t rows, inner;
    void *out;               /* [rows, inner] contiguous */
    int32_t threads, bf16;
} batchd_silu_args;

void batchd_rms_norm(const batchd_norm_args *args);
int batchd_rope_store(const batchd_rope_args *args);
void batchd_silu_mul(const batchd_silu_args *args);
void batchd_argmax(const float *x, int64_t row, int32_t rows, int64_t cols, int64_t *out,
                   int32_t threads);

#endif
