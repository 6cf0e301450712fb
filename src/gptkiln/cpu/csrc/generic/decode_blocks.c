/* One decode step through all of GPT-2's blocks and its final norm, in one call: for a few rows
   of one new token each, x (B, C) -> ln_f(block_L(... block_1(x))), writing each layer's new
   keys and values into its KV cache on the way.

   Used by gptkiln.cpu.blocks.DecodeBlocks (the step a gptkiln.cpu.DecodePlan gives a GPT-2 once
   the tuner has chosen this project's own loops for every block product at that many rows). The torch path it replaces runs the same loops one layer
   at a time from Python: at batch 1 on a 2-core Xeon that spent ~0.5 ms a block in the
   interpreter and in small ATen calls (views, norms, adds, the cache write) around ~0.6 ms of
   products; llama.cpp runs the whole step as one graph in C, and so does this.

   A block, as gptkiln.model.Block computes it (GPT-2, pre-norm, no dropout: eval or p = 0):
       h = LN_1(x); qkv = h W_attn^T + b; keys and values to the cache at `pos`;
       a = softmax(q k^T / sqrt(D)) v over the S = pos + 1 cached positions (a row's mask: the
       keys it may see, left padding); x += a W_proj^T + b;
       h = LN_2(x); f = gelu_tanh(h W_fc^T + b); x += f W_mproj^T + b.
   The products are the library's row loops (fp32 weights, bf16 ones, int8 ones with a scale
   per output row, or int8 times 8-bit activations), each the one the tuner gave its layer, the
   attention and the GELU the library's: this file calls their entry points (gptkiln_cpu.h,
   which pick the AVX-512 or the generic version), so the step is exactly their sequence,
   without the interpreter between them, and one source serves both builds. LayerNorm is here,
   in plain C: the mean, then the mean of the squared deviations (biased, as torch's), in fp32.

   Nothing here includes Python's or torch's headers. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../gptkiln_cpu.h"

/* A layer's table: 18 addresses (see TABLE_* below); a product's scale is NULL for fp32
   weights, its bias NULL for none, a norm's bias NULL for none. */
enum {
    LN1_W, LN1_B, ATTN_W, ATTN_S, ATTN_B, PROJ_W, PROJ_S, PROJ_B, LN2_W, LN2_B,
    FC_W, FC_S, FC_B, MPROJ_W, MPROJ_S, MPROJ_B, K_CACHE, V_CACHE, TABLE_SIZE
};

/* How a product runs (a layer's kernel, as the tuner chose it): the fp32 loop, the int8 loop
   (fp32 activations), the q8 loop (activations rounded to 8 bits), or the bf16 loop (the
   weight address is then a bf16 copy's). */
enum { KIND_F32, KIND_INT8, KIND_Q8, KIND_BF16 };

/* y (B, N) = x (B, K) W^T (* scale) + b, by the loop of its kind; -1 for a kind that does not
   fit the weight (fp32 weights have no scale, int8 ones have one). */
static int product(int kind, const float *x, const void *w, const float *s, const float *b,
                   float *y, int B, int N, int K, int threads) {
    if (kind == KIND_F32 && !s) return few_rows_linear(x, (const float *)w, b, y, B, N, K, threads);
    if (kind == KIND_BF16 && !s)
        return bf16_rows_linear(x, (const uint16_t *)w, b, y, B, N, K, threads);
    if (kind == KIND_INT8 && s) return int8_rows_linear(x, (const int8_t *)w, s, b, y, B, N, K, threads);
    if (kind == KIND_Q8 && s) return q8_rows_linear(x, (const int8_t *)w, s, b, y, B, N, K, threads);
    return -1;
}

