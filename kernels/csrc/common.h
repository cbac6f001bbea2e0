/* Shared by the native CPU kernels (layerscope.kernels.cpu_native builds every *.c here into
 * one library): bf16 <-> fp32 conversions that round like torch, the exp used by softmax
 * and SiLU, the AVX-512 BF16 vector helpers, and the exported kernels' prototypes (the
 * decode stack calls the others). Static inline only: each file gets its own copy. */
#ifndef LAYERSCOPE_CPU_KERNELS_H
#define LAYERSCOPE_CPU_KERNELS_H

#include <math.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, like torch */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Round to bf16 and back, branch-free for finite inputs (vectorizes; scores are finite). */
static inline float round_bf16_finite(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    bits &= 0xffff0000u;
    memcpy(&f, &bits, 4);
    return f;
}

/* exp(x) for x in [-87.3, 88.8]: Cody-Waite reduction and a degree-6 polynomial, ~1 ulp
 * in float32; pure arithmetic so that loops over it vectorize. 2^n is applied as
 * 2^(n-1) * 2 so that n = 128 is reachable (overflow to inf above ~88.72); n = -126
 * gives 0 (expf's denormal tail, ~1e-38, is dropped). */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f /* ln 2 split for the reduction r = x - n ln 2 */
#define EXP_LN2_LO -2.12194440e-4f
static const float EXP_POLY[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                                  4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_core(float x) {
    const float n = (x * EXP_LOG2E + 12582912.0f) - 12582912.0f; /* rint via 1.5 * 2^23 */
    const float r = (x - n * EXP_LN2_HI) - n * EXP_LN2_LO;
    float p = EXP_POLY[0];
    for (int i = 1; i < 6; i++) p = p * r + EXP_POLY[i];
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 126) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale * 2.0f;
}

/* exp(x) for x <= 0 (softmax after the max is subtracted) */
static inline float exp_nonpos(float x) { return exp_core(x < -87.3f ? -87.3f : x); }

/* exp(x) for any x (silu): saturates like expf, to inf above ~88.72 and 0 below -87.3 */
static inline float exp_any(float x) { return exp_core(x < -87.3f ? -87.3f : (x > 88.8f ? 88.8f : x)); }

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* bf16 vector helpers: 16 lanes; vcvtneps2bf16 rounds to nearest even like torch's cast
 * (denormal inputs aside, which it flushes). */
#define VEC_BF16 1
static inline __m512 ld16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline void st16(uint16_t *p, __m512 v) { _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v)); }
static inline __m512 rd16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
/* exp_any, 16 lanes (exp_core's method and constants) */
static inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.8f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_HI))),
                                   _mm512_mul_ps(n, _mm512_set1_ps(EXP_LN2_LO)));
    __m512 p = _mm512_set1_ps(EXP_POLY[0]);
    for (int i = 1; i < 6; i++) p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(EXP_POLY[i]));
    p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(126)), 23);
    return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(e)), _mm512_set1_ps(2.0f));
}
#else
#define VEC_BF16 0
#endif

/* the AVX-512 BF16 fast paths (attention, GEMM, decode stack) */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#else
#define HAVE_AVX512_BF16 0
#endif

/* ---- the exported kernels (ctypes signatures in cpu_native.py) ---- */
/* elementwise.c */
int rms_norm(int dt, const void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
             void *out, void *res_out, int64_t T, int64_t H, float eps, int nt);
int rotary(int dt, const void *q, int64_t q_stride, int64_t NQ, const void *k, int64_t k_stride, int64_t NK,
           const int64_t *positions, const float *cos_sin, void *q_out, void *k_out, int64_t T, int64_t D, int nt);
int rotary_write_kv(int dt, const void *q, int64_t q_stride, int64_t NQ, const void *k, int64_t k_stride,
                    const void *v, int64_t v_stride, int64_t NK, const int64_t *positions, const float *cos_sin,
                    void *q_out, void *k_cache, void *v_cache, const int64_t *slots, int64_t T, int64_t D,
                    int64_t num_slots, int nt);
int silu_and_mul(int dt, const void *x, int64_t x_stride, void *out, int64_t T, int64_t I, int nt);
int write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
             const int64_t *slots, int64_t T, int64_t row, int64_t elem, int64_t num_slots);
int argmax_rows(const float *x, int64_t ld, int64_t N, int64_t V, int64_t *out, int nt);
/* attention.c */
int decode_attention(int dtype, const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     void *out, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t BS,
                     float scale, int num_threads, int generic);
/* gemm.c */
int linear_bf16(const uint16_t *A, int64_t lda, const uint16_t *Wp, const uint16_t *bias, void *C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, int nt, int out_f32, int silu_mul);
int has_avx512_bf16(void);

#endif
