/* y (M, N) = x (M, K) . w (N, K)^T + b in fp32, for the few rows of decoding, with AVX-512; and
   the same with int8 weights and one scale per output row (int8_rows_linear).

   The AVX-512 version of generic/rows.c's three entry points (the dispatcher, ../dispatch.c,
   calls these where the CPU runs AVX-512). Used by gptkiln.cpu.products.few_rows_linear, whose
   library gptkiln.cpu.library builds once per machine with the system's C compiler and loads
   through ctypes; the tuner (gptkiln.cpu.tuner) times it against F.linear and the other
   candidates and checks it equal to F.linear. Nothing here includes Python's or torch's headers.

   Why: at 4-16 rows a library GEMM (MKL, oneDNN) runs these skinny products at ~10-12 GB/s of
   weight on a 2-core Xeon that reads 18.8 GB/s: it is neither at the memory's speed nor at the
   FMA units'. Here each thread streams whole row blocks of w from memory exactly once:
   - w is taken 4 rows at a time; x's rows 4 at a time (16 accumulators of 16 floats), so
     each 64-byte load of w feeds 4 rows of x and each load of x 4 rows of w;
   - k runs in chunks of KC, so the chunk of the 4 w rows is read from memory for x's first
     4 rows and from L1 for the others;
   - while one block is multiplied, the next block's rows are prefetched into L2, a line or
     more per step, so that the memory stream does not stop between blocks (into L2 rather
     than L1: measured 18.4 against 17.4 GB/s at 16 rows);
   - the 16 partial sums of each output stay in registers (or a small stack buffer across
     chunks) and are added up once, at the end.
   The sums are F.linear's in another order: they differ by float rounding only.

   bf16_rows_linear is the same loop over a bf16 copy of an fp32 weight (used by
   gptkiln.cpu.products.bf16_rows_linear, an fp32 tuner candidate that rounds the weights to bf16 on
   purpose: half the bytes to stream at batch 1, the activations and the sums left in fp32;
   each bf16 weight is widened exactly, by a shift).

   int8_rows_linear is the same loop over an int8 weight q with per-output scales (used by
   gptkiln.cpu.products.int8_rows_linear, an int8 tuner candidate): each int8 weight is widened to
   fp32 in registers as it streams, the activations stay fp32 (unlike fbgemm's dynamic product
   or llama.cpp's q8_0, which round them to 8 bits), and each output's scale multiplies its sum
   once. So it equals gptkiln.cpu.products.dequantize_linear (F.linear on q * scale) up to rounding. At batch
   1 an int8 weight is a quarter of the fp32 one's bytes; torch's int8-weight products with
   fp32 activations ran far below the memory's speed (the reference writes a float copy of the
   weight; _weight_int8pack_mm took 992 us for 768x3072 against F.linear's 214). */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#include "../gptkiln_cpu.h"

#define MAX_ROWS GK_MAX_ROWS

#define AVX512 __attribute__((target("avx512f")))

/* 16 weights as fp32: fp32 as they are, int8 widened (vpmovsxbd, vcvtdq2ps). */
static inline __attribute__((always_inline)) AVX512 __m512 load_f32(const float *w) {
    return _mm512_loadu_ps(w);
}
static inline __attribute__((always_inline)) AVX512 __m512 load_i8(const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q)));
}
/* bf16 is the top half of an fp32: widened by a shift, exactly (vpmovzxwd, vpslld). */
static inline __attribute__((always_inline)) AVX512 __m512 load_bf16(const uint16_t *h) {
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)h));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

/* R rows of x times the 4 weight rows at w (of type T, loaded by LOAD), over k in [k0, k1),
   added into part (R x 4 vectors of partial sums); each step prefetches `per` 64-byte lines
   from *pf (up to pf_end). */
