/* minillm's CPU decode step in one call: every decoder layer's kernels in turn (cpu_kernels.h).
 *
 * What DecoderLayer.forward_fused does for a decode step (every sequence one new token, the KV pool in fp32,
 * block tables), layer after layer, calling the other files' kernels in the same order with the same
 * arguments: the same arithmetic, so the same bits as the layer-by-layer path, without ~10 Python calls per layer
 * (minillm/models/cpu_decode.py builds the tables below once and checks when to use them).
 */
#include "cpu_kernels.h"

typedef struct {
    int64_t kind;                  /* 0: fp32 w [N, K]; 1: int8 q [N, K], scale [N]; 2: int4 packed [N, Kp/2], scale, zero [N, Kp/g] */
    int64_t N, K, Kp, g;           /* Kp: K padded to a multiple of g (int4), else K */
    const void *w;
    const float *scale, *zero, *bias;
} minillm_mat;

typedef struct {
    const float *ln1, *ln2;        /* input_layernorm, post_attention_layernorm weights [H] */
    minillm_mat qkv, o, gate_up, down;
    float *k_cache, *v_cache;      /* [Hkv, num_slots, D] */
} minillm_layer;

typedef struct {
    int64_t m, H, hq, hk, D, I, num_slots, block_size, max_blocks, max_len, max_k;
    float eps, scale;
    const int64_t *pos, *slots;    /* [m] positions and pool slots of the new tokens */
    const float *cos, *sin;        /* rotary tables [P, D] */
    const int32_t *block_tables, *seq_lens;
} minillm_step;

/* y = x A^T as the layer's Python path computes it: the fp32 kernel takes the bias, the quantized ones add
 * it afterwards (QuantizedLinear.forward), int4 multiplies x padded with zeros to a multiple of 32. */
static void mat_mul(const minillm_mat *A, const float *x, int64_t m, float *y, float *xpad, int8_t *xq, float *xd,
                    float *xsum, int nt) {
    if (A->kind == 0) { minillm_mm_f32(x, m, A->K, (const float *)A->w, A->N, y, A->bias, nt); return; }
    if (A->kind == 1) {
        minillm_mm_i8(x, m, A->K, (const int8_t *)A->w, A->scale, A->N, y, NULL, nt);
    } else {
        int64_t k32 = (A->K + QBLOCK - 1) / QBLOCK * QBLOCK;
        if (k32 != A->K) {
            for (int64_t i = 0; i < m; i++) {
                memcpy(xpad + i * k32, x + i * A->K, A->K * sizeof(float));
                memset(xpad + i * k32 + A->K, 0, (k32 - A->K) * sizeof(float));
            }
            x = xpad;
        }
        minillm_mm_i4(x, m, k32, A->Kp, (const uint8_t *)A->w, A->scale, A->zero, A->g, A->N, y, NULL, xq, xd, xsum,
                      nt);
    }
    if (A->bias)
        for (int64_t i = 0; i < m; i++)
            for (int64_t n = 0; n < A->N; n++) y[i * A->N + n] += A->bias[n];
}

/* residual [m, H]: the stream (updated in place); delta [m, H]: in, the previous layer's output (has_delta 0:
 * none, before the first layer); out, the last layer's. Returns 0, or -1 when scratch memory ran out. */
int minillm_decode_layers(const minillm_layer *layers, int64_t num_layers, const minillm_step *s, float *residual,
                          float *delta, int has_delta, int nt) {
    int64_t m = s->m, H = s->H, q_size = s->hq * s->D, kv_size = s->hk * s->D, ld = q_size + 2 * kv_size;
    int64_t widest = ld > 2 * s->I ? ld : 2 * s->I, kmax = s->max_k, nb = kmax / QBLOCK + 1;
    float *x = malloc(sizeof(float) * m * H), *qkv = malloc(sizeof(float) * m * widest);
    float *attn = malloc(sizeof(float) * m * q_size), *act = malloc(sizeof(float) * m * s->I);
    float *o = malloc(sizeof(float) * m * H), *xpad = malloc(sizeof(float) * m * kmax);
    int8_t *xq = malloc(m * kmax);
    float *xd = malloc(sizeof(float) * m * nb), *xsum = malloc(sizeof(float) * m * nb);
    float *scores = malloc(sizeof(float) * (nt > 0 ? nt : 1) * (s->max_len > 0 ? s->max_len : 1));
    int ok = x && qkv && attn && act && o && xpad && xq && xd && xsum && scores;
    for (int64_t l = 0; ok && l < num_layers; l++) {
        const minillm_layer *L = layers + l;
        if (has_delta || l > 0) minillm_rmsnorm(delta, residual, L->ln1, s->eps, m, H, x);
        else minillm_rmsnorm(residual, NULL, L->ln1, s->eps, m, H, x);
        mat_mul(&L->qkv, x, m, qkv, xpad, xq, xd, xsum, nt);
        minillm_rotary(qkv, ld, s->hq, qkv + q_size, ld, s->hk, m, s->D, s->pos, s->cos, s->sin);
        minillm_store_kv(qkv + q_size, qkv + q_size + kv_size, ld, m, s->hk, s->D, s->slots, L->k_cache, L->v_cache,
                         s->num_slots);
        minillm_decode_attn(qkv, ld, m, s->hq, s->hk, s->D, L->k_cache, L->v_cache, s->num_slots, s->block_tables,
                            s->max_blocks, s->seq_lens, s->block_size, s->scale, attn, scores, s->max_len, nt);
        mat_mul(&L->o, attn, m, o, xpad, xq, xd, xsum, nt);
        minillm_rmsnorm(o, residual, L->ln2, s->eps, m, H, x);
        mat_mul(&L->gate_up, x, m, qkv, xpad, xq, xd, xsum, nt);
        minillm_silu_mul(qkv, m, s->I, act);
        mat_mul(&L->down, act, m, delta, xpad, xq, xd, xsum, nt);
    }
    free(x); free(qkv); free(attn); free(act); free(o); free(xpad); free(xq); free(xd); free(xsum); free(scores);
    return ok ? 0 : -1;
}