/* y (B, C) = LayerNorm(x) with weight w and bias b (or none); sums in 16 lanes, as vectors. */
static void layer_norm(const float *x, const float *w, const float *b, float *y, int B, int C,
                       float eps) {
    for (int r = 0; r < B; r++) {
        const float *xr = x + (size_t)r * C;
        float *yr = y + (size_t)r * C;
        float lanes[16] = {0}, sq[16] = {0};
        for (int i = 0; i < C; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += xr[i + l];
        float sum = 0.f;
        for (int l = 0; l < 16; l++) sum += lanes[l];
        float mean = sum / (float)C;
        for (int i = 0; i < C; i += 16)
            for (int l = 0; l < 16; l++) {
                float d = xr[i + l] - mean;
                sq[l] += d * d;
            }
        float var = 0.f;
        for (int l = 0; l < 16; l++) var += sq[l];
        float inv = 1.0f / sqrtf(var / (float)C + eps);
        for (int i = 0; i < C; i++) yr[i] = (xr[i] - mean) * inv * w[i] + (b ? b[i] : 0.f);
    }
}

static void add_into(float *x, const float *y, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] += y[i];
}

/* x (B, C): each row's embedded token, updated in place through the blocks; out (B, C):
   ln_f(x). table: n_layer * TABLE_SIZE addresses; kinds: n_layer * 4 product kinds (KIND_*:
   c_attn, attention c_proj, c_fc, MLP c_proj). H heads of D (C = H * D), F the MLP's width.
   Caches (B, H, S_max, D) contiguous; the new token goes to position pos (< S_max), and the
   attention reads positions 0..pos; mask (B, pos + 1) bytes (nonzero: may attend) or NULL.
   C, D and F multiples of 16, D <= 256, 1 <= B <= GK_MAX_ROWS (the caller checks; refused: -1).
   Returns 0, -1 for arguments refused, -2 when scratch memory cannot be had. */
int gpt2_decode_blocks(const int64_t *table, const char *kinds, int n_layer, float *x, float *out,
                       int B, int C, int H, int D, int F, int64_t S_max, int64_t pos,
                              const uint8_t *mask, float eps, const float *lnf_w,
                              const float *lnf_b, int threads) {
    if (n_layer < 1 || B < 1 || B > GK_MAX_ROWS || C % 16 || F % 16 || D % 16 || D > GK_MAX_D ||
        H * D != C || pos < 0 || pos >= S_max)
        return -1;
    size_t bc = (size_t)B * C;
    float *scratch = (float *)malloc(sizeof(float) * (bc * 6 + (size_t)B * F));
    if (!scratch) return -2;
    float *h = scratch, *qkv = h + bc, *att = qkv + 3 * bc, *y = att + bc, *f = y + bc;
    int64_t S = pos + 1;
    int status = 0;
    for (int l = 0; l < n_layer && status == 0; l++) {
        const int64_t *t = table + (size_t)l * TABLE_SIZE;
        const char *kind = kinds + (size_t)l * 4;
#define P(i) ((const float *)(intptr_t)t[i])
        layer_norm(x, P(LN1_W), P(LN1_B), h, B, C, eps);
        status |= product(kind[0], h, P(ATTN_W), P(ATTN_S), P(ATTN_B), qkv, B, 3 * C, C, threads);
        float *kc = (float *)(intptr_t)t[K_CACHE], *vc = (float *)(intptr_t)t[V_CACHE];
        for (int r = 0; r < B; r++)
            for (int hd = 0; hd < H; hd++) {
                size_t at = (((size_t)r * H + hd) * S_max + pos) * D;
                memcpy(kc + at, qkv + (size_t)r * 3 * C + C + hd * D, sizeof(float) * D);
                memcpy(vc + at, qkv + (size_t)r * 3 * C + 2 * C + hd * D, sizeof(float) * D);
            }
        status |= decode_attention(qkv, kc, vc, mask, att, B, H, H, S, D, 3 * C, D,
                                   H * S_max * D, S_max * D, D, S, 1.0f / sqrtf((float)D),
                                   threads);
        status |= product(kind[1], att, P(PROJ_W), P(PROJ_S), P(PROJ_B), y, B, C, C, threads);
        add_into(x, y, bc);
        layer_norm(x, P(LN2_W), P(LN2_B), h, B, C, eps);
        status |= product(kind[2], h, P(FC_W), P(FC_S), 0, f, B, F, C, threads);
        gelu_tanh(f, P(FC_B), B, F, F, threads);
        status |= product(kind[3], f, P(MPROJ_W), P(MPROJ_S), P(MPROJ_B), y, B, C, F, threads);
        add_into(x, y, bc);
#undef P
    }
    if (status == 0) layer_norm(x, lnf_w, lnf_b, out, B, C, eps);
    free(scratch);
    return status ? (status == -2 ? -2 : -1) : 0;
}

