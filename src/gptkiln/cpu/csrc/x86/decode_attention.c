/* softmax(q k^T * scale) v for one new token a row (decoding), over the KV cache, in fp32.

   Used by gptkiln.model's attention (gptkiln.cpu.loops.decode_attention, which builds and loads
   this file, given to the model by gptkiln.cpu.planned.use_compiled_loops) at a decode step: one
   query a row and head, S cached keys and values, an optional mask of the keys each row may see
   (left padding), grouped-query heads (G key/value heads, each serving H / G query heads).
   torch's SDPA spends ~30-90 us a call there on a 2-core Xeon at batch 1 (its flash kernel is
   built for blocks of queries); this is three passes over one head's S keys: the scores (dot
   products, masked keys at -inf), their softmax (vexp.h's exponential, within 2 ulp; the sum
   in fp32), and the weighted sum of the values. The (batch, head) pairs are shared among the
   threads. Nothing here includes Python's or torch's headers. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "../gptkiln_cpu.h"
#include "vexp.h"

#define AVX512 __attribute__((target("avx512f")))
#define MAX_D 256

/* One (row, head): q (D), keys and values S rows `ss` floats apart, mask (S bytes) or NULL,
   scores (S floats of scratch), out (D). */
static AVX512 void one_head(const float *q, const float *k, const float *v, int64_t ss,
                            const uint8_t *mask, int64_t S, int64_t D, float scale,
                            float *scores, float *out) {
    int64_t nv = D / 16;
    __m512 qv[MAX_D / 16];
    for (int64_t i = 0; i < nv; i++) qv[i] = _mm512_mul_ps(_mm512_loadu_ps(q + 16 * i), _mm512_set1_ps(scale));
    float top = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        if (mask && !mask[s]) {
            scores[s] = -INFINITY;
            continue;
        }
        const float *ks = k + s * ss;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(ks));
        for (int64_t i = 1; i < nv; i++) acc = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(ks + 16 * i), acc);
        float x = _mm512_reduce_add_ps(acc);
        if (x != x) { /* a NaN in q or a key: NaN out, as SDPA's, never a quiet zero */
            for (int64_t i = 0; i < D; i++) out[i] = NAN;
            return;
        }
        scores[s] = x;
        if (x > top) top = x;
    }
    __m512 o[MAX_D / 16];
    for (int64_t i = 0; i < nv; i++) o[i] = _mm512_setzero_ps();
    if (top == -INFINITY) { /* every key masked: zeros, as torch's SDPA answers on the CPU */
        for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
        return;
    }
    const __m512 m = _mm512_set1_ps(top);
    __m512 sum = _mm512_setzero_ps();
    int64_t s = 0;
    for (; s + 16 <= S; s += 16) {
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(scores + s), m));
        _mm512_storeu_ps(scores + s, e);
        sum = _mm512_add_ps(sum, e);
    }
    if (s < S) {
        __mmask16 tail = (__mmask16)((1u << (S - s)) - 1);
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_mask_loadu_ps(m, tail, scores + s), m));
        _mm512_mask_storeu_ps(scores + s, tail, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(tail, e));
    }
    float total = _mm512_reduce_add_ps(sum);
    for (s = 0; s < S; s++) {
        float p = scores[s];
        if (p == 0.0f) continue; /* a masked key (or one e^-88 below the top) adds nothing */
        const float *vs = v + s * ss;
        __m512 pv = _mm512_set1_ps(p);
        for (int64_t i = 0; i < nv; i++) o[i] = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vs + 16 * i), o[i]);
    }
    __m512 inv = _mm512_set1_ps(1.0f / total);
    for (int64_t i = 0; i < nv; i++) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(o[i], inv));
}

/* q: q[b][h][:] at q + b*q_sb + h*q_sh; k, v: k[b][g][s][:] at k + b*kv_sb + g*kv_sh + s*kv_ss
   (v alike, same strides); mask: mask[b][s] at mask + b*m_sb (bytes, nonzero = may attend) or
   NULL; out (B, H, D) contiguous. D % 16 == 0 and D <= 256, H % G == 0 (the caller checks).
   Returns 0, -1 for arguments it refuses, -2 when scratch memory cannot be had. */
AVX512 int decode_attention_x86(const float *q, const float *k, const float *v, const uint8_t *mask,
                            float *out, int64_t B, int64_t H, int64_t G, int64_t S, int64_t D,
                            int64_t q_sb, int64_t q_sh, int64_t kv_sb, int64_t kv_sh,
                            int64_t kv_ss, int64_t m_sb, float scale, int threads) {
    if (B < 1 || H < 1 || G < 1 || H % G || S < 1 || D < 16 || D % 16 || D > MAX_D) return -1;
    int64_t pairs = B * H, group = H / G;
    if (pairs < threads) threads = (int)pairs;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *scores = (float *)malloc((size_t)S * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t p = 0; p < pairs; p++) {
            if (!scores) { /* every thread reaches the loop; one without scratch does nothing */
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
