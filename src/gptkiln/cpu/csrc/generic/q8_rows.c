/* y (M, N) = x (M, K) . (q * scale) (N, K)^T + b with the activations rounded to 8 bits in
   blocks of 32 (llama.cpp's q8_0), in plain C: the reference of x86/q8_rows.c (AVX-512 VNNI),
   and what runs on any other CPU.

   Per row of x and block b of 32 values: d = max |x_b| / 127, a = round(x_b / d) (to nearest,
   ties to even, as the AVX-512 conversion), 0 where d = 0; a block holding a NaN or an infinity
   gets d = NaN, so that what is not finite stays so. y[n] = scale[n] sum_b d_b sum_i a_i q[n, i]
   + b[n]: the products of a block are summed in int32 (exact), each block's sum scaled by its d
   into an fp32 sum. K % 64 == 0, as the AVX-512 loop asks. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "../gptkiln_cpu.h"

#define BLOCK 32

int q8_rows_linear_generic(const float *x, const int8_t *q, const float *scale, const float *b,
                           float *y, int M, int N, int K, int threads) {
    if (M < 1 || M > GK_MAX_ROWS || K < 64 || K % 64 != 0 || N < 1) return -1;
    int blocks = K / BLOCK;
    int8_t *a = (int8_t *)malloc((size_t)M * K + sizeof(float) * (size_t)M * blocks);
    if (!a) return -2;
    float *d = (float *)(a + (size_t)M * K);
    for (int m = 0; m < M; m++)
        for (int j = 0; j < blocks; j++) {
            const float *xb = x + (size_t)m * K + (size_t)j * BLOCK;
            float amax = 0.f;
            int finite = 1;
            for (int i = 0; i < BLOCK; i++) {
                if (!isfinite(xb[i])) finite = 0;
                float v = fabsf(xb[i]);
                if (v > amax) amax = v;
            }
            float inv = finite && amax > 0.f ? 127.0f / amax : 0.f;
            d[(size_t)m * blocks + j] = finite ? amax / 127.0f : NAN;
            for (int i = 0; i < BLOCK; i++)
                a[(size_t)m * K + (size_t)j * BLOCK + i] =
                    finite ? (int8_t)lrintf(xb[i] * inv) : 0;
        }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n = 0; n < N; n++) {
        const int8_t *qn = q + (size_t)n * K;
        for (int m = 0; m < M; m++) {
            const int8_t *am = a + (size_t)m * K;
            const float *dm = d + (size_t)m * blocks;
            float sum = 0.f;
            for (int j = 0; j < blocks; j++) {
                int32_t s = 0;
                for (int i = 0; i < BLOCK; i++)
                    s += (int32_t)am[j * BLOCK + i] * (int32_t)qn[j * BLOCK + i];
                sum += (float)s * dm[j];
            }
            y[(size_t)m * N + n] = sum * scale[n] + (b ? b[n] : 0.f);
        }
    }
    free(a);
    return 0;
}
