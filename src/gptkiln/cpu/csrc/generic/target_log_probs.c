/* log softmax(logits)[target] of every row (and its argmax, the first of equal largest), without
   writing the log-softmax, in plain C: the reference of x86/target_log_probs.c, and what runs
   where there is no AVX-512. The exponentials' sum and the log in fp64. */
#include <math.h>
#include <stdint.h>

#include "../gptkiln_cpu.h"

int target_log_probs_generic(const float *logits, const int64_t *targets, float *out,
                             int64_t *argmax, int64_t N, int64_t V, int64_t stride, int threads) {
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(| : bad)
    for (int64_t n = 0; n < N; n++) {
        const float *row = logits + n * stride;
        int64_t target = targets[n];
        if (target < 0 || target >= V) {
            bad = 1;
            continue;
        }
        float top = -INFINITY;
        int64_t top_at = 0;
        for (int64_t v = 0; v < V; v++)
            if (row[v] > top) { /* strictly: the first of equal largest stays */
                top = row[v];
                top_at = v;
            }
        double sum = 0.0;
        for (int64_t v = 0; v < V; v++) sum += exp((double)row[v] - (double)top);
        out[n] = (float)((double)row[target] - (double)top - log(sum));
        if (argmax) argmax[n] = top_at;
    }
    return bad ? -1 : 0;
}
