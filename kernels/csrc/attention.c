/* Paged decode attention of the ``cpu`` backend (decode_attention).
 *
 * Reads K/V straight from the paged cache [num_blocks, block_size, Hk, D] through the
 * block table: no gather, no padding. One task per sequence; each token's row [Hk, D] is
 * read once for all its heads. Rounding follows the reference (kernels/reference.py, and
 * HF's eager attention): scores are rounded to the activation dtype before scaling and
 * softmax (fp32), probabilities are rounded to the activation dtype before P @ V, which
 * accumulates in fp32. A generic path (any D, fp32 or bf16) and an AVX-512 BF16 one. */

#include "common.h"

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

#if HAVE_AVX512_BF16
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

#define BF16_CASE(DIM, GG) \
    if (D == DIM && G == GG) { \
        attend_bf16(DIM, GG, q, k_cache, v_cache, block_tables, bt_stride, seq_lens, out, Hk, BS, scale, ld, \
                    b, scratch); \
        continue; \
    }
#define BF16_CASES(DIM) BF16_CASE(DIM, 1) BF16_CASE(DIM, 2) BF16_CASE(DIM, 3) BF16_CASE(DIM, 4) \
    BF16_CASE(DIM, 5) BF16_CASE(DIM, 6) BF16_CASE(DIM, 7) BF16_CASE(DIM, 8)
#endif

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
