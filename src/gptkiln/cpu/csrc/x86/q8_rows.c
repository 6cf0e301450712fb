/* y (M, N) = x (M, K) . (q * scale) (N, K)^T + b for the few rows of decoding, with the
   activations rounded to 8 bits in blocks of 32 (llama.cpp's q8_0) and multiplied by the int8
   weights in int8 (AVX-512 VNNI's vpdpbusd: 64 products a vector into 16 int32 sums).

   Used by gptkiln.cpu.products.q8_rows_linear, an int8 tuner candidate that quantizes its
   activations (the inexact kernels of gptkiln.cpu.specs: held to gptkiln.cpu.tuner.ACTIVATION_TOLERANCE against the
   reference, left out by exact_kernels), and by decode_blocks.c for the products the tuner gave
   it. Nothing here includes Python's or torch's headers.

   Why: rows.c's int8 loop widens each int8 weight to fp32 (vpmovsxbd, vcvtdq2ps) and runs
   one fp32 FMA a weight: four instructions per 16 weights, so at batch 1 on the 2-core Xeon it
   ran GPT-2 124M's 49 int8 products in 5.2-5.5 ms a step, under the speed the memory gives.
   Here a 64-byte load of weights is one vpdpbusd: the same products took 2.9-3.0 ms (a C
   benchmark of both loops over the same weights, one process). llama.cpp's q8_0 decodes so.

   The numbers, per row of x and block of 32 values (x_b):
       d = max |x_b| / 127;  a = round(x_b / d) in [-127, 127]  (a = 0 where d = 0)
       y[n] = scale[n] * sum_b d_b * sum_{i in b} a_i q[n, i] + b[n]
   A block holding a NaN or an infinity gets d = NaN, so that what is not finite stays so in
   every output of its row (as the reference's sums are), not rounded away to a finite number.
   vpdpbusd multiplies unsigned by signed bytes, so each weight goes in as |q| (0-128: -128 is
   128, exact) and a takes q's sign (a masked subtract from 0; a is never -128, so it cannot
   overflow): |q| * (a * sign q) = a q for every int8 q. The int32 sums of a block cannot
   overflow (32 * 128 * 127). Each 64-byte chunk holds two blocks: lanes 0-7 of the sums are
   the first block's, 8-15 the second's, so one vector of their two d's (8 lanes each) scales
   both in one FMA into fp32 partial sums.

   The loop is rows.c's: 4 weight rows at a time, shared by every row of x, the weight rows
   GK_PREFETCH_BYTES ahead prefetched into L2 while this block is multiplied, the blocks shared
   among the threads. */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "../gptkiln_cpu.h"

#define MAX_ROWS GK_MAX_ROWS

#define Q8 __attribute__((target("avx512f,avx512bw,avx512vnni")))

/* The activations of M rows of K (K % 64 == 0) as the loops take them: a (M, K) signed bytes
   and the d's (M, K / 64) vectors of 16 floats. */
typedef struct {
    int8_t *a;
    float *d;
} q8_acts;

static Q8 void q8_quantize(const float *x, q8_acts *a, int M, int K) {
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k += 64) {
            size_t c = ((size_t)m * K + k) / 64; /* the chunk */
            for (int half = 0; half < 2; half++) { /* the chunk's two blocks of 32 */
                const float *xb = x + (size_t)m * K + k + 32 * half;
                __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
                __m512 top = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1));
                float amax = _mm512_reduce_max_ps(top);
                /* x - x is 0 for finite x, NaN for NaN and infinities (max_ps skips a NaN) */
                int finite = !(_mm512_cmp_ps_mask(_mm512_sub_ps(v0, v0), v0, _CMP_UNORD_Q) |
                               _mm512_cmp_ps_mask(_mm512_sub_ps(v1, v1), v1, _CMP_UNORD_Q));
                float d = finite ? amax / 127.0f : NAN;
                __m512 inv = _mm512_set1_ps(finite && amax > 0.0f ? 127.0f / amax : 0.0f);
                __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));
                __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
                int8_t *ab = a->a + (size_t)m * K + k + 32 * half;
                _mm_storeu_si128((__m128i *)ab, _mm512_cvtepi32_epi8(q0));
                _mm_storeu_si128((__m128i *)(ab + 16), _mm512_cvtepi32_epi8(q1));
                _mm256_storeu_ps(a->d + c * 16 + 8 * half, _mm256_set1_ps(d));
            }
        }
}

