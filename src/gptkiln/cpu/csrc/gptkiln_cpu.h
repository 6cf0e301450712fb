/* gptkiln's CPU decode kernels: every function of the one shared library gptkiln.cpu builds.

   Each kernel has a plain-C version in generic/ (the reference: it builds with any C compiler on
   any CPU, x86-64 or ARM) and, on x86-64, an AVX-512 version in x86/ (llama.cpp's ggml-cpu keeps
   *_generic beside arch/x86/ the same way). The entry points below (dispatch.c) call the AVX-512
   version where the library was built with it (GK_X86) and the CPU runs it, else the generic
   one; GPTKILN_CPU_KERNELS=generic builds the library without x86/ at all. gptkiln.cpu.library
   types each entry point once, for ctypes. Nothing here includes Python's or torch's headers.

   Conventions: row-major contiguous arrays; `threads` OpenMP threads (torch's own runtime,
   libgomp, when torch is loaded first); every int result is 0 for done, -1 for arguments
   refused (nothing written), -2 when scratch memory could not be had. */
#ifndef GPTKILN_CPU_H
#define GPTKILN_CPU_H
#include <stdint.h>

#define GK_MAX_ROWS 64 /* the few-row products take 1..64 rows */
#define GK_MAX_D 256   /* the decode attention's largest head size */

/* ---- entry points (dispatch.c) ---------------------------------------------------------- */

/* y (M, N) = x (M, K) w^T + b: fp32 weights; K % 16 == 0. */
int few_rows_linear(const float *x, const float *w, const float *b, float *y, int M, int N, int K,
                    int threads);
/* the same over int8 weights q (N, K) and one scale per output: y = (x q^T) * scale + b; the
   activations stay fp32 (exact up to rounding against dequantizing q). K % 16 == 0. */
int int8_rows_linear(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                     int M, int N, int K, int threads);
/* the same over bf16 weights (uint16 bit patterns), widened exactly; K % 16 == 0. */
int bf16_rows_linear(const float *x, const uint16_t *w, const float *b, float *y, int M, int N,
                     int K, int threads);
/* int8 weights times activations rounded to 8 bits in blocks of 32 (llama.cpp's q8_0); K % 64 == 0. */
int q8_rows_linear(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                   int M, int N, int K, int threads);
/* y = gelu_tanh(y + bias) in place: y (rows, cols), rows `stride` apart; bias (cols,) or NULL. */
int gelu_tanh(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride, int threads);
/* softmax(q k^T scale) v for one query a row over the KV cache (see generic/decode_attention.c). */
int decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask,
                     float *out, int64_t B, int64_t H, int64_t G, int64_t S, int64_t D,
                     int64_t q_sb, int64_t q_sh, int64_t kv_sb, int64_t kv_sh, int64_t kv_ss,
                     int64_t m_sb, float scale, int threads);
/* log_softmax(logits)[n, targets[n]] of every row, and its argmax where argmax is not NULL. */
int target_log_probs(const float *logits, const int64_t *targets, float *out, int64_t *argmax,
                     int64_t N, int64_t V, int64_t stride, int threads);
/* a GPT-2 decode step's blocks and final norm in one call (generic/decode_blocks.c). */
int gpt2_decode_blocks(const int64_t *table, const char *kinds, int n_layer, float *x, float *out,
                       int B, int C, int H, int D, int F, int64_t S_max, int64_t pos,
                       const uint8_t *mask, float eps, const float *lnf_w, const float *lnf_b,
                       int threads);
/* a Llama 3 or Qwen3 decode step's blocks and final norm in one call (generic/decode_blocks.c):
   RMSNorm, grouped-query attention with RoPE (and Qwen3's per-head q/k norms), SwiGLU. */
int llama_decode_blocks(const int64_t *table, const char *kinds, int n_layer, float *x,
                        float *out, int B, int C, int H, int G, int D, int F, int64_t S_max,
                        int64_t pos, const uint8_t *mask, const float *cos, const float *sin,
                        float eps, const float *norm_w, int threads);
/* what this library runs: 1 where the AVX-512 products are in use, 0 where the generic ones. */
int gk_avx512(void);
/* 1 where q8_rows_linear runs on AVX-512 VNNI, 0 where it runs the generic loop. */
int gk_q8_vnni(void);

/* ---- generic/: plain C, the reference ---------------------------------------------------- */
int few_rows_linear_generic(const float *x, const float *w, const float *b, float *y, int M,
                            int N, int K, int threads);
int int8_rows_linear_generic(const float *x, const int8_t *q, const float *scale, const float *b,
                             float *y, int M, int N, int K, int threads);
int bf16_rows_linear_generic(const float *x, const uint16_t *w, const float *b, float *y, int M,
                             int N, int K, int threads);
int q8_rows_linear_generic(const float *x, const int8_t *q, const float *scale, const float *b,
                           float *y, int M, int N, int K, int threads);
int gelu_tanh_generic(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride,
                      int threads);
int decode_attention_generic(const float *q, const float *k, const float *v,
                             const uint8_t *mask, float *out, int64_t B, int64_t H, int64_t G,
                             int64_t S, int64_t D, int64_t q_sb, int64_t q_sh, int64_t kv_sb,
                             int64_t kv_sh, int64_t kv_ss, int64_t m_sb, float scale,
                             int threads);
int target_log_probs_generic(const float *logits, const int64_t *targets, float *out,
                             int64_t *argmax, int64_t N, int64_t V, int64_t stride, int threads);

/* ---- x86/: AVX-512 (F; q8 also BW and VNNI), compiled only into an x86-64 build ----------- */
#ifdef GK_X86
/* How far ahead of the block being multiplied the row loops prefetch the weights, in bytes, and
   into L2 (_MM_HINT_T1): the whole blocks of 4 rows that fit, at least the next one. With the
   next block alone (3 KB of int8 rows at K = 768) the loops that do little work a byte (q8's
   VNNI, bf16's widening) outran the stream: on a 2-core AMD EPYC, one thread, GPT-2 124M's 49
   products of a decode step took 12.1 ms by q8 against 8.3 by the int8 loop; 12-24 KB ahead
   into L2 gave q8 7.3-7.9 ms, 0.90-0.94x the int8 loop's, and bf16 15.4 against 18.1 ms (into
   L1 at the same distance: no gain). */
#define GK_PREFETCH_BYTES 16384
int gk_x86_avx512f(void);
int gk_x86_avx512vnni(void);
int few_rows_linear_x86(const float *x, const float *w, const float *b, float *y, int M, int N,
                        int K, int threads);
int int8_rows_linear_x86(const float *x, const int8_t *q, const float *scale, const float *b,
                         float *y, int M, int N, int K, int threads);
int bf16_rows_linear_x86(const float *x, const uint16_t *w, const float *b, float *y, int M,
                         int N, int K, int threads);
int q8_rows_linear_x86(const float *x, const int8_t *q, const float *scale, const float *b,
                       float *y, int M, int N, int K, int threads);
int gelu_tanh_x86(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride,
                  int threads);
int decode_attention_x86(const float *q, const float *k, const float *v, const uint8_t *mask,
                         float *out, int64_t B, int64_t H, int64_t G, int64_t S, int64_t D,
                         int64_t q_sb, int64_t q_sh, int64_t kv_sb, int64_t kv_sh, int64_t kv_ss,
                         int64_t m_sb, float scale, int threads);
int target_log_probs_x86(const float *logits, const int64_t *targets, float *out, int64_t *argmax,
                         int64_t N, int64_t V, int64_t stride, int threads);
#endif

#endif
