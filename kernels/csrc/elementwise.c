/* Elementwise and row-wise kernels of the ``cpu`` backend (layerscope.kernels.cpu_native):
 * rms_norm / fused_add_rms_norm, rotary, rotary_write_kv, silu_and_mul, write_kv, argmax_rows.
 *
 * Each does one pass over its rows and rounds exactly where torch's bf16 ops round (after
 * each op), so it agrees with the reference (kernels/reference.py) to the ulp (float sums
 * may associate differently). They run on one thread unless the caller passes more and the
 * input is large enough (elem_threads). */

#include "common.h"

#if VEC_BF16
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
