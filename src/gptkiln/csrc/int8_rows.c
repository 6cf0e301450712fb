/* y (M, N) = (x (M, K) . q (N, K)^T) * scale (N) + b, with q int8 and x, scale, b, y fp32: an
   int8-weight product for the few rows of decoding, with AVX-512.

   Used by gptkiln.kernels.int8_rows_linear, which compiles this file once per machine with the
   system's C compiler (gptkiln.native) and calls it through ctypes; the tuner
   (gptkiln.kernels.tune_decoding) times it against the other int8 candidates and checks it
   equal to their reference, kernels.dequantize_linear (F.linear on q * scale), up to rounding:
   the activations stay fp32 (unlike fbgemm's dynamic product or llama.cpp's q8_0, which round
   them to 8 bits), each int8 weight is widened to fp32 in registers, and the row's scale comes
   once, after its sum. Nothing here includes Python's or torch's headers.

   Why: at batch 1 an int8 weight is a quarter of the fp32 one's bytes, so the product could run
   4x faster than fp32's, at the memory's speed; torch's int8-weight products with fp32
   activations measured far below it (the dequantizing reference writes a float copy of the
   weight; _weight_int8pack_mm ran 768x3072 in 992 us against F.linear's 214). The loop is
   csrc/few_rows.c's: each thread streams whole 4-row blocks of q once, multiplies each with
   every row of x, 4 rows of x at a time, in k-chunks that stay in L1, while the next block is
   prefetched into L2. */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define KC 512 /* k per chunk: 4 rows of q (2 KB) and 4 of x (8 KB) stay in L1 */
#define MAX_ROWS 64

#define AVX512 __attribute__((target("avx512f")))

static inline __attribute__((always_inline)) AVX512 __m512 widen(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}

/* R rows of x times the 4 q rows at q, over k in [k0, k1), added into part (R x 4 vectors of
   partial sums); each step prefetches `per` 64-byte lines from *pf (up to pf_end). */
#define ROWS_TIMES_4(R)                                                                       \
    static inline __attribute__((always_inline)) AVX512 void rows##R##_times_4(               \
        const float *x, const int8_t *q, __m512 *part, int K, int k0, int k1, const char **pf, \
        const char *pf_end, int per) {                                                        \
        const int8_t *q0 = q, *q1 = q + K, *q2 = q + 2 * (size_t)K, *q3 = q + 3 * (size_t)K;  \
        __m512 acc[R][4];                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 4; c++) acc[r][c] = part[r * 4 + c];                          \
        const char *p = *pf;                                                                  \
        for (int k = k0; k < k1; k += 16) {                                                   \
            for (int i = 0; i < per; i++, p += 64)                                            \
                if (p < pf_end) _mm_prefetch(p, _MM_HINT_T1);                                 \
            __m512 a0 = widen(q0 + k), a1 = widen(q1 + k);                                    \
            __m512 a2 = widen(q2 + k), a3 = widen(q3 + k);                                    \
            for (int r = 0; r < R; r++) {                                                     \
                __m512 xv = _mm512_loadu_ps(x + (size_t)r * K + k);                           \
                acc[r][0] = _mm512_fmadd_ps(xv, a0, acc[r][0]);                               \
                acc[r][1] = _mm512_fmadd_ps(xv, a1, acc[r][1]);                               \
                acc[r][2] = _mm512_fmadd_ps(xv, a2, acc[r][2]);                               \
                acc[r][3] = _mm512_fmadd_ps(xv, a3, acc[r][3]);                               \
            }                                                                                 \
        }                                                                                     \
        *pf = p;                                                                              \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 4; c++) part[r * 4 + c] = acc[r][c];                          \
    }
ROWS_TIMES_4(1)
ROWS_TIMES_4(2)
ROWS_TIMES_4(3)
ROWS_TIMES_4(4)

/* Outputs n..n+3 of every row: q's rows n..n+3 times all M rows of x. */
static AVX512 void block_of_4(const float *x, const int8_t *q, const float *s, const float *b,
                              float *y, int M, int N, int K, int n, int blocks_end) {
    __m512 part[MAX_ROWS * 4];
    for (int i = 0; i < M * 4; i++) part[i] = _mm512_setzero_ps();
    const int8_t *qb = q + (size_t)n * K;
    int lines = K / 16;                 /* the next block: 4 rows x K bytes, in 64-byte lines */
    int steps = ((M + 3) / 4) * (K / 16);
    int per = (lines + steps - 1) / steps;
    const char *pf = (const char *)(qb + 4 * (size_t)K);
    const char *pf_end = n + 4 < blocks_end ? pf + (size_t)lines * 64 : pf;
    for (int k0 = 0; k0 < K; k0 += KC) {
        int k1 = k0 + KC < K ? k0 + KC : K;
        int m = 0;
        for (; m + 4 <= M; m += 4)
            rows4_times_4(x + (size_t)m * K, qb, part + m * 4, K, k0, k1, &pf, pf_end, per);
        const float *xm = x + (size_t)m * K;
        switch (M - m) {
            case 3: rows3_times_4(xm, qb, part + m * 4, K, k0, k1, &pf, pf_end, per); break;
            case 2: rows2_times_4(xm, qb, part + m * 4, K, k0, k1, &pf, pf_end, per); break;
            case 1: rows1_times_4(xm, qb, part + m * 4, K, k0, k1, &pf, pf_end, per); break;
        }
    }
    for (int m = 0; m < M; m++)
        for (int c = 0; c < 4; c++)
            y[(size_t)m * N + n + c] =
                _mm512_reduce_add_ps(part[m * 4 + c]) * s[n + c] + (b ? b[n + c] : 0.f);
}

/* Output n of every row (the last N % 4 rows of q). */
static AVX512 void single_output(const float *x, const int8_t *q, const float *s, const float *b,
                                 float *y, int M, int N, int K, int n) {
    const int8_t *qn = q + (size_t)n * K;
    for (int m = 0; m < M; m++) {
        __m512 acc = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 16)
            acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)m * K + k), widen(qn + k), acc);
        y[(size_t)m * N + n] = _mm512_reduce_add_ps(acc) * s[n] + (b ? b[n] : 0.f);
    }
}

/* The entry point. x (M, K), q (N, K) int8, y (M, N) contiguous; scale (N,) fp32; b (N,) or
   NULL; 1 <= M <= MAX_ROWS, K % 16 == 0 (the caller checks both); `threads` OpenMP threads.
   Returns 0, or -1 for arguments it refuses. */
AVX512 int int8_rows_linear(const float *x, const int8_t *q, const float *scale, const float *b,
                            float *y, int M, int N, int K, int threads) {
    if (M < 1 || M > MAX_ROWS || K < 16 || K % 16 != 0 || N < 1) return -1;
    int blocks = N / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int j = 0; j < blocks; j++) block_of_4(x, q, scale, b, y, M, N, K, 4 * j, 4 * blocks);
    for (int n = 4 * blocks; n < N; n++) single_output(x, q, scale, b, y, M, N, K, n);
    return 0;
}
