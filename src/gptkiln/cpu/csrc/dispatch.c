/* The library's entry points (gptkiln_cpu.h): each calls the AVX-512 version of its kernel where
   the library holds one (an x86-64 build, GK_X86) and the CPU runs it, else the plain-C one. */
#include "gptkiln_cpu.h"

#ifdef GK_X86
#define USE_X86 gk_x86_avx512f()
#define USE_VNNI gk_x86_avx512vnni()
#else
#define USE_X86 0
#define USE_VNNI 0
#endif

#ifdef GK_X86
#define PICK(NAME, ...) return USE_X86 ? NAME##_x86(__VA_ARGS__) : NAME##_generic(__VA_ARGS__)
#else
#define PICK(NAME, ...) return NAME##_generic(__VA_ARGS__)
#endif

int gk_avx512(void) { return USE_X86; }

int gk_q8_vnni(void) { return USE_VNNI; }

int few_rows_linear(const float *x, const float *w, const float *b, float *y, int M, int N, int K,
                    int threads) {
    PICK(few_rows_linear, x, w, b, y, M, N, K, threads);
}

int int8_rows_linear(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                     int M, int N, int K, int threads) {
    PICK(int8_rows_linear, x, q, scale, b, y, M, N, K, threads);
}

int bf16_rows_linear(const float *x, const uint16_t *w, const float *b, float *y, int M, int N,
                     int K, int threads) {
    PICK(bf16_rows_linear, x, w, b, y, M, N, K, threads);
}

int q8_rows_linear(const float *x, const int8_t *q, const float *scale, const float *b, float *y,
                   int M, int N, int K, int threads) {
#ifdef GK_X86
    if (USE_VNNI) return q8_rows_linear_x86(x, q, scale, b, y, M, N, K, threads);
#endif
    return q8_rows_linear_generic(x, q, scale, b, y, M, N, K, threads);
}

int gelu_tanh(float *y, const float *bias, int64_t rows, int64_t cols, int64_t stride,
              int threads) {
    PICK(gelu_tanh, y, bias, rows, cols, stride, threads);
}

int decode_attention(const float *q, const float *k, const float *v, const uint8_t *mask,
                     float *out, int64_t B, int64_t H, int64_t G, int64_t S, int64_t D,
                     int64_t q_sb, int64_t q_sh, int64_t kv_sb, int64_t kv_sh, int64_t kv_ss,
                     int64_t m_sb, float scale, int threads) {
    PICK(decode_attention, q, k, v, mask, out, B, H, G, S, D, q_sb, q_sh, kv_sb, kv_sh, kv_ss,
         m_sb, scale, threads);
}

int target_log_probs(const float *logits, const int64_t *targets, float *out, int64_t *argmax,
                     int64_t N, int64_t V, int64_t stride, int threads) {
    PICK(target_log_probs, logits, targets, out, argmax, N, V, stride, threads);
}
