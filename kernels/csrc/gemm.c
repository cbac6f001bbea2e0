/* The bf16 GEMM of the ``cpu`` backend's linear layers (linear_bf16), over weights packed
 * once at load (cpu_native.pack_linear_weight); needs AVX-512 BF16 (else it returns -1 and
 * the caller uses torch). */

#include "common.h"

#if HAVE_AVX512_BF16
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
#else
int linear_bf16(const uint16_t *A, int64_t lda, const uint16_t *Wp, const uint16_t *bias, void *C, int64_t ldc,
                int64_t M, int64_t N, int64_t K, int nt, int out_f32, int silu_mul) {
    return -1; /* needs AVX-512 BF16 */
}
#endif

int has_avx512_bf16(void) { return HAVE_AVX512_BF16; }
