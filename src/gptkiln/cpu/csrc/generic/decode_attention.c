/* softmax(q k^T scale) v for one new token a row (decoding), over the KV cache, in plain C: the
   reference of x86/decode_attention.c, and what runs where there is no AVX-512.

   q: q[b][h][:] at q + b*q_sb + h*q_sh; k, v: k[b][g][s][:] at k + b*kv_sb + g*kv_sh + s*kv_ss
   (v alike, same strides); grouped heads: G key/value heads, each serving H / G consecutive
   query heads; mask: mask[b][s] at mask + b*m_sb (bytes, nonzero = may attend) or NULL; out
   (B, H, D) contiguous. Every key masked: zeros (torch's SDPA on the CPU); a NaN score: NaN out.
   D % 16 == 0 and D <= GK_MAX_D, as the AVX-512 version asks. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../gptkiln_cpu.h"

static void one_head(const float *q, const float *k, const float *v, int64_t ss,
                     const uint8_t *mask, int64_t S, int64_t D, float scale, float *scores,
                     float *out) {
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        if (mask && !mask[s]) {
            scores[s] = -INFINITY;
            continue;
        }
        const float *ks = k + s * ss;
        float x = 0.f;
        for (int64_t i = 0; i < D; i++) x += q[i] * scale * ks[i];
        if (x != x) {
            for (int64_t i = 0; i < D; i++) out[i] = NAN;
            return;
        }
        scores[s] = x;
        if (x > top) top = x;
    }
    for (int64_t i = 0; i < D; i++) out[i] = 0.f;
    if (top == -INFINITY) return;
    float total = 0.f;
    for (int64_t s = 0; s < S; s++) {
        float e = scores[s] == -INFINITY ? 0.f : expf(scores[s] - top);
        scores[s] = e;
        total += e;
    }
    for (int64_t s = 0; s < S; s++) {
        float p = scores[s];
        if (p == 0.f) continue;
        const float *vs = v + s * ss;
        for (int64_t i = 0; i < D; i++) out[i] += p * vs[i];
    }
    float inv = 1.0f / total;
    for (int64_t i = 0; i < D; i++) out[i] *= inv;
}

int decode_attention_generic(const float *q, const float *k, const float *v,
                             const uint8_t *mask, float *out, int64_t B, int64_t H, int64_t G,
                             int64_t S, int64_t D, int64_t q_sb, int64_t q_sh, int64_t kv_sb,
                             int64_t kv_sh, int64_t kv_ss, int64_t m_sb, float scale,
                             int threads) {
    if (B < 1 || H < 1 || G < 1 || H % G || S < 1 || D < 16 || D % 16 || D > GK_MAX_D) return -1;
    int64_t pairs = B * H, group = H / G;
    if (pairs < threads) threads = (int)pairs;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = (float *)malloc((size_t)S * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            if (!scores) {
                failed = 1;
                continue;
            }
            int64_t b = p / H, h = p % H, g = h / group;
            one_head(q + b * q_sb + h * q_sh, k + b * kv_sb + g * kv_sh, v + b * kv_sb + g * kv_sh,
                     kv_ss, mask ? mask + b * m_sb : 0, S, D, scale, scores, out + (b * H + h) * D);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}
