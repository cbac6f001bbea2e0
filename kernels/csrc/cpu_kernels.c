/* Native CPU kernels of the ``cpu`` backend (layerscope.kernels.cpu_native).
 *
 * Plain C with OpenMP, no torch headers: built once with the system C compiler and
 * loaded through ctypes. Every kernel has a torch reference in kernels/reference.py
 * and is tested against it (tests/kernels/test_cpu_native.py).
 *
 * Elementwise kernels (rms_norm, fused_add_rms_norm, rotary, silu_and_mul, write_kv) do
 * one pass over their rows and round exactly where torch's bf16 ops round (after each
 * op), so they agree with the reference to the ulp (float sums may associate differently).
 * They run on one thread unless the caller passes more (prefill-sized inputs).
 *
 * Paged decode attention reads K/V straight from the paged cache
 * [num_blocks, block_size, Hk, D] through the block table: no gather, no padding.
 * One task per sequence; each token's row [Hk, D] is read once for all its heads.
 * Rounding follows the reference (and HF's eager attention): scores are rounded to
 * the activation dtype before scaling and softmax (fp32), probabilities are rounded to
 * the activation dtype before P @ V, which accumulates in fp32.
 *
 * The bf16 linear layers' GEMM is here too (linear_bf16, over weights packed at load).
 */
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

/* rms_rows for bf16 with H % 16 == 0 */
static void rms_rows_bf16v(const uint16_t *x, int64_t x_stride, const uint16_t *res, int64_t res_stride,
                           const uint16_t *w, uint16_t *out, uint16_t *res_out, int64_t t0, int64_t t1, int64_t H,
                           float eps) {
    for (int64_t t = t0; t < t1; t++) {
        __m512 ss = _mm512_setzero_ps();
        const uint16_t *src = x + t * x_stride;
        if (res) {
            for (int64_t i = 0; i < H; i += 16) {
                const __m512 v = rd16(_mm512_add_ps(ld16(x + t * x_stride + i), ld16(res + t * res_stride + i)));
                st16(res_out + t * H + i, v);
                ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
            }
            src = res_out + t * H;
        } else {
            for (int64_t i = 0; i < H; i += 16) {
                const __m512 v = ld16(src + i);
                ss = _mm512_add_ps(ss, _mm512_mul_ps(v, v));
            }
        }
        const __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)H + eps));
        for (int64_t i = 0; i < H; i += 16)
            st16(out + t * H + i, _mm512_mul_ps(ld16(w + i), rd16(_mm512_mul_ps(ld16(src + i), r))));
    }
}

/* rope_rows for bf16 with D / 2 % 16 == 0 */
static void rope_rows_bf16v(const uint16_t *x, int64_t x_stride, const int64_t *positions, const float *cos_sin,
                            uint16_t *out, const int64_t *slots, int64_t t0, int64_t t1, int64_t NH, int64_t D) {
    const int64_t half = D / 2;
    const __m512 neg = _mm512_set1_ps(-0.0f);
    for (int64_t t = t0; t < t1; t++) {
        const int64_t ot = slots ? slots[t] : t; /* the output row (a cache slot; < 0: skipped) */
        if (ot < 0) continue;
        const float *cs = cos_sin + positions[t] * D;
        for (int64_t i = 0; i < half; i += 16) {
            const __m512 c = rd16(_mm512_loadu_ps(cs + i)), s = rd16(_mm512_loadu_ps(cs + half + i));
            for (int64_t h = 0; h < NH; h++) {
                const uint16_t *xh = x + t * x_stride + h * D;
                uint16_t *oh = out + (ot * NH + h) * D;
                const __m512 x1 = ld16(xh + i), x2 = ld16(xh + half + i);
                st16(oh + i, _mm512_add_ps(rd16(_mm512_mul_ps(x1, c)), rd16(_mm512_mul_ps(_mm512_xor_ps(x2, neg), s))));
                st16(oh + half + i, _mm512_add_ps(rd16(_mm512_mul_ps(x2, c)), rd16(_mm512_mul_ps(x1, s))));
            }
        }
    }
}

/* silu_rows for bf16 with I % 16 == 0 */
static void silu_rows_bf16v(const uint16_t *x, int64_t x_stride, uint16_t *out, int64_t t0, int64_t t1, int64_t I) {
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_set1_ps(-0.0f);
    for (int64_t t = t0; t < t1; t++)
        for (int64_t i = 0; i < I; i += 16) {
            const __m512 g = ld16(x + t * x_stride + i), u = ld16(x + t * x_stride + I + i);
            const __m512 sg = rd16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_xor_ps(g, neg)))));
            st16(out + t * I + i, _mm512_mul_ps(sg, u));
        }
}
#else
#define VEC_BF16 0
#endif

/* dtype-generic element access: dt 0 = float32, 1 = bfloat16 (constant after inlining) */
static inline float ld(const int dt, const void *p, int64_t i) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void st(const int dt, void *p, int64_t i, float v) {
    if (dt) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
/* what storing to dtype and loading back gives (torch rounds after every bf16 op) */
static inline float rd(const int dt, float v) { return dt ? round_bf16(v) : v; }

/* This thread's share [t0, t1) of T rows. The dtype branch sits inside the parallel
 * region, around always-inlined row loops, so each loop sees a constant dtype. */
/* Elementwise kernels below this many elements run on one thread: a fork/join would cost
 * more than it saves (nt is the caller's thread count; the results do not depend on it). */
#define PARALLEL_MIN_ELEMENTS 65536
static inline int elem_threads(int nt, int64_t numel) { return numel >= PARALLEL_MIN_ELEMENTS ? nt : 1; }

#define SPLIT_ROWS(T)                                                              \
    const int64_t nthr_ = omp_get_num_threads(), tid_ = omp_get_thread_num();     \
    const int64_t t0 = (T) * tid_ / nthr_, t1 = (T) * (tid_ + 1) / nthr_

/* ---- rms_norm / fused_add_rms_norm ---------------------------------------------------
 * x, residual: [T, H] with row strides; out, res_out: [T, H] contiguous; w: [H].
 * out = w * to_dtype(x * rsqrt(mean(x^2) + eps)), the mean in fp32 (HF's LlamaRMSNorm);
 * with a residual, x is first replaced by to_dtype(x + residual), also written to res_out. */
static inline __attribute__((always_inline)) void rms_rows(
    const int dt, const void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
    void *out, void *res_out, int64_t t0, int64_t t1, int64_t H, float eps) {
    for (int64_t t = t0; t < t1; t++) {
        float ss = 0.f;
        if (res) {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) {
                const float v = rd(dt, ld(dt, x, t * x_stride + i) + ld(dt, res, t * res_stride + i));
                st(dt, res_out, t * H + i, v);
                ss += v * v;
            }
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < H; i++) {
                const float v = ld(dt, x, t * x_stride + i);
                ss += v * v;
            }
        }
        const void *src = res ? res_out : x;
        const int64_t stride = res ? H : x_stride;
        const float r = 1.0f / sqrtf(ss / (float)H + eps);
#pragma omp simd
        for (int64_t i = 0; i < H; i++)
            st(dt, out, t * H + i, ld(dt, w, i) * rd(dt, ld(dt, src, t * stride + i) * r));
    }
}