#define ROWS_TIMES_4(KIND, R, T, LOAD, HINT)                                                  \
    static inline __attribute__((always_inline)) AVX512 void KIND##_rows##R##_times_4(        \
        const float *x, const T *w, __m512 *part, int K, int k0, int k1, const char **pf,     \
        const char *pf_end, int per) {                                                        \
        const T *w0 = w, *w1 = w + K, *w2 = w + 2 * (size_t)K, *w3 = w + 3 * (size_t)K;       \
        __m512 acc[R][4];                                                                     \
        for (int r = 0; r < R; r++)                                                           \
            for (int c = 0; c < 4; c++) acc[r][c] = part[r * 4 + c];                          \
        const char *p = *pf;                                                                  \
        for (int k = k0; k < k1; k += 16) {                                                   \
            for (int i = 0; i < per; i++, p += 64)                                            \
                if (p < pf_end) _mm_prefetch(p, HINT);                                        \
            __m512 a0 = LOAD(w0 + k), a1 = LOAD(w1 + k);                                      \
            __m512 a2 = LOAD(w2 + k), a3 = LOAD(w3 + k);                                      \
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

/* The whole loop for weights of type T: KC elements of k per chunk (4 weight rows and 4 rows
   of x stay in L1), `KIND_block_of_4` (outputs n..n+3 of every row: weight rows n..n+3 times
   all M rows of x), `KIND_single_output` (output n: the last N % 4 weight rows) and `KIND_all`
   (every output, the blocks shared among the threads). Each output is its sum times its scale
   (s, or 1 where s is NULL) plus its bias (b, or 0). */
#define ROWS_LOOP(KIND, T, LOAD, KC, HINT)                                                    \
    ROWS_TIMES_4(KIND, 1, T, LOAD, HINT)                                                      \
    ROWS_TIMES_4(KIND, 2, T, LOAD, HINT)                                                      \
    ROWS_TIMES_4(KIND, 3, T, LOAD, HINT)                                                      \
    ROWS_TIMES_4(KIND, 4, T, LOAD, HINT)                                                      \
    static AVX512 void KIND##_block_of_4(const float *x, const T *w, const float *s,          \
                                         const float *b, float *y, int M, int N, int K, int n,\
                                         int blocks_end) {                                    \
        __m512 part[MAX_ROWS * 4];                                                            \
        for (int i = 0; i < M * 4; i++) part[i] = _mm512_setzero_ps();                       \
        const T *wb = w + (size_t)n * K;                                                      \
        int lines = (int)(4 * (size_t)K * sizeof(T) / 64); /* the next block, in lines */     \
        int steps = ((M + 3) / 4) * (K / 16);                                                 \
        int per = (lines + steps - 1) / steps;                                                \
        int ahead = (int)(GK_PREFETCH_BYTES / (4 * (size_t)K * sizeof(T)));                   \
        ahead = ahead > 1 ? ahead : 1; /* blocks ahead: see GK_PREFETCH_BYTES */              \
        const char *pf = (const char *)(wb + 4 * (size_t)K * ahead);                          \
        const char *pf_end = n + 4 * ahead < blocks_end ? pf + (size_t)lines * 64 : pf;       \
        for (int k0 = 0; k0 < K; k0 += KC) {                                                  \
            int k1 = k0 + KC < K ? k0 + KC : K;                                               \
            int m = 0;                                                                        \
            for (; m + 4 <= M; m += 4)                                                        \
                KIND##_rows4_times_4(x + (size_t)m * K, wb, part + m * 4, K, k0, k1, &pf,     \
                                     pf_end, per);                                            \
            const float *xm = x + (size_t)m * K;                                              \
            __m512 *pm = part + m * 4;                                                        \
            switch (M - m) {                                                                  \
                case 3: KIND##_rows3_times_4(xm, wb, pm, K, k0, k1, &pf, pf_end, per); break; \
                case 2: KIND##_rows2_times_4(xm, wb, pm, K, k0, k1, &pf, pf_end, per); break; \
                case 1: KIND##_rows1_times_4(xm, wb, pm, K, k0, k1, &pf, pf_end, per); break; \
            }                                                                                 \
        }                                                                                     \
        for (int m = 0; m < M; m++)                                                           \
            for (int c = 0; c < 4; c++)                                                       \
                y[(size_t)m * N + n + c] = _mm512_reduce_add_ps(part[m * 4 + c]) *           \
                                               (s ? s[n + c] : 1.f) + (b ? b[n + c] : 0.f);   \
    }                                                                                         \
    static AVX512 void KIND##_single_output(const float *x, const T *w, const float *s,       \
                                            const float *b, float *y, int M, int N, int K,    \
                                            int n) {                                          \
        const T *wn = w + (size_t)n * K;                                                      \
        for (int m = 0; m < M; m++) {                                                         \
            __m512 acc = _mm512_setzero_ps();                                                 \
            for (int k = 0; k < K; k += 16)                                                   \
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + (size_t)m * K + k), LOAD(wn + k),   \
                                      acc);                                                   \
            y[(size_t)m * N + n] =                                                            \
                _mm512_reduce_add_ps(acc) * (s ? s[n] : 1.f) + (b ? b[n] : 0.f);              \
        }                                                                                     \
    }                                                                                         \
    static AVX512 int KIND##_all(const float *x, const T *w, const float *s, const float *b,  \
                                 float *y, int M, int N, int K, int threads) {                \
        if (M < 1 || M > MAX_ROWS || K < 16 || K % 16 != 0 || N < 1) return -1;              \
        int blocks = N / 4;                                                                   \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                     \
        for (int j = 0; j < blocks; j++)                                                      \
            KIND##_block_of_4(x, w, s, b, y, M, N, K, 4 * j, 4 * blocks);                     \
        for (int n = 4 * blocks; n < N; n++) KIND##_single_output(x, w, s, b, y, M, N, K, n); \
        return 0;                                                                             \
    }