/* One 64-byte chunk of weights (|q| in ABS_W, the lanes where q < 0 in NEG_W) times one row's
   chunk of activations A with its scales D, into fp32 partial sums F. */
#define Q8_CHUNK(A, D, ABS_W, NEG_W, F)                                                       \
    {                                                                                         \
        __m512i a_signed = _mm512_mask_sub_epi8(A, NEG_W, zero, A);                           \
        F = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(zero, ABS_W, a_signed)), D, F); \
    }

/* R rows of activations times the 4 weight rows at w, over k in [k0, k1), added into part
   (R x 4 vectors); prefetching as rows.c's loops do. */
#define Q8_ROWS_TIMES_4(R)                                                                    \
    static inline __attribute__((always_inline)) Q8 void q8_rows##R##_times_4(                \
        const q8_acts *a, int m0, const int8_t *w, __m512 *part, int K, int k0, int k1,       \
        const char **pf, const char *pf_end, int per) {                                       \
        const int8_t *w0 = w, *w1 = w + K, *w2 = w + 2 * (size_t)K, *w3 = w + 3 * (size_t)K;  \
        const __m512i zero = _mm512_setzero_si512();                                          \
        __m512 acc[R][4];                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 4; c++) acc[r][c] = part[r * 4 + c];                          \
        const char *p = *pf;                                                                  \
        for (int k = k0; k < k1; k += 64) {                                                   \
            for (int i = 0; i < per; i++, p += 64)                                            \
                if (p < pf_end) _mm_prefetch(p, _MM_HINT_T1);                                 \
            __m512i q0 = _mm512_loadu_si512(w0 + k), q1 = _mm512_loadu_si512(w1 + k);         \
            __m512i q2 = _mm512_loadu_si512(w2 + k), q3 = _mm512_loadu_si512(w3 + k);         \
            __mmask64 n0 = _mm512_movepi8_mask(q0), n1 = _mm512_movepi8_mask(q1);             \
            __mmask64 n2 = _mm512_movepi8_mask(q2), n3 = _mm512_movepi8_mask(q3);             \
            q0 = _mm512_abs_epi8(q0), q1 = _mm512_abs_epi8(q1);                               \
            q2 = _mm512_abs_epi8(q2), q3 = _mm512_abs_epi8(q3);                               \
            for (int r = 0; r < R; r++) {                                                     \
                size_t c = ((size_t)(m0 + r) * K + k) / 64;                                   \
                __m512i av = _mm512_loadu_si512(a->a + (size_t)(m0 + r) * K + k);             \
                __m512 d = _mm512_loadu_ps(a->d + c * 16);                                    \
                Q8_CHUNK(av, d, q0, n0, acc[r][0])                                            \
                Q8_CHUNK(av, d, q1, n1, acc[r][1])                                            \
                Q8_CHUNK(av, d, q2, n2, acc[r][2])                                            \
                Q8_CHUNK(av, d, q3, n3, acc[r][3])                                            \
            }                                                                                 \
        }                                                                                     \
        *pf = p;                                                                              \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 4; c++) part[r * 4 + c] = acc[r][c];                          \
    }

Q8_ROWS_TIMES_4(1)
Q8_ROWS_TIMES_4(2)
Q8_ROWS_TIMES_4(3)
Q8_ROWS_TIMES_4(4)

#define Q8_KC 1024 /* k per chunk: 4 rows of weights, 4 KB, and 4 rows of |a| stay in L1 */

