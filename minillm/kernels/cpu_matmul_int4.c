/* minillm's CPU matmul for int4 weights: x rounded to int8 blocks, products summed in integers (cpu_kernels.h).
 *
 * Layout (cpu.py's pack_i4): each row's K levels (0..15, K a multiple of 32) in blocks of 32; a block's
 * 16 bytes hold level j in the low nibble of byte j and level 16 + j in the high nibble, so one
 * mask and one shift give the block's 32 levels in order. scale, zero: fp32 [N, K / g].
 *
 * Converting every level to a float costs more than reading it (int4 would be compute-bound), so the
 * activations are quantized instead, as llama.cpp does: each block of 32 values of x becomes int8
 * levels xq and one fp32 scale d = max|x| / 127 (x ~= d * xq, rounded to nearest even). Then a block's
 * dot product is d * (q . xq), 32 products summed in integers by two instructions (maddubs, madd),
 * and a group's is scale * sum_blocks(d * (q . xq)) + zero * sum(d * xq).
 */
#include "cpu_kernels.h"

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
