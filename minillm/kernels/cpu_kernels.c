/* minillm's CPU kernels: what one decode step of a small batch does besides Python.
 *
 * Built and loaded by minillm/kernels/cpu.py (cc -O3 -march=native -fopenmp, once per source and
 * machine, into the cache). Plain C: every function takes raw pointers and sizes that cpu.py checks
 * first. Threads come from OpenMP: the library links libgomp, the same runtime torch's CPU build
 * loaded (one thread pool for both), and each call names its thread count (nt).
 *
 * Decode at batch 1 reads every weight once per token and does two flops per weight, so a matmul
 * with a few rows is bound by memory bandwidth: the kernels below stream each weight row once and
 * keep the few activation rows in L1. AVX2 + FMA when the compiler targets them (every x86-64 CPU
 * since 2013; AVX-512 CPUs run them too), plain C loops otherwise.
 *
 *   mm_f32      y[m, N] = x[m, K] W[N, K]^T (+ bias)                       fp32 weights
 *   mm_i8       y = x (q * scale[:, None])^T (+ bias)                      int8 weights, one scale per row
 *   mm_i4       y = x (q * scale + zero)^T per group of g input channels   int4 weights, x rounded to int8 blocks
 *   rmsnorm     y = w * x / sqrt(mean(x^2) + eps), residual += x first when given
 *   rotary      q, k rotated in place (rotate-half, the Llama / NeoX form)
 *   silu_mul    y = silu(gate) * up
 *   decode_attn one query per sequence over its paged keys and values
 *   decode_layers  a decode step's decoder layers, each of the above in turn, in one call
 */
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

int minillm_avx2(void) { return HAVE_AVX2; }

/* Output rows are handed to threads in blocks of ROWS_PER_TASK (a multiple of every kernel's row tile). */
#define ROWS_PER_TASK 16

#if HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int8 -> 8 floats */
static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* ------------------------------------------------------------------ fp32 weights
 * One activation row (batch-1 decode): one weight row at a time, four independent accumulators
 * (measured: the fastest way to stream the rows on one core, as fast as a plain sum of the matrix).
 * More activation rows: two weight rows at a time against up to four activation rows (8 accumulators),
 * each weight vector loaded once and used by every activation row. */
static inline float f32_dot(const float *x, const float *w, int64_t K) {
    int64_t k = 0;
    float d = 0.f;
#if HAVE_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    d = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) d += w[k] * x[k];
    return d;
}

static inline float i8_dot(const float *x, const int8_t *w, int64_t K) {
    int64_t k = 0;
    float d = 0.f;
#if HAVE_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(load_i8(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_i8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_i8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_i8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load_i8(w + k), _mm256_loadu_ps(x + k), a0);
    d = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; k++) d += w[k] * x[k];
    return d;
}

static inline void f32_tile(const float *x, int64_t mr, int64_t K, const float *w0, const float *w1,
                            float out[4][2]) {
    int64_t k = 0;
#if HAVE_AVX2
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = _mm256_loadu_ps(w0 + k), v1 = _mm256_loadu_ps(w1 + k);
        __m256 xv = _mm256_loadu_ps(x + k);
        a00 = _mm256_fmadd_ps(v0, xv, a00); a01 = _mm256_fmadd_ps(v1, xv, a01);
        if (mr > 1) { xv = _mm256_loadu_ps(x + K + k); a10 = _mm256_fmadd_ps(v0, xv, a10); a11 = _mm256_fmadd_ps(v1, xv, a11); }
        if (mr > 2) { xv = _mm256_loadu_ps(x + 2 * K + k); a20 = _mm256_fmadd_ps(v0, xv, a20); a21 = _mm256_fmadd_ps(v1, xv, a21); }
        if (mr > 3) { xv = _mm256_loadu_ps(x + 3 * K + k); a30 = _mm256_fmadd_ps(v0, xv, a30); a31 = _mm256_fmadd_ps(v1, xv, a31); }
    }
    out[0][0] = hsum(a00); out[0][1] = hsum(a01); out[1][0] = hsum(a10); out[1][1] = hsum(a11);
    out[2][0] = hsum(a20); out[2][1] = hsum(a21); out[3][0] = hsum(a30); out[3][1] = hsum(a31);
