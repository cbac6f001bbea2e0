/* The whole decoder stack of a decode-only step in one native call (decode_layers; used by
 * engine/models/native_decode.py): the other files' kernels, called in the model's order. */

#include "common.h"

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
