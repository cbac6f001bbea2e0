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
 * One task per (sequence, kv head) pair; its g = Hq / Hk query heads share each K/V
 * row load. Rounding follows the reference (and HF's eager attention): scores are
 * rounded to the activation dtype before scaling and softmax (fp32), probabilities
 * are rounded to the activation dtype before P @ V, which accumulates in fp32.
 */
#include <math.h>
#include <omp.h>
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

/* exp(x) for x <= 0 (softmax after max subtraction): Cody-Waite reduction and a degree-6
 * polynomial, ~1 ulp in float32; pure arithmetic so that loops over it vectorize. */
static inline float exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* rint via 1.5 * 2^23 */
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale;
}

/* exp(x) for any x by the same method: 2^n applied as 2^(n-1) * 2 so that n = 128 is
 * reachable; overflows to inf above ~88.72, flushes to 0 below ~-87.3 (expf's denormal
 * tail). Used by silu, where that tail is rounded away. */
static inline float exp_any(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.8f ? 88.8f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const int32_t e = ((int32_t)n + 126) << 23;
    float scale;
    memcpy(&scale, &e, 4);
    return p * scale * 2.0f;
}

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
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
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
    void *out, int64_t t0, int64_t t1, int64_t NH, int64_t D) {
    const int64_t half = D / 2;
    for (int64_t t = t0; t < t1; t++) {
        const float *cs = cos_sin + positions[t] * D;
        for (int64_t h = 0; h < NH; h++) {
            const int64_t xi = t * x_stride + h * D, oi = (t * NH + h) * D;
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

int rotary(int dt, const void *x, int64_t x_stride, const int64_t *positions, const float *cos_sin, void *out,
           int64_t T, int64_t NH, int64_t D, int nt) {
    if (D % 2) return -1;
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
        if (dt) rope_rows(1, x, x_stride, positions, cos_sin, out, t0, t1, NH, D);
        else rope_rows(0, x, x_stride, positions, cos_sin, out, t0, t1, NH, D);
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
#pragma omp parallel num_threads(nt) if (nt > 1)
    {
        SPLIT_ROWS(T);
        if (dt) silu_rows(1, x, x_stride, out, t0, t1, I);
        else silu_rows(0, x, x_stride, out, t0, t1, I);
    }
    return 0;
}

/* ---- write_kv: rows of [Hk * D] elements into the paged cache at slot_mapping (< 0: skip) */
int write_kv(const void *k, int64_t k_stride, const void *v, int64_t v_stride, void *k_cache, void *v_cache,
             const int64_t *slots, int64_t T, int64_t row, int64_t elem) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        memcpy((char *)k_cache + slots[t] * row * elem, (const char *)k + t * k_stride * elem, (size_t)(row * elem));
        memcpy((char *)v_cache + slots[t] * row * elem, (const char *)v + t * v_stride * elem, (size_t)(row * elem));
    }
    return 0;
}

#define MAX_D 1024

/* One sequence: all its heads. Each token's K (then V) row [Hk, D] is one contiguous read.
 * Always inlined into callers that pass D and dtype as constants, so the loops over D
 * are fully unrolled and vectorized. scratch: Hq * max_len + 2 * Hq * D + Hk * D floats. */
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
    for (int64_t l = 0, blk = 0, pos = 0; l < len; l++) {
        if (pos == BS) pos = 0, blk++; /* no division in the token loop */
        const int64_t off = ((int64_t)table[blk] * BS + pos++) * row;
        if (dtype) {
            const uint16_t *kp = (const uint16_t *)k_cache + off;
#pragma omp simd
            for (int64_t i = 0; i < row; i++) kv[i] = bf16_to_f32(kp[i]);
        } else {
            memcpy(kv, (const float *)k_cache + off, sizeof(float) * (size_t)row);
        }
        for (int64_t h = 0, hq = 0; h < Hk; h++) {
            const float *kh = kv + h * D;
            for (int64_t g = 0; g < G; g++, hq++) { /* no division in the token loop */
                const float *qh = qf + hq * D;
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
                scores[hq * max_len + l] = s;
            }
        }
    }
    /* rounded like the reference, scaled; softmax in fp32; probabilities rounded */
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sg = scores + hq * max_len;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t l = 0; l < len; l++) {
            const float v = (dtype ? round_bf16_finite(sg[l]) : sg[l]) * scale;
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
        for (int64_t l = 0; l < len; l++) sg[l] = dtype ? round_bf16_finite(sg[l] * inv) : sg[l] * inv;
    }
    /* out = P @ V, fp32 accumulation */
    for (int64_t l = 0, blk = 0, pos = 0; l < len; l++) {
        if (pos == BS) pos = 0, blk++;
        const int64_t off = ((int64_t)table[blk] * BS + pos++) * row;
        if (dtype) {
            const uint16_t *vp = (const uint16_t *)v_cache + off;
#pragma omp simd
            for (int64_t i = 0; i < row; i++) kv[i] = bf16_to_f32(vp[i]);
        } else {
            memcpy(kv, (const float *)v_cache + off, sizeof(float) * (size_t)row);
        }
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
#include <immintrin.h>
#define HAVE_AVX512_BF16 1
/* bf16 fast path (AVX-512 BF16): q . k with vdpbf16ps straight from the bf16 cache rows
 * (products of bf16 pairs are exact in fp32), P @ V with the G x D accumulators of one kv
 * head held in registers. D (multiple of 32) and G are constants after inlining.
 * Same rounding points as ``attend``; sums associate differently (fp32 ulps). */
#define PREFETCH_AHEAD 16
/* The first head's pass streams whole token rows [Hk, D] into cache ahead of use; the
 * other heads' passes then find them there (one sequence's K or V fits in L2). */
static inline void prefetch_row(const void *cache, const int32_t *table, int64_t BS, int64_t row, int64_t l,
                                int64_t len) {
    if (l >= len) return;
    const char *p = (const char *)((const uint16_t *)cache + ((int64_t)table[l / BS] * BS + l % BS) * row);
    for (int64_t off = 0; off < row * 2; off += 64) _mm_prefetch(p + off, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) void attend_bf16(
    const int64_t D, const int64_t G, const void *q, const void *k_cache, const void *v_cache,
    const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens, void *out, int64_t Hk,
    int64_t BS, float scale, int64_t max_len, int64_t b, float *scratch) {
    const int64_t Hq = Hk * G, row = Hk * D, len = seq_lens[b];
    const int32_t *table = block_tables + b * bt_stride;
    const uint16_t *qb = (const uint16_t *)q + b * Hq * D;
    uint16_t *ob = (uint16_t *)out + b * Hq * D;
    float *scores = scratch;
    if (len <= 0) {
        memset(ob, 0, sizeof(uint16_t) * (size_t)(Hq * D));
        return;
    }
    /* q . k, token by token: each row [Hk, D] is read once, front to back */
    for (int64_t l = 0, blk = 0, pos = 0; l < len; l++) {
        if (pos == BS) pos = 0, blk++;
        const uint16_t *kp = (const uint16_t *)k_cache + ((int64_t)table[blk] * BS + pos++) * row;
        prefetch_row(k_cache, table, BS, row, l + PREFETCH_AHEAD, len);
        for (int64_t h = 0; h < Hk; h++) {
            __m512bh kv[D / 32];
            for (int64_t c = 0; c < D / 32; c++) kv[c] = (__m512bh)_mm512_loadu_si512(kp + h * D + c * 32);
            for (int64_t g = 0; g < G; g++) {
                const uint16_t *qh = qb + (h * G + g) * D;
                __m512 acc = _mm512_setzero_ps();
                for (int64_t c = 0; c < D / 32; c++)
                    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qh + c * 32), kv[c]);
                scores[(h * G + g) * max_len + l] = _mm512_reduce_add_ps(acc);
            }
        }
    }
    for (int64_t hq = 0; hq < Hq; hq++) {
        float *sg = scores + hq * max_len;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t l = 0; l < len; l++) {
            const float v = round_bf16_finite(sg[l]) * scale;
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
        for (int64_t l = 0; l < len; l++) sg[l] = round_bf16_finite(sg[l] * inv);
    }
    /* out = P @ V, token by token, fp32 accumulators [Hq, D] in L1 */
    float *acc = scores + Hq * max_len;
    for (int64_t i = 0; i < Hq * D; i++) acc[i] = 0.f;
    for (int64_t l = 0, blk = 0, pos = 0; l < len; l++) {
        if (pos == BS) pos = 0, blk++;
        const uint16_t *vp = (const uint16_t *)v_cache + ((int64_t)table[blk] * BS + pos++) * row;
        prefetch_row(v_cache, table, BS, row, l + PREFETCH_AHEAD, len);
        for (int64_t h = 0; h < Hk; h++) {
            __m512 p[G];
            for (int64_t g = 0; g < G; g++) p[g] = _mm512_set1_ps(scores[(h * G + g) * max_len + l]);
            for (int64_t c = 0; c < D / 16; c++) {
                const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(
                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vp + h * D + c * 16))), 16));
                for (int64_t g = 0; g < G; g++) {
                    float *a = acc + (h * G + g) * D + c * 16;
                    _mm512_storeu_ps(a, _mm512_fmadd_ps(p[g], v, _mm512_loadu_ps(a)));
                }
            }
        }
    }
    for (int64_t i = 0; i < Hq * D; i++) ob[i] = f32_to_bf16(acc[i]);
}
#define BF16_CASE(DIM, GG) \
    if (D == DIM && G == GG) { \
        attend_bf16(DIM, GG, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hk, BS, scale, max_len, \
                    b, scratch); \
        continue; \
    }