int rms_norm(int dt, const void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w,
             void *out, void *res_out, int64_t T, int64_t H, float eps, int nt) {
    nt = elem_threads(nt, T * H);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
#if VEC_BF16
        if (dt && H % 16 == 0)
            rms_rows_bf16v(x, x_stride, res, res_stride, w, out, res_out, t0, t1, H, eps);
        else
#endif
        if (dt) rms_rows(1, x, x_stride, res, res_stride, w, out, res_out, t0, t1, H, eps);
        else rms_rows(0, x, x_stride, res, res_stride, w, out, res_out, t0, t1, H, eps);
    }
    return 0;
}

/* ---- rotary (rotate-half, HF convention) -----------------------------------------------
 * x: [T, NH, D] with token stride x_stride (heads contiguous, D apart); out: [T, NH, D]
 * contiguous; cos_sin: [max_pos, D] fp32, cos in [:D/2], sin in [D/2:]. Like HF: cos and
 * sin cast to the activation dtype, each product and the sum rounded to it. */
static inline __attribute__((always_inline)) void rope_rows(
    const int dt, const void *x, int64_t x_stride, const int64_t *positions, const float *cos_sin,
    void *out, const int64_t *slots, int64_t t0, int64_t t1, int64_t NH, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t ot = slots ? slots[t] : t; /* the output row (a cache slot; < 0: skipped) */
        if (ot < 0) continue;
        const float *cs = cos_sin + positions[t] * D;
        for (int64_t h = 0; h < NH; h++) {
            const int64_t xi = t * x_stride + h * D, oi = (ot * NH + h) * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float c = rd(dt, cs[i]), s = rd(dt, cs[half + i]);
                const float x1 = ld(dt, x, xi + i), x2 = ld(dt, x, xi + half + i);
                st(dt, out, oi + i, rd(dt, x1 * c) + rd(dt, -x2 * s));
                st(dt, out, oi + half + i, rd(dt, x2 * c) + rd(dt, x1 * s));
            }
        }
    }
}

static inline void rope_part(int dt, const void *x, int64_t x_stride, const int64_t *positions,
                             const float *cos_sin, void *out, const int64_t *slots, int64_t t0, int64_t t1,
                             int64_t NH, int64_t D) {
#if VEC_BF16
    if (dt && (D / 2) % 16 == 0) {
        rope_rows_bf16v(x, x_stride, positions, cos_sin, out, slots, t0, t1, NH, D);
        return;
    }
#endif
    if (dt) rope_rows(1, x, x_stride, positions, cos_sin, out, slots, t0, t1, NH, D);
    else rope_rows(0, x, x_stride, positions, cos_sin, out, slots, t0, t1, NH, D);
}

/* q [T, NQ, D] and k [T, NK, D] (token strides q_stride, k_stride) in one call */
int rotary(int dt, const void *q, int64_t q_stride, int64_t NQ, const void *k, int64_t k_stride, int64_t NK,
           const int64_t *positions, const float *cos_sin, void *q_out, void *k_out, int64_t T, int64_t D, int nt) {
    if (D % 2) return -1;
    nt = elem_threads(nt, T * (NQ + NK) * D);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
        rope_part(dt, q, q_stride, positions, cos_sin, q_out, NULL, t0, t1, NQ, D);
        rope_part(dt, k, k_stride, positions, cos_sin, k_out, NULL, t0, t1, NK, D);
    }
    return 0;
}

/* rotary then write_kv in one pass: q rotated into q_out [T, NQ, D]; k rotated straight
 * into its cache slot, v copied into its own (k_cache, v_cache: [num_slots, NK, D]; a
 * negative slot skips the token). Returns 0, -1 for an odd D, or t + 1 for the first slot
 * past the cache (checked before anything is written). */
int rotary_write_kv(int dt, const void *q, int64_t q_stride, int64_t NQ, const void *k, int64_t k_stride,
                    const void *v, int64_t v_stride, int64_t NK, const int64_t *positions, const float *cos_sin,
                    void *q_out, void *k_cache, void *v_cache, const int64_t *slots, int64_t T, int64_t D,
                    int64_t num_slots, int nt) {
    if (D % 2) return -1;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return (int)(t + 1);
    const int64_t elem = dt ? 2 : 4, row = NK * D * elem;
    nt = elem_threads(nt, T * (NQ + NK) * D);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
        rope_part(dt, q, q_stride, positions, cos_sin, q_out, NULL, t0, t1, NQ, D);
        rope_part(dt, k, k_stride, positions, cos_sin, k_cache, slots, t0, t1, NK, D);
        for (int64_t t = t0; t < t1; t++)
            if (slots[t] >= 0)
                memcpy((char *)v_cache + slots[t] * row, (const char *)v + t * v_stride * elem, (size_t)row);
    }
    return 0;
}

/* ---- silu_and_mul: x [T, 2I] (gate | up), row stride x_stride -> out [T, I] contiguous */
static inline __attribute__((always_inline)) void silu_rows(const int dt, const void *x, int64_t x_stride,
                                                            void *out, int64_t t0, int64_t t1, int64_t I) {
    for (int64_t t = t0; t < t1; t++) {
#pragma omp simd
        for (int64_t i = 0; i < I; i++) {
            const float g = ld(dt, x, t * x_stride + i), u = ld(dt, x, t * x_stride + I + i);
            st(dt, out, t * I + i, rd(dt, g / (1.0f + exp_any(-g))) * u);
        }
    }
}

