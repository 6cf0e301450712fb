/* GPT-2's tanh GELU, in place, with the bias of the product before it: y = gelu(y + bias).

   Used by gptkiln.model's MLP (gptkiln.cpu.loops.gelu_tanh_, which builds and loads this file,
   given to the model by gptkiln.cpu.planned.use_compiled_gelu) when no gradient is wanted: the
   expansion c_fc is then computed without its bias
   (torch's addmm would first copy the bias into every row of the output), and this one pass
   adds it and applies the activation. torch's own tanh GELU is slow on the CPU (its vectorised
   tanh costs ~6x its sigmoid), so this pass is also several times faster than F.gelu alone.

   gelu(x) = 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), the same
   function written without the cancellation of 1 + tanh(u) for negative x. sigmoid(z) comes
   from e = exp(-|z|) <= 1: 1 / (1 + e) for z >= 0, e / (1 + e) below. The exponential is
   vexp.h's (within 2 ulp); the division is exact
   rounding. Nothing here includes Python's or torch's headers. */
#include <immintrin.h>
#include <stdint.h>

#include "../gptkiln_cpu.h"
#include "vexp.h"

#define AVX512 __attribute__((target("avx512f")))

static inline __attribute__((always_inline)) AVX512 __m512 gelu16(__m512 x) {
    const __m512 two_c = _mm512_set1_ps(1.5957691216057308f); /* 2 sqrt(2/pi) */
    const __m512 k = _mm512_set1_ps(0.044715f);
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 z = _mm512_mul_ps(_mm512_mul_ps(two_c, x), _mm512_fmadd_ps(k, x2, one)); /* 2u */
    __m512 neg_abs = _mm512_castsi512_ps(
        _mm512_or_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000)));
    __m512 e = exp_le0(neg_abs);
    __mmask16 below = _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 numerator = _mm512_mask_mov_ps(one, below, e);
    __m512 s = _mm512_div_ps(numerator, _mm512_add_ps(one, e)); /* sigmoid(2u) */
    return _mm512_mul_ps(x, s);
}

/* y (rows, cols) fp32, rows `stride` floats apart, in place; bias (cols,) or NULL. */
AVX512 int gelu_tanh_x86(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride,
                     int threads) {
    if (rows <= 0 || cols <= 0) return 0;
    /* chunks of about 16K elements: a decode step's (16 x 3072) still runs on every thread */
    int64_t chunk_rows = cols >= 16384 ? 1 : 16384 / cols;
    int64_t chunks = (rows + chunk_rows - 1) / chunk_rows;
    if (chunks < threads) threads = (int)chunks;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t c = 0; c < chunks; c++) {
        int64_t end = (c + 1) * chunk_rows < rows ? (c + 1) * chunk_rows : rows;
        for (int64_t r = c * chunk_rows; r < end; r++) {
            float *row = y + r * stride;
            int64_t j = 0;
            for (; j + 16 <= cols; j += 16) {
                __m512 x = _mm512_loadu_ps(row + j);
                if (bias) x = _mm512_add_ps(x, _mm512_loadu_ps(bias + j));
                _mm512_storeu_ps(row + j, gelu16(x));
            }
            if (j < cols) {
                __mmask16 m = (__mmask16)((1u << (cols - j)) - 1);
                __m512 x = _mm512_maskz_loadu_ps(m, row + j);
                if (bias) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(m, bias + j));
                _mm512_mask_storeu_ps(row + j, m, gelu16(x));
            }
        }
    }
    return 0;
}