/* ---- Llama 3 and Qwen3 --------------------------------------------------------------------

   A block, as gptkiln.model.Block computes it for these families (pre-norm RMSNorm, no
   dropout):
       h = RMS_1(x); q = h Wq^T (+ b), k = h Wk^T (+ b), v = h Wv^T (+ b), H query heads and
       G key/value heads of D; with Qwen3's q/k norms each head of q and k through its RMSNorm
       (weights of D, shared by the heads); q and k turned by RoPE at the row's position (cos
       and sin given, a row of D each: pair i is dims i and i + D/2); keys and values to the
       cache at `pos`; a = softmax(q k^T / sqrt(D)) v, query head j reading key head
       j / (H / G); x += a Wo^T (+ b);
       h = RMS_2(x); x += (silu(h Wg^T) * (h Wu^T)) Wd^T (+ b's).
   The same products, attention and row loops as GPT-2's step above: one source for both. */

/* A Llama/Qwen3 layer's table: 27 addresses; a product's scale NULL for fp32 or bf16 weights,
   a bias NULL for none, QN_W and KN_W NULL without q/k norms. */
enum {
    L_RMS1, L_Q_W, L_Q_S, L_Q_B, L_K_W, L_K_S, L_K_B, L_V_W, L_V_S, L_V_B, L_QN, L_KN,
    L_O_W, L_O_S, L_O_B, L_RMS2, L_G_W, L_G_S, L_G_B, L_U_W, L_U_S, L_U_B, L_D_W, L_D_S,
    L_D_B, L_K_CACHE, L_V_CACHE, L_TABLE_SIZE
};

/* y (rows, n) = x / sqrt(mean(x^2) + eps) * w, row by row; sums in 16 lanes where n allows. */
static void rms_norm(const float *x, const float *w, float *y, int64_t rows, int n, float eps) {
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * n;
        float *yr = y + r * n;
        float lanes[16] = {0};
        for (int i = 0; i < n; i += 16)
            for (int l = 0; l < 16; l++) lanes[l] += xr[i + l] * xr[i + l];
        float sq = 0.f;
        for (int l = 0; l < 16; l++) sq += lanes[l];
        float inv = 1.0f / sqrtf(sq / (float)n + eps);
        for (int i = 0; i < n; i++) yr[i] = xr[i] * inv * w[i];
    }
}

/* Each of the `heads` heads of D in x (rows of heads * D) turned by its row's cos and sin (D
   each): the "rotate half" of gptkiln.positions.apply_rope. */