int silu_and_mul(int dt, const void *x, int64_t x_stride, void *out, int64_t T, int64_t I, int nt) {
    nt = elem_threads(nt, T * 2 * I);
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
#if VEC_BF16
        if (dt && I % 16 == 0)
            silu_rows_bf16v(x, x_stride, out, t0, t1, I);
        else
#endif
        if (dt) silu_rows(1, x, x_stride, out, t0, t1, I);
        else silu_rows(0, x, x_stride, out, t0, t1, I);
    }
    return 0;
}

/* ---- write_kv: rows of [Hk * D] elements into the paged cache at slot_mapping (< 0: skip);
 * returns 1 + the first token whose slot is past the cache (nothing written then) */
int write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
             const int64_t *slots, int64_t T, int64_t row, int64_t elem, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++) /* all checked before anything is written */
        if (slots[t] >= num_slots) return (int)(t + 1);
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * row * elem, (const char *)k + t * k_stride * elem, (size_t)(row * elem));
        memcpy((char *)v_cache + slots[t] * row * elem, (const char *)v + t * v_stride * elem, (size_t)(row * elem));
    }
    return 0;
}

/* ---- argmax over rows of fp32 logits [N, V] (row stride ld): torch.argmax semantics,
 * the first maximum, a NaN counting as the maximum (the first NaN wins). Four independent
 * running maxima per row (the compare-blend chain is latency-bound), rows over threads. */
static int64_t argmax_row(const float *xr, int64_t V) {
    int64_t i = 0, best = 0;
    float m = -INFINITY;
    int seen = 0;
#if defined(__AVX512F__)
    if (V >= 64 && V < 0x7fffffff) {
        __m512 vmax[4];
        __m512i vidx[4], cur[4];
        __mmask16 nan = 0;
        const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(64);
        for (int k = 0; k < 4; k++) {
            cur[k] = vidx[k] = _mm512_add_epi32(lane, _mm512_set1_epi32(16 * k));
            vmax[k] = _mm512_loadu_ps(xr + 16 * k);
            nan |= _mm512_cmp_ps_mask(vmax[k], vmax[k], _CMP_UNORD_Q);
        }
        for (i = 64; i + 64 <= V; i += 64)
            for (int k = 0; k < 4; k++) {
                cur[k] = _mm512_add_epi32(cur[k], step);
                const __m512 v = _mm512_loadu_ps(xr + i + 16 * k);
                nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax[k], _CMP_GT_OQ); /* strict: keeps the first */
                vmax[k] = _mm512_mask_mov_ps(vmax[k], gt, v);
                vidx[k] = _mm512_mask_mov_epi32(vidx[k], gt, cur[k]);
            }
        if (nan) {
            for (int64_t j = 0; j < i; j++)
                if (xr[j] != xr[j]) return j;
        }
        float lanes[64];
        int32_t idx[64];
        for (int k = 0; k < 4; k++) {
            _mm512_storeu_ps(lanes + 16 * k, vmax[k]);
            _mm512_storeu_si512(idx + 16 * k, vidx[k]);
        }
        m = lanes[0], best = idx[0], seen = 1;
        for (int k = 1; k < 64; k++)
            if (lanes[k] > m || (lanes[k] == m && idx[k] < best)) m = lanes[k], best = idx[k];
    }
#endif
    for (; i < V; i++) {
        if (xr[i] != xr[i]) return i;
        if (!seen || xr[i] > m) m = xr[i], best = i, seen = 1;
    }
    return best;
}

int argmax_rows(const float *x, int64_t ld, int64_t N, int64_t V, int64_t *out, int nt) {
    nt = elem_threads(nt, N * V);
#pragma omp parallel for num_threads(nt) if (nt > 1) schedule(static)
    for (int64_t r = 0; r < N; r++) out[r] = argmax_row(x + r * ld, V);
    return 0;
}

/* scores [Hq, max_len] (first len used): raw q . k sums -> probabilities. With dt = bf16
 * they are rounded where the reference (HF's eager attention) rounds: the matmul output
 * before scaling, and the probabilities before P @ V; the softmax itself runs in fp32. */
static inline __attribute__((always_inline)) void softmax_rows(const int dt, float *scores, int64_t Hq, int64_t len,
                                                               int64_t max_len, float scale) {
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sg = scores + hq * max_len;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t l = 0; l < len; l++) {
            const float v = (dt ? round_bf16_finite(sg[l]) : sg[l]) * scale;
            sg[l] = v;
            mx = v > mx ? v : mx;
        }
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < len; l++) {
            sg[l] = exp_nonpos(sg[l] - mx);
            sum += sg[l];
        }
        const float inv = 1.f / sum;
#pragma omp simd
        for (int64_t l = 0; l < len; l++) sg[l] = dt ? round_bf16_finite(sg[l] * inv) : sg[l] * inv;
    }
}

/* One token row [Hk, D] of the cache as fp32 */
static inline __attribute__((always_inline)) void load_row_f32(const int dt, const void *cache, int64_t off,
                                                               int64_t row, float *dst) {
    if (dt) {
        const uint16_t *p = (const uint16_t *)cache + off;
#pragma omp simd
        for (int64_t i = 0; i < row; i++) dst[i] = bf16_to_f32(p[i]);
    } else {
        memcpy(dst, (const float *)cache + off, sizeof(float) * (size_t)row);
    }
}

#define MAX_D 1024

/* A cursor over one sequence's tokens in the paged cache, advanced without divisions
 * (64-bit divides would cost as much as the math of a token). */
typedef struct {
    const int32_t *table;
    int64_t BS, row, blk, pos;
} cursor;

static inline cursor cursor_at(const int32_t *table, int64_t BS, int64_t row, int64_t l) {
    cursor c = {table, BS, row, l / BS, l % BS};
    return c;
}

/* element offset of the cursor's token row, then step to the next token */
static inline int64_t cursor_next(cursor *c) {
    if (c->pos == c->BS) c->pos = 0, c->blk++;
    return ((int64_t)c->table[c->blk] * c->BS + c->pos++) * c->row;
}



/* One sequence: all its heads. Each token's K (then V) row [Hk, D] is one contiguous read.
 * Always inlined into callers that pass D and dtype as constants, so the loops over D
 * are fully unrolled and vectorized. scratch: Hq * max_len + 2 * Hq * D + Hk * D floats
 * (max_len: the scores' row stride). */
