/* minillm's CPU matmuls with few activation rows: fp32 and int8 weights, fp32 activations (cpu_kernels.h).
 *
 * One activation row (batch-1 decode): one weight row at a time, four independent accumulators
 * (measured: the fastest way to stream the rows on one core, as fast as a plain sum of the matrix).
 * More activation rows: two weight rows at a time against up to four activation rows (8 accumulators),
 * each weight vector loaded once and used by every activation row.
 */
#include "cpu_kernels.h"

int minillm_avx2(void) { return HAVE_AVX2; }

#if HAVE_AVX2
/* 8 int8 -> 8 floats */
static inline __m256 load_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* ------------------------------------------------------------------ fp32 weights */
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
