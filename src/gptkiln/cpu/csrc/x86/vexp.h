/* exp(x) of 16 floats at once for x <= 0, with AVX-512: the exponential that target_log_probs.c
   (softmax sums), gelu.c (the sigmoid) and decode_attention.c (the softmax) share.

   n = round(x / ln 2), r = x - n ln 2 (in two parts, so r keeps its low bits), exp(r) by Cephes
   expf's degree-6 polynomial on [-ln2/2, ln2/2], scaled by 2^n with vscalefps: within 2 ulp.
   Below -87.3 (where exp underflows fp32's normal range) the result is 0; so is it for -inf.
   NaN gives 0 too: the callers test for NaN themselves where it matters. */
#ifndef GPTKILN_VEXP_H
#define GPTKILN_VEXP_H
#include <immintrin.h>

static inline __attribute__((always_inline, target("avx512f"))) __m512 exp_le0(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
    const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
    __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
    r = _mm512_fnmadd_ps(n, ln2_lo, r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 r2 = _mm512_mul_ps(r, r);
    p = _mm512_fmadd_ps(p, r2, _mm512_add_ps(r, _mm512_set1_ps(1.0f))); /* 1 + r + r^2 P(r) */
    return _mm512_maskz_mov_ps(kept, _mm512_scalef_ps(p, n));
}

#endif