static inline __attribute__((always_inline)) void attend(
    const int dtype, const int64_t D, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, void *out, int64_t Hq,
    int64_t Hk, int64_t BS, float scale, int64_t max_len, int64_t b, float *scratch) {
    const int64_t G = Hq / Hk, row = Hk * D, len = seq_lens[b];
    const int32_t *table = block_tables + b * bt_stride;
    float *scores = scratch, *qf = scores + Hq * max_len, *acc = qf + Hq * D, *kv = acc + Hq * D;
    for (int64_t i = 0; i < Hq * D; i++) {
        qf[i] = dtype ? bf16_to_f32(((const uint16_t *)q)[b * Hq * D + i]) : ((const float *)q)[b * Hq * D + i];
        acc[i] = 0.f;
    }
    if (len <= 0) goto store;
    /* raw scores q . k (fp32 accumulation) */
    cursor kc = cursor_at(table, BS, row, 0);
    for (int64_t l = 0; l < len; l++) {
        load_row_f32(dtype, k_cache, cursor_next(&kc), row, kv);
        for (int64_t h = 0, hq = 0; h < Hk; h++) {
            const float *kh = kv + h * D;
            for (int64_t g = 0; g < G; g++, hq++) {
                const float *qh = qf + hq * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                scores[hq * max_len + l] = s;
            }
        }
    }
    softmax_rows(dtype, scores, Hq, len, max_len, scale);
    /* out = P @ V, fp32 accumulation */
    cursor vc = cursor_at(table, BS, row, 0);
    for (int64_t l = 0; l < len; l++) {
        load_row_f32(dtype, v_cache, cursor_next(&vc), row, kv);
        for (int64_t h = 0, hq = 0; h < Hk; h++) {
            const float *vh = kv + h * D;
            for (int64_t g = 0; g < G; g++, hq++) {
                const float p = scores[hq * max_len + l];
                float *ah = acc + hq * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) ah[d] += p * vh[d];
            }
        }
    }
store:
    if (dtype) {
        uint16_t *o = (uint16_t *)out + b * Hq * D;
        for (int64_t i = 0; i < Hq * D; i++) o[i] = f32_to_bf16(acc[i]);
    } else {
        memcpy((float *)out + b * Hq * D, acc, sizeof(float) * (size_t)(Hq * D));
    }
}


#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
/* 16 vectors -> one vector of their 16 horizontal sums (lane i = sum of v[i]); 45 ops
 * instead of 16 separate reductions (~8 each). */
static inline __m512 sum16(__m512 v[16]) {
    __m512 w[8], x[4], y[2];
    for (int i = 0; i < 8; i++)
        w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(w[2 * i]), c = _mm512_castps_pd(w[2 * i + 1]);
        x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, c)));
    }
    for (int i = 0; i < 2; i++)
        y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}

/* bf16 fast path (AVX-512 BF16) over groups of ATT_TG tokens. Each group's K (then V)
 * rows [Hk, D] are read once; the next group's rows are requested while this one is
 * computed, a few lines per head (a burst of prefetches would stall on the miss buffers).
 * q . k: for each query head, the group's 16 dot products by vdpbf16ps straight from the
 * bf16 rows (products of bf16 pairs are exact in fp32), reduced together (sum16) into
 * one vector of 16 scores; the query rows stay in registers.
 * P @ V: vdpbf16ps over token pairs: probabilities are bf16-rounded, so (p_l, p_l+1) is
 * an exact bf16 pair (packed once per row after the softmax) against the interleaved
 * rows (v_l[d], v_l+1[d]); per kv head and 32-wide slices of D the G query heads' fp32
 * accumulators stay in registers across the group, kept in the unpack lane order
 * (undone at the end).
 * Same rounding points as ``attend``; sums associate differently (fp32 ulps).
 * D (a multiple of 32) and G are constants after inlining. ld: the row stride of the
 * scores (>= max_len + 33, a multiple of 32); scratch as decode_attention allocates it. */
#define ATT_TG 16

/* The rows of the group after the current one, requested a few rows at a time. */
typedef struct {
    const char *rows[ATT_TG];
    int64_t n, r, bytes; /* rows; the next row to request; bytes per row */
} group_prefetch;

static inline void group_prefetch_start(group_prefetch *g, cursor *c, const void *cache, int64_t l0, int64_t len) {
    g->n = len - l0 < ATT_TG ? (len - l0 > 0 ? len - l0 : 0) : ATT_TG;
    for (int64_t j = 0; j < g->n; j++) g->rows[j] = (const char *)((const uint16_t *)cache + cursor_next(c));
    g->r = 0;
    g->bytes = c->row * 2;
}

/* request the rows before row `upto` (of ATT_TG) not requested yet */
static inline void group_prefetch_upto(group_prefetch *g, int64_t upto) {
    for (; g->r < upto && g->r < g->n; g->r++)
        for (int64_t off = 0; off < g->bytes; off += 64) __builtin_prefetch(g->rows[g->r] + off, 0, 3);
}

/* softmax_rows for bf16 (the same rounding points and exp method), 16 lanes at a time;
 * rows padded to a multiple of 16 past len (the padding is overwritten) */
static inline void softmax_rows_bf16v(float *scores, int64_t Hq, int64_t len, int64_t ld, float scale) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sg = scores + hq * ld;
        __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t l = 0; l < len; l += 16) {
            const __mmask16 m = len - l >= 16 ? 0xffff : (__mmask16)((1u << (len - l)) - 1);
            const __m512 v = _mm512_mul_ps(rd16(_mm512_maskz_loadu_ps(m, sg + l)), sc);
            _mm512_storeu_ps(sg + l, v);
            mx = _mm512_mask_max_ps(mx, m, mx, v);
        }
        const __m512 vmx = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
        for (int64_t l = 0; l < len; l += 16) {
            const __mmask16 m = len - l >= 16 ? 0xffff : (__mmask16)((1u << (len - l)) - 1);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + l), vmx));
            _mm512_storeu_ps(sg + l, e);
            sum = _mm512_mask_add_ps(sum, m, sum, e);
        }
        const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
        for (int64_t l = 0; l < len; l += 16) _mm512_storeu_ps(sg + l, rd16(_mm512_mul_ps(_mm512_loadu_ps(sg + l), inv)));
    }
}

