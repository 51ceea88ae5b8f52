/* Sixteen-float vectors for the CPU kernels (GCC and Clang lower them to what the CPU has: one
 * AVX-512 register, two AVX ones, four SSE ones) and the exponential they share. Included by
 * the kernels' C files; engine/cpu/kernels.py digests it into each build's name. */
#ifndef BATCHD_VECTOR_H
#define BATCHD_VECTOR_H
#include <stdint.h>

typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64)));
#define LANES 16

static inline vf vload(const float *p) {
    vf v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline void vstore(float *p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

/* bfloat16 elements (the upper half of a float32): widened exactly; narrowed to the nearest
 * even, NaN kept a NaN. */
typedef uint16_t vh __attribute__((vector_size(32), aligned(2)));
typedef uint32_t vu __attribute__((vector_size(64)));

static inline float widen(uint16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t narrow(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Element i of a float32 or (bf16 set) bfloat16 array, as a float. */
static inline float load(const void *base, int64_t i, int bf16) {
    return bf16 ? widen(((const uint16_t *)base)[i]) : ((const float *)base)[i];
}

/* Sixteen elements from i of a float32 or (bf16 set) bfloat16 array, as floats. */
static inline vf vload_any(const void *base, int64_t i, const int bf16) {
    vf f;
    if (bf16) {
        vh h;
        __builtin_memcpy(&h, (const uint16_t *)base + i, sizeof h);
        const vu u = __builtin_convertvector(h, vu) << 16;
        __builtin_memcpy(&f, &u, sizeof f);
    } else {
        __builtin_memcpy(&f, (const float *)base + i, sizeof f);
    }
    return f;
}

/* Sixteen finite floats rounded to the nearest even bfloat16, kept as floats. */
static inline vf vround_bf16(vf x) {
    vu u = (vu)x;
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (vf)u;
}

/* Keeps vector v in a register for the statements after it: a compiler that folds its load
 * into each multiply-add reading it loads it again for every one (the load ports then bind).
 * Only where sixteen floats are one register (AVX-512). */
#if defined(__x86_64__) && defined(__AVX512F__)
#define PIN(v) __asm__("" : "+v"(v))
#else
#define PIN(v) ((void)0)
#endif

/* 1 where sixteen floats are one register (AVX-512). Kernels that hold many vectors at once
 * (the GEMM's tiles, the prefill kernel's row blocks) spill without it and are slower than
 * torch's own operators there: their libraries report this so the engine does not call them. */
static inline int one_register_vectors(void) {
#ifdef __AVX512F__
    return 1;
#else
    return 0;
#endif
}

/* e^x for x in [-87, 88] given n, x / ln2 rounded to an integer: x = n ln2 + r, a degree-6
 * polynomial for e^r (about 1 ulp), 2^n put into the exponent bits. Callers clamp x and round
 * n as their range needs. */
static inline vf vexp_reduced(vf x, vi n_int) {
    const vf n = __builtin_convertvector(n_int, vf);
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = (vf){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((n_int + 127) << 23);
}

/* The sum of a vector's lanes, in a fixed order. */
static inline float hsum(vf v) {
#if defined(__clang__) || __GNUC__ >= 12
    typedef float v8 __attribute__((vector_size(32)));
    typedef float v4 __attribute__((vector_size(16)));
    const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                 __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
#else
    float s = 0.f;
    for (int l = 0; l < LANES; l++) s += v[l];
    return s;
#endif
}

/* e^x for x <= 0 (a score less the largest) on sixteen lanes, x clamped at -87: the decode
 * kernel's scalar exp_nonpositive (n rounded the other way at exact halves). */
static inline vf vexp_nonpositive(vf x) {
    const vf low = (vf){0} - 87.0f;
    const vi under = x < low;
    x = (vf)(((vi)x & ~under) | ((vi)low & under));
    const vi neg_n = __builtin_convertvector(0.5f - x * 1.44269504088896341f, vi);
    return vexp_reduced(x, -neg_n);
}
#endif
