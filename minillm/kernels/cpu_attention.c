/* minillm's CPU attention for decode steps: the paged KV store and one-query paged attention (cpu_kernels.h). */
#include "cpu_kernels.h"

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
