/* y = gelu_tanh(y + bias) in place, in plain C: the reference of x86/gelu.c, and what runs where
   there is no AVX-512. gelu(x) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3), the sigmoid
   from e = exp(-|2u|) <= 1 (no cancellation for negative x), as the AVX-512 version writes it. */
#include <math.h>
#include <stdint.h>

#include "../gptkiln_cpu.h"

static inline float gelu1(float x) {
    float z = 1.5957691216057308f * x * (1.0f + 0.044715f * x * x); /* 2u */
    float e = expf(-fabsf(z));
    return x * ((z < 0.f ? e : 1.0f) / (1.0f + e));
}

int gelu_tanh_generic(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride,
                      int threads) {
    if (rows <= 0 || cols <= 0) return 0;
    if (rows < threads) threads = (int)rows;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *row = y + r * stride;
        for (int64_t j = 0; j < cols; j++) row[j] = gelu1(bias ? row[j] + bias[j] : row[j]);
    }
    return 0;
}