static void rope(float *x, const float *cos, const float *sin, int B, int heads, int D) {
    int half = D / 2;
    for (int r = 0; r < B; r++) {
        const float *c = cos + (size_t)r * D, *s = sin + (size_t)r * D;
        for (int hd = 0; hd < heads; hd++) {
            float *v = x + ((size_t)r * heads + hd) * D;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                v[i] = a * c[i] - b * s[i];
                v[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
    }
}

/* g = silu(g) * u, n values. */
static void silu_times(float *g, const float *u, size_t n) {
    for (size_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* x (B, C): each row's embedded token, updated in place through the blocks; out (B, C): the
   final RMSNorm (weight norm_w) of x. table: n_layer * L_TABLE_SIZE addresses; kinds: n_layer
   * 7 product kinds (KIND_*: q, k, v, o, gate, up, down). H query heads and G key/value heads
   of D (H % G == 0), F the MLP's width. Caches (B, G, S_max, D) contiguous; the new token goes
   to position pos, the attention reads positions 0..pos; mask (B, pos + 1) bytes or NULL;
   cos, sin (B, D): each row's rotation (its own position, left padding counted). C, F and D
   multiples of 16, D <= GK_MAX_D, 1 <= B <= GK_MAX_ROWS. Returns 0, -1 for arguments refused,
   -2 when scratch memory cannot be had. */
int llama_decode_blocks(const int64_t *table, const char *kinds, int n_layer, float *x,
                        float *out, int B, int C, int H, int G, int D, int F, int64_t S_max,
                        int64_t pos, const uint8_t *mask, const float *cos, const float *sin,
                        float eps, const float *norm_w, int threads) {
    if (n_layer < 1 || B < 1 || B > GK_MAX_ROWS || C % 16 || F % 16 || D % 16 || D > GK_MAX_D ||
        G < 1 || H % G || pos < 0 || pos >= S_max)
        return -1;
    size_t bc = (size_t)B * C, bq = (size_t)B * H * D, bk = (size_t)B * G * D;
    float *scratch = (float *)malloc(sizeof(float) * (2 * bc + 2 * bq + 2 * bk + 2 * (size_t)B * F));
    if (!scratch) return -2;
    float *h = scratch, *y = h + bc, *q = y + bc, *att = q + bq, *k = att + bq, *v = k + bk;
    float *gate = v + bk, *up = gate + (size_t)B * F;
    int64_t S = pos + 1;
    int status = 0;
    for (int l = 0; l < n_layer && status == 0; l++) {
        const int64_t *t = table + (size_t)l * L_TABLE_SIZE;
        const char *kind = kinds + (size_t)l * 7;
#define P(i) ((const float *)(intptr_t)t[i])
        rms_norm(x, P(L_RMS1), h, B, C, eps);
        status |= product(kind[0], h, P(L_Q_W), P(L_Q_S), P(L_Q_B), q, B, H * D, C, threads);
        status |= product(kind[1], h, P(L_K_W), P(L_K_S), P(L_K_B), k, B, G * D, C, threads);
        status |= product(kind[2], h, P(L_V_W), P(L_V_S), P(L_V_B), v, B, G * D, C, threads);
        if (status) break;
        if (P(L_QN)) {
            rms_norm(q, P(L_QN), q, (int64_t)B * H, D, eps);
            rms_norm(k, P(L_KN), k, (int64_t)B * G, D, eps);
        }
        rope(q, cos, sin, B, H, D);
        rope(k, cos, sin, B, G, D);
        float *kc = (float *)(intptr_t)t[L_K_CACHE], *vc = (float *)(intptr_t)t[L_V_CACHE];
        for (int r = 0; r < B; r++)
            for (int g = 0; g < G; g++) {
                size_t at = (((size_t)r * G + g) * S_max + pos) * D;
                memcpy(kc + at, k + ((size_t)r * G + g) * D, sizeof(float) * D);
                memcpy(vc + at, v + ((size_t)r * G + g) * D, sizeof(float) * D);
            }
        status |= decode_attention(q, kc, vc, mask, att, B, H, G, S, D, (int64_t)H * D, D,
                                   (int64_t)G * S_max * D, S_max * D, D, S,
                                   1.0f / sqrtf((float)D), threads);
        status |= product(kind[3], att, P(L_O_W), P(L_O_S), P(L_O_B), y, B, C, H * D, threads);
        add_into(x, y, bc);
        rms_norm(x, P(L_RMS2), h, B, C, eps);
        status |= product(kind[4], h, P(L_G_W), P(L_G_S), P(L_G_B), gate, B, F, C, threads);
        status |= product(kind[5], h, P(L_U_W), P(L_U_S), P(L_U_B), up, B, F, C, threads);
        if (status) break;
        silu_times(gate, up, (size_t)B * F);
        status |= product(kind[6], gate, P(L_D_W), P(L_D_S), P(L_D_B), y, B, C, F, threads);
        add_into(x, y, bc);
#undef P
    }
    if (status == 0) rms_norm(x, norm_w, out, B, C, eps);
    free(scratch);
    return status ? (status == -2 ? -2 : -1) : 0;
}
