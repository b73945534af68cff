/* minillm's CPU kernels: the declarations, build switches and helpers every source file shares.
 *
 * Built and loaded by minillm/kernels/cpu.py (cc -O3 -march=native -fopenmp, once per source and
 * machine, into the cache): the .c files beside this header are compiled together into one library.
 * Plain C: every function takes raw pointers and sizes that cpu.py checks first. Threads come from
 * OpenMP: the library links libgomp, the same runtime torch's CPU build loaded (one thread pool for
 * both), and each call names its thread count (nt).
 *
 * Decode at batch 1 reads every weight once per token and does two flops per weight, so a matmul
 * with a few rows is bound by memory bandwidth: the kernels stream each weight row once and keep the
 * few activation rows in L1. AVX2 + FMA when the compiler targets them (every x86-64 CPU since 2013;
 * AVX-512 CPUs run them too), plain C loops otherwise.
 *
 *   cpu_matmul.c         mm_f32    y[m, N] = x[m, K] W[N, K]^T (+ bias)                fp32 weights
 *                        mm_i8     y = x (q * scale[:, None])^T (+ bias)               int8 weights, one scale per row
 *   cpu_matmul_int4.c    mm_i4     y = x (q * scale + zero)^T per group of g inputs    int4 weights, int8 x blocks
 *   cpu_small_ops.c      rmsnorm   y = w * x / sqrt(mean(x^2) + eps), residual += x first when given
 *                        rotary    q, k rotated in place (rotate-half, the Llama / NeoX form)
 *                        silu_mul  y = silu(gate) * up
 *   cpu_attention.c      store_kv  new keys and values into the paged pool
 *                        decode_attn  one query per sequence over its paged keys and values
 *   cpu_decode_layers.c  decode_layers  a decode step's decoder layers, each of the above in turn, in one call
 */
#ifndef MINILLM_CPU_KERNELS_H
#define MINILLM_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

/* Output rows are handed to threads in blocks of ROWS_PER_TASK (a multiple of every kernel's row tile). */
#define ROWS_PER_TASK 16

/* Values per block of mm_i4's weights and of its int8 activations (cpu_matmul_int4.c). */
#define QBLOCK 32

#if HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

int minillm_avx2(void);
void minillm_mm_f32(const float *x, int64_t m, int64_t K, const float *W, int64_t N, float *y, const float *bias, int nt);
void minillm_mm_i8(const float *x, int64_t m, int64_t K, const int8_t *q, const float *scale, int64_t N,
                   float *y, const float *bias, int nt);
void minillm_quantize_x(const float *x, int64_t m, int64_t K, int8_t *xq, float *xd);
void minillm_mm_i4(const float *x, int64_t m, int64_t K, int64_t Kp, const uint8_t *packed, const float *scale,
                   const float *zero, int64_t g, int64_t N, float *y, const float *bias, int8_t *xq, float *xd,
                   float *xsum, int nt);
void minillm_rmsnorm(const float *x, float *residual, const float *w, float eps, int64_t T, int64_t H, float *y);
void minillm_rotary(float *q, int64_t q_ld, int64_t hq, float *k, int64_t k_ld, int64_t hk, int64_t T, int64_t D,
                    const int64_t *pos, const float *cos_t, const float *sin_t);
void minillm_silu_mul(const float *gate_up, int64_t T, int64_t I, float *y);
void minillm_store_kv(const float *k, const float *v, int64_t ld, int64_t T, int64_t hk, int64_t D,
                      const int64_t *slot, float *k_cache, float *v_cache, int64_t num_slots);
void minillm_decode_attn(const float *q, int64_t q_ld, int64_t B, int64_t hq, int64_t hk, int64_t D, const float *k_cache,
                         const float *v_cache, int64_t num_slots, const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *seq_lens, int64_t bs, float scale, float *out, float *scores,
                         int64_t max_len, int nt);

#endif