static inline __attribute__((always_inline)) void attend_bf16(
    const int64_t D, const int64_t G, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, void *out, int64_t Hk,
    int64_t BS, float scale, int64_t ld, int64_t b, float *scratch) {
    const int64_t Hq = Hk * G, row = Hk * D, len = seq_lens[b];
    /* 32-wide slices of D accumulated together: up to 16 accumulator registers, enough
     * independent vdpbf16ps chains to hide its latency */
    const int64_t NC = G >= 8 ? 1 : (8 / G < D / 32 ? 8 / G : D / 32);
    const int32_t *table = block_tables + b * bt_stride;
    const uint16_t *qb = (const uint16_t *)q + b * Hq * D;
    uint16_t *ob = (uint16_t *)out + b * Hq * D;
    float *scores = scratch, *acc = scratch + Hq * ld;
    uint32_t *pairs = (uint32_t *)(acc + Hq * D); /* [Hq, ld / 2] */
    if (len <= 0) {
        memset(ob, 0, sizeof(uint16_t) * (size_t)(Hq * D));
        return;
    }
    const uint16_t *rows[ATT_TG];
    group_prefetch pf;
    cursor kc = cursor_at(table, BS, row, 0), kpf = cursor_at(table, BS, row, 0);
    group_prefetch_start(&pf, &kpf, k_cache, 0, len);
    group_prefetch_upto(&pf, ATT_TG); /* the first group: at once */
    for (int64_t l0 = 0; l0 < len; l0 += ATT_TG) {
        const int64_t n = len - l0 < ATT_TG ? len - l0 : ATT_TG;
        for (int64_t j = 0; j < n; j++) rows[j] = (const uint16_t *)k_cache + cursor_next(&kc);
        for (int64_t j = n; j < ATT_TG; j++) rows[j] = rows[0]; /* scores past len: computed, unused */
        group_prefetch_start(&pf, &kpf, k_cache, l0 + ATT_TG, len);
        for (int64_t hq = 0; hq < Hq; hq++) {
            group_prefetch_upto(&pf, (hq + 1) * ATT_TG / Hq);
            const int64_t off = (hq / G) * D;
            __m512bh qv[4]; /* fixed sizes (D <= 128, G <= 8): a variable-length array would live on the stack */
            for (int64_t c = 0; c < D / 32; c++) qv[c] = (__m512bh)_mm512_loadu_si512(qb + hq * D + c * 32);
            __m512 dots[ATT_TG];
            for (int64_t j = 0; j < ATT_TG; j++) {
                dots[j] = _mm512_setzero_ps();
                for (int64_t c = 0; c < D / 32; c++)
                    dots[j] = _mm512_dpbf16_ps(dots[j], qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + off + c * 32));
            }
            _mm512_storeu_ps(scores + hq * ld + l0, sum16(dots));
        }
    }
    cursor vc = cursor_at(table, BS, row, 0), vpf = cursor_at(table, BS, row, 0);
    group_prefetch_start(&pf, &vpf, v_cache, 0, len);
    group_prefetch_upto(&pf, ATT_TG); /* lands during the softmax */
    softmax_rows_bf16v(scores, Hq, len, ld, scale);
    /* (p_2i, p_2i+1) as one bf16 pair per 32-bit word (the high halves of the rounded fp32
     * probabilities); a lone last token pairs with p = 0 */
    const __m512i odd_words = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31,
                                               29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sg = scores + hq * ld;
        sg[len] = 0.f;
        for (int64_t l = 0; l <= len; l += 32)
            _mm512_storeu_si512(pairs + hq * (ld / 2) + l / 2,
                                _mm512_permutex2var_epi16(_mm512_castps_si512(_mm512_loadu_ps(sg + l)), odd_words,
                                                          _mm512_castps_si512(_mm512_loadu_ps(sg + l + 16))));
    }
    for (int64_t i = 0; i < Hq * D; i++) acc[i] = 0.f;
    const int64_t slices = Hk * (D / 32 / NC), per_slice = D / 32 / NC;
    for (int64_t l0 = 0; l0 < len; l0 += ATT_TG) {
        const int64_t n = len - l0 < ATT_TG ? len - l0 : ATT_TG, np = (n + 1) / 2;
        for (int64_t j = 0; j < n; j++) rows[j] = (const uint16_t *)v_cache + cursor_next(&vc);
        if (n & 1) rows[n] = rows[n - 1]; /* its probability is 0 */
        group_prefetch_start(&pf, &vpf, v_cache, l0 + ATT_TG, len);
        for (int64_t h = 0; h < Hk; h++)
            for (int64_t c0 = 0; c0 < D / 32; c0 += NC) {
                group_prefetch_upto(&pf, (h * per_slice + c0 / NC + 1) * ATT_TG / slices);
                __m512 a[8][8];
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < 2 * NC; c++) a[g][c] = _mm512_loadu_ps(acc + (h * G + g) * D + c0 * 32 + c * 16);
                const uint32_t *pp = pairs + h * G * (ld / 2) + l0 / 2;
                for (int64_t p = 0; p < np; p++) {
                    __m512bh w[8];
                    for (int64_t g = 0; g < G; g++) w[g] = (__m512bh)_mm512_set1_epi32((int)pp[g * (ld / 2) + p]);
                    for (int64_t c = 0; c < NC; c++) {
                        const int64_t off = h * D + (c0 + c) * 32;
                        const __m512i r0 = _mm512_loadu_si512(rows[2 * p] + off);
                        const __m512i r1 = _mm512_loadu_si512(rows[2 * p + 1] + off);
                        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(r0, r1);
                        const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(r0, r1);
                        for (int64_t g = 0; g < G; g++) {
                            a[g][2 * c] = _mm512_dpbf16_ps(a[g][2 * c], w[g], lo);
                            a[g][2 * c + 1] = _mm512_dpbf16_ps(a[g][2 * c + 1], w[g], hi);
                        }
                    }
                }
                for (int64_t g = 0; g < G; g++)
                    for (int64_t c = 0; c < 2 * NC; c++) _mm512_storeu_ps(acc + (h * G + g) * D + c0 * 32 + c * 16, a[g][c]);
            }
    }
    /* undo the unpack lane order: lane 4k + i of a 32-wide group's first half holds
     * d = 8k + i, of its second half d = 8k + 4 + i */
    for (int64_t hq = 0; hq < Hq; hq++)
        for (int64_t c = 0; c < D / 32; c++) {
            const float *am = acc + hq * D + c * 32;
            uint16_t *o = ob + hq * D + c * 32;
            for (int64_t k = 0; k < 4; k++)
                for (int64_t i = 0; i < 4; i++) {
                    o[8 * k + i] = f32_to_bf16(am[4 * k + i]);
                    o[8 * k + 4 + i] = f32_to_bf16(am[16 + 4 * k + i]);
                }
        }
}

