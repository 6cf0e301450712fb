/* log softmax(logits)[target] of every row, without writing the log-softmax: for scoring.

   Used by gptkiln.evaluate (through gptkiln.cpu.library, which compiles this file once per machine
   and loads it with ctypes), where the head's logits of up to a thousand positions (200 MB for
   GPT-2's 50,257 tokens) need one number a row: the target token's log-probability (and, when
   asked, whether the target is the row's argmax). torch's log_softmax writes a second 200 MB
   tensor that the gather then reads again; here each row is read from memory once (its max and
   argmax), then again from L2 (the sum of exponentials), and nothing is written but the answers.

   The exponentials are fp32 (vexp.h: a degree-6 polynomial on [-ln2/2, ln2/2], scaled by 2^n with
   vscalefps: within 2 ulp), their sum is kept in fp64, the log in fp64: at least as close to the
   exact log-probability as torch's fp32 log_softmax. Nothing here includes Python's or torch's
   headers. */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "../gptkiln_cpu.h"
#include "vexp.h"

#define AVX512 __attribute__((target("avx512f")))

static AVX512 void one_row(const float *row, int64_t V, int64_t target, float *out,
                           int64_t *argmax) {
    /* pass 1: the max and its first index */
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i best_at = _mm512_set1_epi32(0);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i sixteen = _mm512_set1_epi32(16);
    int64_t v = 0;
    for (; v + 16 <= V; v += 16) {
        __m512 x = _mm512_loadu_ps(row + v);
        __mmask16 more = _mm512_cmp_ps_mask(x, best, _CMP_GT_OQ); /* strictly: the first stays */
        best = _mm512_mask_mov_ps(best, more, x);
        best_at = _mm512_mask_mov_epi32(best_at, more, at);
        at = _mm512_add_epi32(at, sixteen);
    }
    float lanes[16];
    int32_t lane_at[16];
    _mm512_storeu_ps(lanes, best);
    _mm512_storeu_si512(lane_at, best_at);
    float top = -INFINITY;
    int64_t top_at = -1;
    for (int i = 0; i < 16; i++) /* the lanes' maxima: the lowest index among equals */
        if (lanes[i] > top || (lanes[i] == top && lane_at[i] < top_at)) {
            top = lanes[i];
            top_at = lane_at[i];
        }
    for (; v < V; v++)
        if (row[v] > top) {
            top = row[v];
            top_at = v;
        }
    /* pass 2: the sum of exp(x - max), in fp64 */
    const __m512 m = _mm512_set1_ps(top);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (v = 0; v + 16 <= V; v += 16) {
        __m512 e = exp_le0(_mm512_sub_ps(_mm512_loadu_ps(row + v), m));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    double sum = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
    for (; v < V; v++) sum += exp((double)row[v] - (double)top);
    *out = (float)((double)row[target] - (double)top - log(sum));
    if (argmax) *argmax = top_at;
}

/* logits (N, V) fp32, rows `stride` floats apart; targets (N,) int64 in [0, V); out (N,) fp32;
   argmax (N,) int64 or NULL. Returns 0, or -1 for a target out of range (nothing written for
   that row). */
AVX512 int target_log_probs_x86(const float *logits, const int64_t *targets, float *out,
                            int64_t *argmax, int64_t N, int64_t V, int64_t stride, int threads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t n = 0; n < N; n++) {
        if (targets[n] < 0 || targets[n] >= V) {
            bad = 1;
            continue;
        }
        one_row(logits + n * stride, V, targets[n], out + n, argmax ? argmax + n : 0);
    }
    return bad ? -1 : 0;
}
