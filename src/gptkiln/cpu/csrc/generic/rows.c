/* y (M, N) = x (M, K) . w (N, K)^T (* scale) + b for the few rows of decoding, in plain C: the
   reference of x86/rows.c, and what runs where there is no AVX-512 (AVX2 x86, ARM).

   The same sums in the same shape as the AVX-512 loop: each output's products are added into 16
   lanes (k mod 16), and the lanes at the end, so a compiler vectorises the inner loop for
   whatever SIMD the target has (SSE, AVX2, NEON) without reordering a float sum it was not
   given. Each weight row is read once for all M rows of x (it stays in L1 or L2 between them);
   the outputs are shared among the threads. Weights are fp32, int8 (widened, times the
   output's scale) or bf16 (widened exactly: the top half of an fp32). */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "../gptkiln_cpu.h"

#define LANES 16

static inline float from_f32(const float *w, size_t i) { return w[i]; }
static inline float from_i8(const int8_t *w, size_t i) { return (float)w[i]; }
static inline float from_bf16(const uint16_t *w, size_t i) {
    uint32_t bits = (uint32_t)w[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define ROWS_GENERIC(KIND, T, LOAD)                                                             \
    static int KIND##_rows(const float *x, const T *w, const float *s, const float *b,          \
                           float *y, int M, int N, int K, int threads) {                        \
        if (M < 1 || M > GK_MAX_ROWS || K < 16 || K % 16 != 0 || N < 1) return -1;             \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                       \
        for (int n = 0; n < N; n++) {                                                           \
            const T *wn = w + (size_t)n * K;                                                    \
            for (int m = 0; m < M; m++) {                                                       \
                const float *xm = x + (size_t)m * K;                                            \
                float acc[LANES] = {0};                                                         \
                for (int k = 0; k < K; k += LANES)                                              \
                    for (int l = 0; l < LANES; l++)                                             \
                        acc[l] += xm[k + l] * LOAD(wn, (size_t)k + l);                          \
                float sum = 0.f;                                                                \
                for (int l = 0; l < LANES; l++) sum += acc[l];                                  \
                y[(size_t)m * N + n] = sum * (s ? s[n] : 1.f) + (b ? b[n] : 0.f);               \
            }                                                                                   \
        }                                                                                       \
        return 0;                                                                               \
    }

ROWS_GENERIC(f32, float, from_f32)
ROWS_GENERIC(i8, int8_t, from_i8)
ROWS_GENERIC(bf, uint16_t, from_bf16)

int few_rows_linear_generic(const float *x, const float *w, const float *b, float *y, int M,
                            int N, int K, int threads) {
    return f32_rows(x, w, 0, b, y, M, N, K, threads);
}

int int8_rows_linear_generic(const float *x, const int8_t *q, const float *scale, const float *b,
                             float *y, int M, int N, int K, int threads) {
    return i8_rows(x, q, scale, b, y, M, N, K, threads);
}

int bf16_rows_linear_generic(const float *x, const uint16_t *w, const float *b, float *y, int M,
                             int N, int K, int threads) {
    return bf_rows(x, w, 0, b, y, M, N, K, threads);
}