/* ---- linear (bf16): C[M, N] = A[M, K] W[N, K]^T (+ bias), W pre-packed ----------------
 * Packed layout [N/32][K/2][32][2]: for each tile of 32 output columns, each pair of K
 * steps is one contiguous 128-byte row, so vdpbf16ps consumes it with one broadcast A
 * pair per output row. Tiles of 12 rows x 32 columns keep 24 accumulators in registers;
 * the weight tile is streamed once from memory (the next tile prefetched during the
 * first row tile) and re-read from L1/L2 by the other row tiles. Accumulation in fp32,
 * (+ bias), one rounding to bf16: oneDNN's contract; sums associate differently. */
#define GEMM_MT 12

/* one pair of K steps: each of the tile's mt rows times the 32 columns' weights */
static inline __attribute__((always_inline)) void gemm_kpair(const uint16_t *A, int64_t lda, int64_t m0,
                                                             const int64_t mt, int64_t kp, __m512bh w0, __m512bh w1,
                                                             __m512 acc[GEMM_MT][2]) {
    for (int64_t i = 0; i < mt; i++) {
        uint32_t pair;
        memcpy(&pair, A + (m0 + i) * lda + 2 * kp, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, w0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, w1);
    }
}
static inline __attribute__((always_inline)) void gemm_tile(
    const uint16_t *A, int64_t lda, const uint16_t *w, const uint16_t *bias, uint16_t *C, int64_t ldc, int64_t m0,
    const int64_t mt, int64_t K, const uint16_t *w_next, float *Cf) {
    __m512 acc[GEMM_MT][2];
    for (int i = 0; i < GEMM_MT; i++) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t kp = 0; kp < K / 2; kp++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 64);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 64 + 32);
        if (w_next) {
            __builtin_prefetch(w_next + kp * 64, 0, 2);
            __builtin_prefetch(w_next + kp * 64 + 32, 0, 2);
        }
        gemm_kpair(A, lda, m0, mt, kp, w0, w1, acc);
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) b0 = ld16(bias), b1 = ld16(bias + 16);
    for (int64_t i = 0; i < mt; i++) {
        const __m512 r0 = bias ? _mm512_add_ps(acc[i][0], b0) : acc[i][0];
        const __m512 r1 = bias ? _mm512_add_ps(acc[i][1], b1) : acc[i][1];
        if (Cf) { /* fp32 output of the bf16-rounded values: bf16 logits then .float(), one pass */
            _mm512_storeu_ps(Cf + (m0 + i) * ldc, rd16(r0));
            _mm512_storeu_ps(Cf + (m0 + i) * ldc + 16, rd16(r1));
        } else {
            st16(C + (m0 + i) * ldc, r0);
            st16(C + (m0 + i) * ldc + 16, r1);
        }
    }
}

/* The small-M (decode) schedule. Each thread streams its weight tiles once, in chunks of
 * GEMM_KC pairs of K (8 KiB): a chunk is applied to every row tile while it sits in L1
 * (partial sums kept in a small buffer), and the row tiles of a chunk share out the
 * requests for the next chunk's lines, one line per step, so the weights arrive at an even
 * pace across the whole call (bursts of prefetches stall on the miss buffers; without
 * them the decode GEMMs run ~2x slower here). */
#define GEMM_KC 64
#define GEMM_SMALL_M 48

/* one row tile over one K chunk, requesting lines pf0, pf0 + pf_step, ... (< pf_lines) of
 * the chunk after it on the way, two at a time when `pairs` (the row tiles of a chunk
 * share out its two lines per K pair) */
static inline __attribute__((always_inline)) void gemm_chunk(
    const uint16_t *A, int64_t lda, const uint16_t *w, float *part, int64_t m0, const int64_t mt, int64_t kp0,
    int64_t kp1, int first, const char *pf, int64_t pf0, int64_t pf_step, int64_t pf_lines, int pairs) {
    __m512 acc[GEMM_MT][2];
    for (int64_t i = 0; i < mt; i++) {
        acc[i][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (m0 + i) * 32);
        acc[i][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (m0 + i) * 32 + 16);
    }
    int64_t line = pf0;
    for (int64_t kp = kp0; kp < kp1; kp++, line += pf_step) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w + kp * 64);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kp * 64 + 32);
        if (line < pf_lines) __builtin_prefetch(pf + line * 64, 0, 3);
        if (pairs && line + 1 < pf_lines) __builtin_prefetch(pf + line * 64 + 64, 0, 3);
        gemm_kpair(A, lda, m0, mt, kp, w0, w1, acc);
    }
    for (int64_t i = 0; i < mt; i++) {
        _mm512_storeu_ps(part + (m0 + i) * 32, acc[i][0]);
        _mm512_storeu_ps(part + (m0 + i) * 32 + 16, acc[i][1]);
    }
}

/* silu(g) * u of one row's 32 gate and 32 up values (fp32 sums, bf16-rounded first like
 * the separate linear then silu_and_mul) -> 32 bf16 outputs */
static inline void silu_mul_32(__m512 g0, __m512 g1, __m512 u0, __m512 u1, uint16_t *out) {
    const __m512 one = _mm512_set1_ps(1.0f), neg = _mm512_set1_ps(-0.0f);
    g0 = rd16(g0), g1 = rd16(g1);
    st16(out, _mm512_mul_ps(rd16(_mm512_div_ps(g0, _mm512_add_ps(one, exp16(_mm512_xor_ps(g0, neg))))), rd16(u0)));
    st16(out + 16, _mm512_mul_ps(rd16(_mm512_div_ps(g1, _mm512_add_ps(one, exp16(_mm512_xor_ps(g1, neg))))), rd16(u1)));
}

/* silu_mul: the weight's tiles alternate gate, up (pack_linear_weight's interleaved form)
 * and C [M, N / 2] receives silu(gate) * up: the MLP's gate_up projection and its
 * activation in one pass (the [M, N] intermediate is never written). */