#else
    for (int i = 0; i < 4; i++) out[i][0] = out[i][1] = 0.f;
#endif
    for (; k < K; k++)
        for (int64_t i = 0; i < mr; i++) { out[i][0] += w0[k] * x[i * K + k]; out[i][1] += w1[k] * x[i * K + k]; }
}

void minillm_mm_f32(const float *x, int64_t m, int64_t K, const float *W, int64_t N, float *y, const float *bias, int nt) {
    int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
        if (m == 1) {
            for (int64_t n = t * ROWS_PER_TASK; n < n1; n++) y[n] = f32_dot(x, W + n * K, K) + (bias ? bias[n] : 0.f);
            continue;
        }
        for (int64_t n = t * ROWS_PER_TASK; n < n1; n += 2) {
            const float *w0 = W + n * K, *w1 = n + 1 < n1 ? w0 + K : w0;
            for (int64_t i0 = 0; i0 < m; i0 += 4) {
                int64_t mr = m - i0 < 4 ? m - i0 : 4;
                float out[4][2];
                f32_tile(x + i0 * K, mr, K, w0, w1, out);
                for (int64_t i = 0; i < mr; i++) {
                    y[(i0 + i) * N + n] = out[i][0] + (bias ? bias[n] : 0.f);
                    if (n + 1 < n1) y[(i0 + i) * N + n + 1] = out[i][1] + (bias ? bias[n + 1] : 0.f);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ int8 weights, fp32 activations */
static inline void i8_tile(const float *x, int64_t mr, int64_t K, const int8_t *w0, const int8_t *w1,
                           float out[4][2]) {
    int64_t k = 0;
#if HAVE_AVX2
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    for (; k + 8 <= K; k += 8) {
        __m256 v0 = load_i8(w0 + k), v1 = load_i8(w1 + k);
        __m256 xv = _mm256_loadu_ps(x + k);
        a00 = _mm256_fmadd_ps(v0, xv, a00); a01 = _mm256_fmadd_ps(v1, xv, a01);
        if (mr > 1) { xv = _mm256_loadu_ps(x + K + k); a10 = _mm256_fmadd_ps(v0, xv, a10); a11 = _mm256_fmadd_ps(v1, xv, a11); }
        if (mr > 2) { xv = _mm256_loadu_ps(x + 2 * K + k); a20 = _mm256_fmadd_ps(v0, xv, a20); a21 = _mm256_fmadd_ps(v1, xv, a21); }
        if (mr > 3) { xv = _mm256_loadu_ps(x + 3 * K + k); a30 = _mm256_fmadd_ps(v0, xv, a30); a31 = _mm256_fmadd_ps(v1, xv, a31); }
    }
    out[0][0] = hsum(a00); out[0][1] = hsum(a01); out[1][0] = hsum(a10); out[1][1] = hsum(a11);
    out[2][0] = hsum(a20); out[2][1] = hsum(a21); out[3][0] = hsum(a30); out[3][1] = hsum(a31);
#else
    for (int i = 0; i < 4; i++) out[i][0] = out[i][1] = 0.f;
#endif
    for (; k < K; k++)
        for (int64_t i = 0; i < mr; i++) { out[i][0] += w0[k] * x[i * K + k]; out[i][1] += w1[k] * x[i * K + k]; }
}

void minillm_mm_i8(const float *x, int64_t m, int64_t K, const int8_t *q, const float *scale, int64_t N,
                   float *y, const float *bias, int nt) {
    int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
        if (m == 1) {
            for (int64_t n = t * ROWS_PER_TASK; n < n1; n++)
                y[n] = i8_dot(x, q + n * K, K) * scale[n] + (bias ? bias[n] : 0.f);
            continue;
        }
        for (int64_t n = t * ROWS_PER_TASK; n < n1; n += 2) {
            const int8_t *w0 = q + n * K, *w1 = n + 1 < n1 ? w0 + K : w0;
            for (int64_t i0 = 0; i0 < m; i0 += 4) {
                int64_t mr = m - i0 < 4 ? m - i0 : 4;
                float out[4][2];
                i8_tile(x + i0 * K, mr, K, w0, w1, out);
                for (int64_t i = 0; i < mr; i++) {
                    y[(i0 + i) * N + n] = out[i][0] * scale[n] + (bias ? bias[n] : 0.f);
                    if (n + 1 < n1) y[(i0 + i) * N + n + 1] = out[i][1] * scale[n + 1] + (bias ? bias[n + 1] : 0.f);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------ int4 weights, int8 activations
 * Layout (cpu.py's pack_i4): each row's K levels (0..15, K a multiple of 32) in blocks of 32; a block's
 * 16 bytes hold level j in the low nibble of byte j and level 16 + j in the high nibble, so one
 * mask and one shift give the block's 32 levels in order. scale, zero: fp32 [N, K / g].
 *
 * Converting every level to a float costs more than reading it (int4 would be compute-bound), so the
 * activations are quantized instead, as llama.cpp does: each block of 32 values of x becomes int8
 * levels xq and one fp32 scale d = max|x| / 127 (x ~= d * xq, rounded to nearest even). Then a block's
 * dot product is d * (q . xq), 32 products summed in integers by two instructions (maddubs, madd),
 * and a group's is scale * sum_blocks(d * (q . xq)) + zero * sum(d * xq). */
#define QBLOCK 32

void minillm_quantize_x(const float *x, int64_t m, int64_t K, int8_t *xq, float *xd) {
    for (int64_t b = 0; b < m * K / QBLOCK; b++) {
        const float *v = x + b * QBLOCK;
        float amax = 0.f;
        for (int j = 0; j < QBLOCK; j++) amax = fmaxf(amax, fabsf(v[j]));
        float d = amax / 127.f, inv = d > 0.f ? 1.f / d : 0.f;
        for (int j = 0; j < QBLOCK; j++) xq[b * QBLOCK + j] = (int8_t)nearbyintf(v[j] * inv);
        xd[b] = d;
    }
}

#if HAVE_AVX2
/* Two blocks at a time. A block's 16 bytes hold its levels 0..15 in the low nibbles and 16..31 in the high
 * ones, so one 32-byte load of blocks b and b + 1 gives, after a mask and a shift, lo = [b's 0..15 | b+1's
 * 0..15] and hi = [b's 16..31 | b+1's 16..31]. mm_i4 lays x's int8 blocks out the same way (i4_pair_layout),
 * so maddubs(lo, A) + maddubs(hi, B) holds both blocks' products in 16-bit sums (at most 4 * 15 * 127), one
 * madd makes them 8 int32 sums, four per block, and one FMA scales each half by its block's multiplier:
 * about half the instructions of one block at a time. two = 0: block b alone (the last of an odd count),
 * its upper half zero. */
static inline __attribute__((always_inline)) __m256i i4_load2(const void *src, int two) {
    return two ? _mm256_loadu_si256((const __m256i *)src)
               : _mm256_inserti128_si256(_mm256_setzero_si256(), _mm_loadu_si128((const __m128i *)src), 0);
}

/* [v[0] x 4 | v[1] x 4], or v[0] x 8 when two = 0 */
static inline __attribute__((always_inline)) __m256 i4_spread2(const float *v, int two) {
    if (!two) return _mm256_set1_ps(v[0]);
    __m128 pair = _mm_castpd_ps(_mm_load_sd((const double *)v));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(pair), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
}

/* blocks b (even) and b + 1 of one weight row against MR activation rows, into acc[i] */
static inline __attribute__((always_inline)) void i4_pair(const int8_t *xq, const float *xd, const int MR, int64_t K,
                                                          int64_t nb, int64_t gshift, const uint8_t *p,
                                                          const float *scale, int64_t b, int two, __m256 *acc) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    __m256i raw = i4_load2(p + b * QBLOCK / 2, two);
    __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    __m256 sv = gshift ? _mm256_set1_ps(scale[b >> gshift]) : i4_spread2(scale + b, two);
    for (int i = 0; i < MR; i++) {
        const int8_t *xr = xq + i * K + b * QBLOCK;
        __m256i A = i4_load2(xr, two), B = i4_load2(xr + (two ? 2 : 1) * QBLOCK / 2, two);
        __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, A), _mm256_maddubs_epi16(hi, B));
        __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        acc[i] = _mm256_fmadd_ps(d, _mm256_mul_ps(i4_spread2(xd + i * nb + b, two), sv), acc[i]);
    }
}

/* i4_pair for one activation row against two weight rows: x's blocks and multipliers loaded once, two
 * independent chains (the same arithmetic per row, so the same bits as one row at a time) */
static inline __attribute__((always_inline)) void i4_pair_2rows(const int8_t *xq, const float *xd, int64_t gshift,
                                                                const uint8_t *const *p, const float *const *scale,
                                                                int64_t b, int two, __m256 *acc) {
    const __m256i mask = _mm256_set1_epi8(0x0F);
    const int8_t *xr = xq + b * QBLOCK;
    __m256i A = i4_load2(xr, two), B = i4_load2(xr + (two ? 2 : 1) * QBLOCK / 2, two);
    __m256 dv = i4_spread2(xd + b, two);
    for (int r = 0; r < 2; r++) {
        __m256i raw = i4_load2(p[r] + b * QBLOCK / 2, two);
        __m256i lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        __m256 sv = gshift ? _mm256_set1_ps(scale[r][b >> gshift]) : i4_spread2(scale[r] + b, two);
        __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, A), _mm256_maddubs_epi16(hi, B));
        __m256 d = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
        acc[r] = _mm256_fmadd_ps(d, _mm256_mul_ps(dv, sv), acc[r]);
    }
}

/* i4_rows with MR = 1 for two weight rows (a decode step's single activation row) */
static void i4_two_rows(const int8_t *xq, const float *xd, const float *xsum, int64_t K, int64_t gshift,
                        const uint8_t *const *p, const float *const *scale, const float *const *zero, float *out) {
    int64_t nb = K / QBLOCK, groups = (nb + (1 << gshift) - 1) >> gshift;
    for (int r = 0; r < 2; r++) {
        float z = 0.f;
        for (int64_t gi = 0; gi < groups; gi++) z += zero[r][gi] * xsum[gi];
        out[r] = z;
    }
    __m256 acc0[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, acc1[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        i4_pair_2rows(xq, xd, gshift, p, scale, b, 1, acc0);
        i4_pair_2rows(xq, xd, gshift, p, scale, b + 2, 1, acc1);
    }
    if (b + 2 <= nb) { i4_pair_2rows(xq, xd, gshift, p, scale, b, 1, acc0); b += 2; }
    if (b < nb) i4_pair_2rows(xq, xd, gshift, p, scale, b, 0, (b / 2) & 1 ? acc1 : acc0);
    for (int r = 0; r < 2; r++) out[r] += hsum(_mm256_add_ps(acc0[r], acc1[r]));
}

/* x's int8 blocks rearranged in place for i4_pair: each pair of blocks [b | b+1] of 32 bytes each becomes
 * [b's 0..15, b+1's 0..15 | b's 16..31, b+1's 16..31]; a last odd block stays as it is. */
static void i4_pair_layout(int8_t *xq, int64_t m, int64_t K) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t b = 0; b + 2 <= K / QBLOCK; b += 2) {
            int8_t *q = xq + i * K + b * QBLOCK, t[16];
            memcpy(t, q + 16, 16);
            memcpy(q + 16, q + 32, 16);
            memcpy(q + 32, t, 16);
        }
}
#endif

/* One weight row against MR activation rows (MR a constant after inlining: the accumulators stay in
 * registers). Each block gets one multiplier, its group's scale times x's block scale; two pairs of blocks
 * in flight per activation row hide the FMA latency. gshift: log2(g / 32). K: x's columns, a multiple of 32;
 * the last group may be partial (the padded columns of a row are never read). */
static inline __attribute__((always_inline)) void i4_rows(const int8_t *xq, const float *xd, const float *xsum,
                                                          const int MR, int64_t K, int64_t gshift,
                                                          const uint8_t *p, const float *scale, const float *zero,
                                                          float *out) {
    int64_t nb = K / QBLOCK, groups = (nb + (1 << gshift) - 1) >> gshift;
    for (int i = 0; i < MR; i++) {
        float z = 0.f;
        for (int64_t gi = 0; gi < groups; gi++) z += zero[gi] * xsum[i * groups + gi];
        out[i] = z;
    }
#if HAVE_AVX2
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < MR; i++) acc0[i] = acc1[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        i4_pair(xq, xd, MR, K, nb, gshift, p, scale, b, 1, acc0);
        i4_pair(xq, xd, MR, K, nb, gshift, p, scale, b + 2, 1, acc1);
    }
    if (b + 2 <= nb) { i4_pair(xq, xd, MR, K, nb, gshift, p, scale, b, 1, acc0); b += 2; }
    if (b < nb) i4_pair(xq, xd, MR, K, nb, gshift, p, scale, b, 0, (b / 2) & 1 ? acc1 : acc0);
    for (int i = 0; i < MR; i++) out[i] += hsum(_mm256_add_ps(acc0[i], acc1[i]));
#else
    for (int64_t b = 0; b < nb; b++)
        for (int i = 0; i < MR; i++) {
            int32_t s = 0;
            for (int j = 0; j < 16; j++) {
                uint8_t byte = p[b * 16 + j];
                s += (byte & 15) * xq[i * K + b * QBLOCK + j] + (byte >> 4) * xq[i * K + b * QBLOCK + 16 + j];
            }
            out[i] += scale[b >> gshift] * xd[i * nb + b] * (float)s;
        }
#endif
}

/* x [m, K] (K a multiple of 32); packed [N, Kp / 2], scale and zero [N, Kp / g]: rows padded to Kp, a multiple
 * of g, K <= Kp. Only x's K columns are multiplied: a padded row's tail (zeros in x) is skipped, not read.
 * xq, xd, xsum: scratch of m * K int8, m * K / 32 and m * Kp / g floats */
void minillm_mm_i4(const float *x, int64_t m, int64_t K, int64_t Kp, const uint8_t *packed, const float *scale,
                   const float *zero, int64_t g, int64_t N, float *y, const float *bias, int8_t *xq, float *xd,
                   float *xsum, int nt) {
    int64_t nb = K / QBLOCK, gshift = 0;
    while ((QBLOCK << gshift) < g) gshift++;
    int64_t groups = (nb + (1 << gshift) - 1) >> gshift, gstride = Kp / g;
    minillm_quantize_x(x, m, K, xq, xd);
    for (int64_t i = 0; i < m; i++)
        for (int64_t gi = 0; gi < groups; gi++) {
            float s = 0.f;
            for (int64_t b = gi * g / QBLOCK; b < (gi + 1) * g / QBLOCK && b < nb; b++) {
                int32_t bs = 0;
                for (int j = 0; j < QBLOCK; j++) bs += xq[(i * nb + b) * QBLOCK + j];
                s += xd[i * nb + b] * (float)bs;
            }
            xsum[i * groups + gi] = s;
        }
#if HAVE_AVX2
    i4_pair_layout(xq, m, K);
#endif
    int64_t tasks = (N + ROWS_PER_TASK - 1) / ROWS_PER_TASK;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t t = 0; t < tasks; t++) {
        int64_t n1 = (t + 1) * ROWS_PER_TASK < N ? (t + 1) * ROWS_PER_TASK : N;
        int64_t n = t * ROWS_PER_TASK;
#if HAVE_AVX2
        if (m == 1)   /* one activation row: two weight rows at a time */
            for (; n + 2 <= n1; n += 2) {
                const uint8_t *p2[2] = {packed + n * (Kp / 2), packed + (n + 1) * (Kp / 2)};
                const float *s2[2] = {scale + n * gstride, scale + (n + 1) * gstride};
                const float *z2[2] = {zero + n * gstride, zero + (n + 1) * gstride};
                float out[2];
                i4_two_rows(xq, xd, xsum, K, gshift, p2, s2, z2, out);
                y[n] = out[0] + (bias ? bias[n] : 0.f);
                y[n + 1] = out[1] + (bias ? bias[n + 1] : 0.f);
            }
#endif
        for (; n < n1; n++)
            for (int64_t i0 = 0; i0 < m; i0 += 4) {
                int64_t mr = m - i0 < 4 ? m - i0 : 4;
                float out[4];
                const int8_t *xqi = xq + i0 * K;
                const float *xdi = xd + i0 * nb, *xsi = xsum + i0 * groups;
                const uint8_t *pn = packed + n * (Kp / 2);
                const float *sn = scale + n * gstride, *zn = zero + n * gstride;
                switch (mr) {   /* a constant row count per call: see i4_rows */
                case 1: i4_rows(xqi, xdi, xsi, 1, K, gshift, pn, sn, zn, out); break;
                case 2: i4_rows(xqi, xdi, xsi, 2, K, gshift, pn, sn, zn, out); break;
                case 3: i4_rows(xqi, xdi, xsi, 3, K, gshift, pn, sn, zn, out); break;
                default: i4_rows(xqi, xdi, xsi, 4, K, gshift, pn, sn, zn, out); break;
                }
                for (int64_t i = 0; i < mr; i++) y[(i0 + i) * N + n] = out[i] + (bias ? bias[n] : 0.f);
            }
    }
}

/* ------------------------------------------------------------------ small ops of a decoder layer */

/* y[t] = w * r / sqrt(mean(r^2) + eps) with r = x[t], or, when residual is given, r = residual[t] + x[t]
 * written back into residual[t] (the add fused into the norm). */
void minillm_rmsnorm(const float *x, float *residual, const float *w, float eps, int64_t T, int64_t H, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * H;
        float *r = residual ? residual + t * H : (float *)xt;
        if (residual)
            for (int64_t h = 0; h < H; h++) r[h] += xt[h];
        float ss = 0.f;
        int64_t h = 0;
#if HAVE_AVX2
        __m256 a = _mm256_setzero_ps();
        for (; h + 8 <= H; h += 8) { __m256 v = _mm256_loadu_ps(r + h); a = _mm256_fmadd_ps(v, v, a); }
        ss = hsum(a);
#endif
        for (; h < H; h++) ss += r[h] * r[h];
        float inv = 1.0f / sqrtf(ss / (float)H + eps);
        for (h = 0; h < H; h++) y[t * H + h] = w[h] * (r[h] * inv);
    }
}

