/* minillm's CPU small ops of a decoder layer: RMSNorm (+ residual add), rotary, SiLU-and-mul (cpu_kernels.h). */
#include "cpu_kernels.h"

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