/* Every loop prefetches GK_PREFETCH_BYTES ahead into L2. (With the next block alone, the
   2-core Xeon had int8 at 5.8 ms into L1 against 7.4 into L2, fp32 18-20 into L2 against 20-22
   into L1; further ahead, into L2, is as good for all three on the EPYC: see the header.) */
ROWS_LOOP(f32, float, load_f32, 256, _MM_HINT_T1) /* 4 rows of w: 4 KB a chunk */
ROWS_LOOP(i8, int8_t, load_i8, 512, _MM_HINT_T1)  /* 4 rows of q: 2 KB; 4 of x: 8 KB */
ROWS_LOOP(bf, uint16_t, load_bf16, 512, _MM_HINT_T1) /* 4 rows of w: 4 KB; 4 of x: 8 KB */

/* The entry points. x (M, K), w or q (N, K), y (M, N) contiguous fp32 (q int8); scale (N,)
   fp32; b (N,) or NULL; 1 <= M <= MAX_ROWS, K % 16 == 0 (the callers check both); `threads`
   OpenMP threads (torch's own runtime, libgomp, when torch is loaded first). Each returns 0,
   or -1 for arguments it refuses. */
AVX512 int few_rows_linear_x86(const float *x, const float *w, const float *b, float *y, int M, int N,
                           int K, int threads) {
    return f32_all(x, w, 0, b, y, M, N, K, threads);
}

AVX512 int int8_rows_linear_x86(const float *x, const int8_t *q, const float *scale, const float *b,
                            float *y, int M, int N, int K, int threads) {
    return i8_all(x, q, scale, b, y, M, N, K, threads);
}

AVX512 int bf16_rows_linear_x86(const float *x, const uint16_t *w, const float *b, float *y, int M,
                            int N, int K, int threads) {
    return bf_all(x, w, 0, b, y, M, N, K, threads);
}

/* Whether this CPU runs the AVX-512 loops (F; the q8 loop also BW and VNNI): 1 or 0, asked once. */
int gk_x86_avx512f(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") != 0;
    }
    return known;
}

int gk_x86_avx512vnni(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                __builtin_cpu_supports("avx512vnni");
    }
    return known;
}