/* x [T, heads, D] (row stride ld floats between tokens) rotated in place with cos, sin [*, D] at positions pos[T]:
 * x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin on the two halves. */
static void rotate(float *x, int64_t ld, int64_t T, int64_t heads, int64_t D, const int64_t *pos,
                   const float *cos_t, const float *sin_t) {
    int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + pos[t] * D, *s = sin_t + pos[t] * D;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *v = x + t * ld + hd * D;
            for (int64_t j = 0; j < half; j++) {
                float a = v[j], b = v[j + half];
                v[j] = a * c[j] - b * s[j];
                v[j + half] = b * c[j + half] + a * s[j + half];
            }
        }
    }
}

void minillm_rotary(float *q, int64_t q_ld, int64_t hq, float *k, int64_t k_ld, int64_t hk, int64_t T, int64_t D,
                    const int64_t *pos, const float *cos_t, const float *sin_t) {
    rotate(q, q_ld, T, hq, D, pos, cos_t, sin_t);
    rotate(k, k_ld, T, hk, D, pos, cos_t, sin_t);
}

/* gate_up [T, 2I] -> y [T, I] = silu(gate) * up */
void minillm_silu_mul(const float *gate_up, int64_t T, int64_t I, float *y) {
    for (int64_t t = 0; t < T; t++) {
        const float *g = gate_up + t * 2 * I, *u = g + I;
        for (int64_t j = 0; j < I; j++) y[t * I + j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}

/* k, v [T, Hkv, D] (token stride ld) -> caches [Hkv, slots, D] at slot[t] */
void minillm_store_kv(const float *k, const float *v, int64_t ld, int64_t T, int64_t hk, int64_t D,
                      const int64_t *slot, float *k_cache, float *v_cache, int64_t num_slots) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < hk; h++) {
            memcpy(k_cache + (h * num_slots + slot[t]) * D, k + t * ld + h * D, D * sizeof(float));
            memcpy(v_cache + (h * num_slots + slot[t]) * D, v + t * ld + h * D, D * sizeof(float));
        }
}