static void gemm_small_m(const uint16_t *A, int64_t lda, const uint16_t *Wp, const uint16_t *bias, void *C,
                         int64_t ldc, int64_t M, int64_t N, int64_t K, int nt, int out_f32, int silu_mul) {
    const int64_t tiles = N / 32, passes = (M + GEMM_MT - 1) / GEMM_MT, step = silu_mul ? 2 : 1;
    const int64_t per = passes == 1 ? 2 : 1; /* lines each row tile requests per K pair */
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        float parts[2][GEMM_SMALL_M * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t ob = 0; ob < tiles / step; ob++) {
            for (int64_t s = 0; s < step; s++) {
                const int64_t nb = ob * step + s;
                const uint16_t *w = Wp + nb * K * 32;
                float *part = parts[s];
                for (int64_t kp0 = 0; kp0 < K / 2; kp0 += GEMM_KC) {
                    const int64_t kp1 = kp0 + GEMM_KC < K / 2 ? kp0 + GEMM_KC : K / 2;
                    /* the next chunk: of this tile, else the start of the next tile (contiguous) */
                    const char *pf = (const char *)(w + kp1 * 64);
                    int64_t pf_lines = ((const char *)(Wp + N * K) - pf) / 64; /* 0 after the last tile */
                    if (pf_lines > 2 * (kp1 - kp0)) pf_lines = 2 * (kp1 - kp0);
                    for (int64_t m0 = 0, p = 0; m0 < M; m0 += GEMM_MT, p++) {
                        const int64_t mt = M - m0 < GEMM_MT ? M - m0 : GEMM_MT;
#define GEMM_CHUNK(MT) gemm_chunk(A, lda, w, part, m0, MT, kp0, kp1, kp0 == 0, pf, per * p, per * passes, \
                                      pf_lines, per == 2)
                        switch (mt) {
                        case 12: GEMM_CHUNK(12); break;
                        case 11: GEMM_CHUNK(11); break;
                        case 10: GEMM_CHUNK(10); break;
                        case 9: GEMM_CHUNK(9); break;
                        case 8: GEMM_CHUNK(8); break;
                        case 7: GEMM_CHUNK(7); break;
                        case 6: GEMM_CHUNK(6); break;
                        case 5: GEMM_CHUNK(5); break;
                        case 4: GEMM_CHUNK(4); break;
                        case 3: GEMM_CHUNK(3); break;
                        case 2: GEMM_CHUNK(2); break;
                        default: GEMM_CHUNK(1); break;
                        }
#undef GEMM_CHUNK
                    }
                }
                if (bias) {
                    const __m512 b0 = ld16(bias + nb * 32), b1 = ld16(bias + nb * 32 + 16);
                    for (int64_t i = 0; i < M; i++) {
                        _mm512_storeu_ps(part + i * 32, _mm512_add_ps(_mm512_loadu_ps(part + i * 32), b0));
                        _mm512_storeu_ps(part + i * 32 + 16, _mm512_add_ps(_mm512_loadu_ps(part + i * 32 + 16), b1));
                    }
                }
            }
            for (int64_t i = 0; i < M; i++) {
                const __m512 r0 = _mm512_loadu_ps(parts[0] + i * 32), r1 = _mm512_loadu_ps(parts[0] + i * 32 + 16);
                if (silu_mul) {
                    silu_mul_32(r0, r1, _mm512_loadu_ps(parts[1] + i * 32), _mm512_loadu_ps(parts[1] + i * 32 + 16),
                                (uint16_t *)C + i * ldc + ob * 32);
                } else if (out_f32) {
                    float *cf = (float *)C + i * ldc + ob * 32;
                    _mm512_storeu_ps(cf, rd16(r0));
                    _mm512_storeu_ps(cf + 16, rd16(r1));
                } else {
                    uint16_t *c = (uint16_t *)C + i * ldc + ob * 32;
                    st16(c, r0);
                    st16(c + 16, r1);
                }
            }
        }
    }
}

/* out_f32: C is float [M, ldc] holding the bf16-rounded results (the LM head's logits);
 * silu_mul: see gemm_small_m (C [M, N / 2], ldc its row stride). Returns 0, -1 for shapes
 * it does not take, -2 out of memory. */
int linear_bf16(const uint16_t *A, int64_t lda, const uint16_t *Wp, const uint16_t *bias, void *C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, int nt, int out_f32, int silu_mul) {
    if (N % 32 || K % 2 || (silu_mul && (N % 64 || out_f32))) return -1;
    if (M <= GEMM_SMALL_M) {
        gemm_small_m(A, lda, Wp, bias, C, ldc, M, N, K, nt, out_f32, silu_mul);
        return 0;
    }
    uint16_t *full = silu_mul ? (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(M * N)) : NULL;
    if (silu_mul && !full) return -2;
    uint16_t *dst = silu_mul ? full : (uint16_t *)C;
    const int64_t ld = silu_mul ? N : ldc;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
#pragma omp for schedule(static)
        for (int64_t nb = 0; nb < N / 32; nb++) {
            const uint16_t *w = Wp + nb * K * 32, *w_next = nb + 1 < N / 32 ? w + K * 32 : NULL;
            const uint16_t *bn = bias ? bias + nb * 32 : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += GEMM_MT) {
                uint16_t *c = out_f32 ? NULL : dst + nb * 32;
                float *cf = out_f32 ? (float *)C + nb * 32 : NULL;
                if (M - m0 >= GEMM_MT)
                    gemm_tile(A, lda, w, bn, c, ld, m0, GEMM_MT, K, m0 == 0 ? w_next : NULL, cf);
                else
                    gemm_tile(A, lda, w, bn, c, ld, m0, M - m0, K, m0 == 0 ? w_next : NULL, cf);
            }
        }
        if (silu_mul) /* the tile pairs of the bf16 result -> silu(gate) * up (same roundings) */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < M; i++)
                for (int64_t ob = 0; ob < N / 64; ob++) {
                    const uint16_t *g = full + i * N + ob * 64;
                    silu_mul_32(ld16(g), ld16(g + 16), ld16(g + 32), ld16(g + 48), (uint16_t *)C + i * ldc + ob * 32);
                }
    }
    free(full);
    return 0;
}

#define BF16_CASE(DIM, GG) \
    if (D == DIM && G == GG) { \
        attend_bf16(DIM, GG, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hk, BS, scale, ld, \
                    b, scratch); \
        continue; \
    }
#define BF16_CASES(DIM) BF16_CASE(DIM, 1) BF16_CASE(DIM, 2) BF16_CASE(DIM, 3) BF16_CASE(DIM, 4) \
    BF16_CASE(DIM, 5) BF16_CASE(DIM, 6) BF16_CASE(DIM, 7) BF16_CASE(DIM, 8)
#else
#define HAVE_AVX512_BF16 0
int linear_bf16(const uint16_t *A, int64_t lda, const uint16_t *Wp, const uint16_t *bias, void *C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, int nt, int out_f32, int silu_mul) {
    return -1; /* needs AVX-512 BF16 */
}
#endif

int has_avx512_bf16(void) { return HAVE_AVX512_BF16; }