/* Outputs n..n+3 of every row: weight rows n..n+3 times all M rows. */
static Q8 void q8_block_of_4(const q8_acts *a, const int8_t *w, const float *s, const float *b,
                             float *y, int M, int N, int K, int n, int blocks_end) {
    __m512 part[MAX_ROWS * 4];
    for (int i = 0; i < M * 4; i++) part[i] = _mm512_setzero_ps();
    const int8_t *wb = w + (size_t)n * K;
    int lines = (int)(4 * (size_t)K / 64); /* the next block, in lines */
    int steps = ((M + 3) / 4) * (K / 64);
    int per = (lines + steps - 1) / steps;
    int ahead = (int)(GK_PREFETCH_BYTES / (4 * (size_t)K)); /* blocks ahead: the header says */
    ahead = ahead > 1 ? ahead : 1;
    const char *pf = (const char *)(wb + 4 * (size_t)K * ahead);
    const char *pf_end = n + 4 * ahead < blocks_end ? pf + (size_t)lines * 64 : pf;
    for (int k0 = 0; k0 < K; k0 += Q8_KC) {
        int k1 = k0 + Q8_KC < K ? k0 + Q8_KC : K;
        int m = 0;
        for (; m + 4 <= M; m += 4) q8_rows4_times_4(a, m, wb, part + m * 4, K, k0, k1, &pf, pf_end, per);
        __m512 *pm = part + m * 4;
        switch (M - m) {
            case 3: q8_rows3_times_4(a, m, wb, pm, K, k0, k1, &pf, pf_end, per); break;
            case 2: q8_rows2_times_4(a, m, wb, pm, K, k0, k1, &pf, pf_end, per); break;
            case 1: q8_rows1_times_4(a, m, wb, pm, K, k0, k1, &pf, pf_end, per); break;
        }
    }
    for (int m = 0; m < M; m++)
        for (int c = 0; c < 4; c++)
            y[(size_t)m * N + n + c] =
                _mm512_reduce_add_ps(part[m * 4 + c]) * s[n + c] + (b ? b[n + c] : 0.f);
}

/* Output n (one of the last N % 4 weight rows) of every row. */
static Q8 void q8_single_output(const q8_acts *a, const int8_t *w, const float *s, const float *b,
                                float *y, int M, int N, int K, int n) {
    const int8_t *wn = w + (size_t)n * K;
    const __m512i zero = _mm512_setzero_si512();
    for (int m = 0; m < M; m++) {
        __m512 acc = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 64) {
            size_t c = ((size_t)m * K + k) / 64;
            __m512i wv = _mm512_loadu_si512(wn + k);
            __m512i av = _mm512_loadu_si512(a->a + (size_t)m * K + k);
            __m512 d = _mm512_loadu_ps(a->d + c * 16);
            Q8_CHUNK(av, d, _mm512_abs_epi8(wv), _mm512_movepi8_mask(wv), acc)
        }
        y[(size_t)m * N + n] = _mm512_reduce_add_ps(acc) * s[n] + (b ? b[n] : 0.f);
    }
}

/* The entry point. x (M, K), q (N, K) int8, y (M, N) contiguous; scale (N,) fp32; b (N,) or
   NULL; 1 <= M <= MAX_ROWS, K % 64 == 0; `threads` OpenMP threads. Returns 0, -1 for
   arguments it refuses (or a CPU without VNNI), -2 when scratch memory cannot be had. */
int q8_rows_linear_x86(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                   int M, int N, int K, int threads) {
    if (M < 1 || M > MAX_ROWS || K < 64 || K % 64 != 0 || N < 1 || !gk_x86_avx512vnni()) return -1;
    size_t chunks = (size_t)M * K / 64;
    size_t bytes = (size_t)M * K + chunks * 64; /* a, then the d's: 16 floats a chunk */
    char *scratch = (char *)aligned_alloc(64, bytes);
    if (!scratch) return -2;
    q8_acts a = {(int8_t *)scratch, (float *)(scratch + (size_t)M * K)};
    q8_quantize(x, &a, M, K);
    int blocks = N / 4;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int j = 0; j < blocks; j++) q8_block_of_4(&a, q, scale, b, y, M, N, K, 4 * j, 4 * blocks);
    for (int n = 4 * blocks; n < N; n++) q8_single_output(&a, q, scale, b, y, M, N, K, n);
    free(scratch);
    return 0;
}