/* One query per sequence: q [B, Hq, D] (token stride q_ld) -> out [B, Hq, D], over keys 0..seq_lens[b]-1 of sequence b, key j in
 * slot block_tables[b, j / bs] * bs + j % bs of the caches [Hkv, slots, D]. Query head h reads KV head
 * h / (Hq / Hkv). Softmax in fp32 with the running maximum subtracted. scores: scratch [threads, max_len]. */
void minillm_decode_attn(const float *q, int64_t q_ld, int64_t B, int64_t hq, int64_t hk, int64_t D, const float *k_cache,
                         const float *v_cache, int64_t num_slots, const int32_t *block_tables, int64_t max_blocks,
                         const int32_t *seq_lens, int64_t bs, float scale, float *out, float *scores,
                         int64_t max_len, int nt) {
    int64_t group = hq / hk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
    for (int64_t task = 0; task < B * hq; task++) {
        int64_t b = task / hq, h = task % hq, kh = h / group;
#ifdef _OPENMP
        float *sc = scores + omp_get_thread_num() * max_len;
#else
        float *sc = scores;
#endif
        const float *qv = q + b * q_ld + h * D;
        const int32_t *table = block_tables + b * max_blocks;
        int64_t L = seq_lens[b];
        float mx = -INFINITY;
        for (int64_t j = 0; j < L; j++) {
            const float *kv = k_cache + (kh * num_slots + (int64_t)table[j / bs] * bs + j % bs) * D;
            float d = 0.f;
            int64_t e = 0;
#if HAVE_AVX2
            __m256 a = _mm256_setzero_ps();
            for (; e + 8 <= D; e += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + e), _mm256_loadu_ps(kv + e), a);
            d = hsum(a);
#endif
            for (; e < D; e++) d += qv[e] * kv[e];
            sc[j] = d * scale;
            if (sc[j] > mx) mx = sc[j];
        }
        float sum = 0.f;
        for (int64_t j = 0; j < L; j++) { sc[j] = expf(sc[j] - mx); sum += sc[j]; }
        float *o = out + task * D;
        for (int64_t e = 0; e < D; e++) o[e] = 0.f;
        for (int64_t j = 0; j < L; j++) {
            const float *vv = v_cache + (kh * num_slots + (int64_t)table[j / bs] * bs + j % bs) * D;
            float p = sc[j] / sum;
            for (int64_t e = 0; e < D; e++) o[e] += p * vv[e];
        }
    }
}

/* ------------------------------------------------------------------ a decode step's layers in one call
 * What DecoderLayer.forward_fused does for a decode step (every sequence one new token, the KV pool in fp32,
 * block tables), layer after layer, calling the kernels above in the same order with the same arguments:
 * the same arithmetic, so the same bits as the layer-by-layer path, without ~10 Python calls per layer
 * (minillm/models/cpu_decode.py builds the tables below once and checks when to use them). */
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