#define ATTEND(DT, DIM) attend(DT, DIM, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hq, Hk, BS, \
                               scale, ld, b, scratch)

/* dtype: 0 = float32, 1 = bfloat16. Pointers are to contiguous tensors:
 * q, out [B, Hq, D]; k_cache, v_cache [NB, BS, Hk, D]; block_tables [B, bt_stride] int32;
 * seq_lens [B] int32. generic != 0 skips the AVX-512 BF16 path (tests compare both).
 * Returns 0, or -1 for unsupported sizes or no memory for the scratch (out incomplete). */
int decode_attention(int dtype, const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     void *out, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t BS,
                     float scale, int num_threads, int generic) {
    if (D > MAX_D || Hk <= 0 || Hq % Hk != 0) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];
    const int64_t ld = (max_len + 33 + 31) / 32 * 32; /* the scores' row stride (see attend_bf16) */

    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        /* scores [Hq, ld] + (attend) query and accumulators + one kv row, or (attend_bf16)
         * accumulators + probability pairs [Hq, ld / 2] */
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(Hq * ld + 2 * Hq * D + Hk * D + Hq * ld / 2));
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
            if (!scratch) { /* the caller falls back to the reference op */
#pragma omp atomic write
                failed = 1;
                continue;
            }
#if HAVE_AVX512_BF16
            const int64_t G = Hq / Hk;
            if (dtype == 1 && !generic) {
                BF16_CASES(64)
                BF16_CASES(128)
            }
#endif
            if (dtype == 1 && D == 64) ATTEND(1, 64);
            else if (dtype == 1 && D == 128) ATTEND(1, 128);
            else if (dtype == 1) ATTEND(1, D);
            else if (D == 64) ATTEND(0, 64);
            else if (D == 128) ATTEND(0, 128);
            else ATTEND(0, D);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}

/* ---- the decoder stack of a decode-only step in one call (bf16, AVX-512 BF16) ----------
 * The same kernels, with the same arguments, in the same order as the model's forward
 * (engine/models/llama.py) runs them op by op from Python: the results are bit-identical;
 * what goes is the host work between the ops (dispatch, views, allocations: ~1 ms of a
 * 12 ms step at batch 32 here). One layer's weights and caches: */
typedef struct {
    const uint16_t *input_norm, *post_norm;          /* [H] */
    const uint16_t *qkv, *qkv_bias, *o, *gate_up, *gate_up_bias, *down; /* packed (gate_up interleaved) */
    void *k_cache, *v_cache;                         /* [num_blocks, BS, Hk, D] */
} decoder_layer;

/* h [T, H]: the embeddings in, the last layer's output out; residual [T, H] out (the
 * model returns h + residual). T rows, one decode token each (positions, slots; the block
 * tables and sequence lengths as decode_attention takes them). Returns 0, -1 for shapes
 * the kernels do not take, -2 out of memory, -3 a slot past the cache (h, residual then
 * incomplete). */
int decode_layers(const decoder_layer *layers, int64_t L, uint16_t *h, uint16_t *residual, int64_t T, int64_t H,
                  int64_t Hq, int64_t Hk, int64_t D, int64_t I, float eps, const int64_t *positions,
                  const float *cos_sin, const int64_t *slots, int64_t num_slots, const int32_t *block_tables,
                  int64_t bt_stride, const int32_t *seq_lens, int64_t BS, float scale, int nt) {
#if HAVE_AVX512_BF16
    const int64_t W = (Hq + 2 * Hk) * D; /* the fused qkv row */
    uint16_t *x = malloc(sizeof(uint16_t) * (size_t)(T * H)), *qkv = malloc(sizeof(uint16_t) * (size_t)(T * W));
    uint16_t *q = malloc(sizeof(uint16_t) * (size_t)(T * Hq * D)), *attn = malloc(sizeof(uint16_t) * (size_t)(T * Hq * D));
    uint16_t *m = malloc(sizeof(uint16_t) * (size_t)(T * I)), *res2 = malloc(sizeof(uint16_t) * (size_t)(T * H));
    int rc = (x && qkv && q && attn && m && res2) ? 0 : -2;
    uint16_t *res = residual, *res_next = res2, *swap; /* the add + norms alternate between two buffers */
    for (int64_t i = 0; i < L && rc == 0; i++) {
        const decoder_layer *ly = layers + i;
        /* attention block: (add +) norm, qkv, rotary + KV write, attention, o */
        if (i == 0) {
            memcpy(res, h, sizeof(uint16_t) * (size_t)(T * H));
            rc = rms_norm(1, h, H, NULL, 0, ly->input_norm, x, NULL, T, H, eps, nt);
        } else {
            rc = rms_norm(1, h, H, res, H, ly->input_norm, x, res_next, T, H, eps, nt);
            swap = res, res = res_next, res_next = swap;
        }
        if (rc == 0) rc = linear_bf16(x, H, ly->qkv, ly->qkv_bias, qkv, W, T, W, H, nt, 0, 0);
        if (rc == 0)
            rc = rotary_write_kv(1, qkv, W, Hq, qkv + Hq * D, W, qkv + (Hq + Hk) * D, W, Hk, positions, cos_sin, q,
                                 ly->k_cache, ly->v_cache, slots, T, D, num_slots, nt) ? -3 : 0;
        if (rc == 0)
            rc = decode_attention(1, q, ly->k_cache, ly->v_cache, block_tables, bt_stride, seq_lens, attn, T, Hq, Hk,
                                  D, BS, scale, nt, 0);
        if (rc == 0) rc = linear_bf16(attn, Hq * D, ly->o, NULL, h, H, T, H, Hq * D, nt, 0, 0);
        /* MLP block: add + norm, gate_up with SiLU·mul, down */
        if (rc == 0) {
            rc = rms_norm(1, h, H, res, H, ly->post_norm, x, res_next, T, H, eps, nt);
            swap = res, res = res_next, res_next = swap;
        }
        if (rc == 0) rc = linear_bf16(x, H, ly->gate_up, ly->gate_up_bias, m, I, T, 2 * I, H, nt, 0, 1);
        if (rc == 0) rc = linear_bf16(m, I, ly->down, NULL, h, H, T, H, I, nt, 0, 0);
    }
    if (rc == 0 && res != residual) memcpy(residual, res, sizeof(uint16_t) * (size_t)(T * H));
    free(x), free(qkv), free(q), free(attn), free(m), free(res2);
    return rc;
#else
    return -1;
#endif
}