#define BF16_CASES(DIM) BF16_CASE(DIM, 1) BF16_CASE(DIM, 2) BF16_CASE(DIM, 3) BF16_CASE(DIM, 4) \
    BF16_CASE(DIM, 5) BF16_CASE(DIM, 6) BF16_CASE(DIM, 7) BF16_CASE(DIM, 8)
#else
#define HAVE_AVX512_BF16 0
#endif

int has_avx512_bf16(void) { return HAVE_AVX512_BF16; }

#define ATTEND(DT, DIM) attend(DT, DIM, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hq, Hk, BS, \
                               scale, max_len, b, scratch)

/* dtype: 0 = float32, 1 = bfloat16. Pointers are to contiguous tensors:
 * q, out [B, Hq, D]; k_cache, v_cache [NB, BS, Hk, D]; block_tables [B, bt_stride] int32;
 * seq_lens [B] int32. generic != 0 skips the AVX-512 BF16 path (tests compare both).
 * Returns 0, or -1 for unsupported sizes (nothing written). */
int decode_attention(int dtype, const void *q, const void *k_cache, const void *v_cache,
                     const int32_t *block_tables, int64_t bt_stride, const int32_t *seq_lens,
                     void *out, int64_t B, int64_t Hq, int64_t Hk, int64_t D, int64_t BS,
                     float scale, int num_threads, int generic) {
    if (D > MAX_D || Hk <= 0 || Hq % Hk != 0) return -1;
    int64_t max_len = 0;
    for (int64_t b = 0; b < B; b++)
        if (seq_lens[b] > max_len) max_len = seq_lens[b];

#pragma omp parallel num_threads(num_threads)
    {
        float *scratch = (float *)malloc(sizeof(float) * (size_t)(Hq * max_len + 2 * Hq * D + Hk * D));
#pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; b++) {
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
    return 0;
}
