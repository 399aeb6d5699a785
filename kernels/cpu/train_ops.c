/* Fused fp32 training kernels for the CPU: RMSNorm, packed SwiGLU, RoPE over a fused q|k|v
 * projection and token cross entropy, each forward and backward in one pass over its rows
 * (kernels/cpu/fused.py wraps them in autograd functions and keeps torch's ops for the rest).
 *
 * Why: on a CPU a training step of a small or mid-size decoder spends a quarter of its time in
 * the elementwise ops around the matrix products. The eager forms run 5-15 torch ops per norm,
 * activation or rotation, and their backward as many again, each a full pass over [N, E] or
 * [N, F] tensors; autograd's split/chunk backward also concatenates the gradient of a fused
 * projection's output (a [N, 2F] copy per MLP). Here each is one OpenMP loop over rows that
 * reads its inputs once and writes its outputs once, and the fused projections' gradients are
 * written in place into one buffer.
 *
 *   rms_norm_fwd(x, w, rstd, out, N, E, threads)            -- rstd [N] from torch (below)
 *   rms_norm_bwd(x, w, rstd, dy, dx, dw, N, E, threads)      -- dw [E] is overwritten
 *   swiglu_fwd(gu, out, N, F, threads)                       -- gu [N, 2F] = gate | up
 *   swiglu_bwd(gu, dout, dgu, N, F, threads)
 *   rope_qkv_fwd(qkv, cos, sin, q, k, v, B, S, H, K, D, cos_batch, threads)
 *   rope_qkv_bwd(dq, dk, dv, cos, sin, dqkv, B, S, H, K, D, cos_batch, threads)
 *   ce_fwd(logits, labels, valid, loss, lse, N, V, z, threads)
 *   ce_bwd(logits, labels, lse, weight, grad, N, V, z, threads)
 *   attn_fwd(q, k, v, out, lse, B, S, H, K, D, scale, threads)    -- causal, D % 16 == 0
 *   attn_bwd(q, k, v, out, dout, lse, dq, dk, dv, B, S, H, K, D, scale, threads)
 *   simd() -> bool
 *
 * Addresses are ints (tensor.data_ptr()); every tensor is contiguous fp32 except labels
 * (int64) and valid (bool, one byte). The caller checks shapes, dtypes and contiguity; the
 * calls here reject null addresses, non-positive sizes and out-of-vocabulary labels.
 *
 * Numerics: the elementwise formulas are torch's, evaluated in the same order, so RoPE (no exp,
 * no sum) and RMSNorm's forward (its rstd comes from torch's reduction) are bit-identical to the
 * eager forms. exp is a degree-6 polynomial after range reduction (~1 ulp), and the row sums of
 * RMSNorm's backward and of the softmax run in 8 lanes, so those agree with torch to fp32
 * rounding (tested with tolerances in
 * tests/kernels/test_cpu_fused.py). Built with -ffp-contract=off so that no a*b+c is fused
 * where torch rounds twice. Per-row results do not depend on the thread count; RMSNorm's weight
 * gradient is summed per thread and then over threads in a fixed order.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* e^x for 8 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n in the
 * exponent bits. Inputs are clamped to [-87.3, 88.7] (no overflow, no denormal scale); NaN passes
 * through (the clamps keep their second operand on NaN). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(88.7f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

static inline float exp1(float x) {
    float in[8] = {x}, out[8];
    _mm256_storeu_ps(out, exp8(_mm256_loadu_ps(in)));
    return out[0];
}

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* ---- RMSNorm: out = w * (x * rstd) (HF's order), rstd = 1 / sqrt(mean(x^2) + eps) computed by
 * the caller with torch's own reduction, so the forward is bit-identical to HF's -------------- */

static void rms_norm_fwd_(const float *x, const float *w, const float *rstd, float *out, long N,
                          long E, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *xr = x + n * E;
        float *o = out + n * E;
        const float r = rstd[n];
        for (long e = 0; e < E; e++) o[e] = w[e] * (xr[e] * r);
    }
}

/* d x = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * rstd;
 * d w = sum over rows of dy * xhat. */
static int rms_norm_bwd_(const float *x, const float *w, const float *rstd, const float *dy,
                         float *dx, float *dw, long N, long E, int threads) {
    float *partial = calloc((size_t)threads * (size_t)E, sizeof(float));
    if (!partial) return -1;
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num();
        float *acc = partial + (long)t * E;
#pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            const float *xr = x + n * E, *g = dy + n * E;
            float *d = dx + n * E;
            const float r = rstd[n];
            __m256 dot8 = _mm256_setzero_ps();
            const __m256 r8 = _mm256_set1_ps(r);
            long e = 0;
            for (; e + 8 <= E; e += 8) {
                const __m256 xh = _mm256_mul_ps(_mm256_loadu_ps(xr + e), r8);
                const __m256 g8 = _mm256_loadu_ps(g + e);
                dot8 = _mm256_fmadd_ps(_mm256_mul_ps(g8, _mm256_loadu_ps(w + e)), xh, dot8);
                _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(g8, xh, _mm256_loadu_ps(acc + e)));
            }
            float dot = hsum8(dot8);
            for (; e < E; e++) {
                const float xh = xr[e] * r;
                dot += g[e] * w[e] * xh;
                acc[e] += g[e] * xh;
            }
            const float c = dot / (float)E;
            for (e = 0; e < E; e++) d[e] = r * (g[e] * w[e] - xr[e] * r * c);
        }
    }
    for (long e = 0; e < E; e++) dw[e] = 0.f;
    for (int t = 0; t < threads; t++)
        for (long e = 0; e < E; e++) dw[e] += partial[(long)t * E + e];
    free(partial);
    return 0;
}

/* ---- SwiGLU over gate | up: out = silu(g) * u, silu(g) = g / (1 + e^-g) (torch's form) ----- */

static void swiglu_fwd_(const float *gu, float *out, long N, long F, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *g = gu + n * 2 * F, *u = g + F;
        float *o = out + n * F;
        long f = 0;
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; f + 8 <= F; f += 8) {
            const __m256 g8 = _mm256_loadu_ps(g + f);
            const __m256 silu = _mm256_div_ps(g8, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g8))));
            _mm256_storeu_ps(o + f, _mm256_mul_ps(silu, _mm256_loadu_ps(u + f)));
        }
        for (; f < F; f++) o[f] = g[f] / (1.f + exp1(-g[f])) * u[f];
    }
}

/* d g = dout * u * s * (1 + g * (1 - s)), d u = dout * silu(g), s = sigmoid(g) (torch's
 * silu_backward; silu as g * s here, one division per element); written into dgu's gate and up
 * halves. */
static void swiglu_bwd_(const float *gu, const float *dout, float *dgu, long N, long F,
                        int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *g = gu + n * 2 * F, *u = g + F, *d = dout + n * F;
        float *dg = dgu + n * 2 * F, *du = dg + F;
        long f = 0;
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; f + 8 <= F; f += 8) {
            const __m256 g8 = _mm256_loadu_ps(g + f), d8 = _mm256_loadu_ps(d + f);
            const __m256 denom = _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g8)));
            const __m256 s = _mm256_div_ps(one, denom), silu = _mm256_mul_ps(g8, s);
            const __m256 dsilu = _mm256_mul_ps(d8, _mm256_loadu_ps(u + f));
            const __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(g8, _mm256_sub_ps(one, s)));
            _mm256_storeu_ps(du + f, _mm256_mul_ps(d8, silu));
            _mm256_storeu_ps(dg + f, _mm256_mul_ps(_mm256_mul_ps(dsilu, s), slope));
        }
        for (; f < F; f++) {
            const float e = exp1(-g[f]);
            const float s = 1.f / (1.f + e), silu = g[f] * s;
            du[f] = d[f] * silu;
            dg[f] = d[f] * u[f] * s * (1.f + g[f] * (1.f - s));
        }
    }
}

/* ---- RoPE (rotate-half) over q|k of a fused [B, S, H + 2K, D] projection -------------------
 * out = x * c + rotate_half(x) * s with rotate_half(x) = (-x[h:], x[:h]); v is copied out. The
 * backward is the transposed rotation, written with dv into one [B, S, H + 2K, D] gradient. */

static inline void rotate(const float *x, const float *c, const float *s, float *o, long D) {
    const long h = D / 2;
    for (long i = 0; i < h; i++) o[i] = x[i] * c[i] + (-x[i + h]) * s[i];
    for (long i = h; i < D; i++) o[i] = x[i] * c[i] + x[i - h] * s[i];
}

static inline void unrotate(const float *dy, const float *c, const float *s, float *dx, long D) {
    const long h = D / 2;
    for (long i = 0; i < h; i++) dx[i] = dy[i] * c[i] + dy[i + h] * s[i + h];
    for (long i = h; i < D; i++) dx[i] = dy[i] * c[i] + (-(dy[i - h] * s[i - h]));
}

static void rope_qkv_fwd_(const float *qkv, const float *cos, const float *sin, float *q, float *k,
                          float *v, long B, long S, long H, long K, long D, int cos_batch,
                          int threads) {
    const long X = H + 2 * K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bs = 0; bs < B * S; bs++) {
        const long b = bs / S, s = bs % S;
        const float *row = qkv + bs * X * D;
        const long cs = ((cos_batch ? b : 0) * S + s) * D;
        for (long j = 0; j < H; j++) rotate(row + j * D, cos + cs, sin + cs, q + (bs * H + j) * D, D);
        for (long j = 0; j < K; j++)
            rotate(row + (H + j) * D, cos + cs, sin + cs, k + (bs * K + j) * D, D);
        memcpy(v + bs * K * D, row + (H + K) * D, (size_t)(K * D) * sizeof(float));
    }
}

static void rope_qkv_bwd_(const float *dq, const float *dk, const float *dv, const float *cos,
                          const float *sin, float *dqkv, long B, long S, long H, long K, long D,
                          int cos_batch, int threads) {
    const long X = H + 2 * K;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long bs = 0; bs < B * S; bs++) {
        const long b = bs / S, s = bs % S;
        float *row = dqkv + bs * X * D;
        const long cs = ((cos_batch ? b : 0) * S + s) * D;
        for (long j = 0; j < H; j++) {
            if (dq) unrotate(dq + (bs * H + j) * D, cos + cs, sin + cs, row + j * D, D);
            else memset(row + j * D, 0, (size_t)D * sizeof(float));
        }
        for (long j = 0; j < K; j++) {
            if (dk) unrotate(dk + (bs * K + j) * D, cos + cs, sin + cs, row + (H + j) * D, D);
            else memset(row + (H + j) * D, 0, (size_t)D * sizeof(float));
        }
        if (dv) memcpy(row + (H + K) * D, dv + bs * K * D, (size_t)(K * D) * sizeof(float));
        else memset(row + (H + K) * D, 0, (size_t)(K * D) * sizeof(float));
    }
}

/* ---- Token cross entropy: loss = lse - x[label] + z lse^2; 0 where not valid ---------------- */

static float row_max(const float *x, long V) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    long i = 0;
    for (; i + 8 <= V; i += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(x + i));
    float m[8];
    _mm256_storeu_ps(m, m8);
    float best = m[0];
    for (int j = 1; j < 8; j++) best = best > m[j] ? best : m[j];
    for (; i < V; i++) best = best > x[i] ? best : x[i];
    return best;
}

static float row_lse(const float *x, long V) {
    const float m = row_max(x, V);
    if (isinf(m)) return m; /* all -inf (lse -inf) or a +inf logit (lse +inf): as torch */
    const __m256 m8 = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= V; i += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), m8)));
    float sum = hsum8(acc);
    for (; i < V; i++) sum += exp1(x[i] - m);
    return m + logf(sum);
}

static void ce_fwd_(const float *logits, const long long *labels, const unsigned char *valid,
                    float *loss, float *lse, long N, long V, float z, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *x = logits + n * V;
        const float l = row_lse(x, V);
        lse[n] = l;
        const long label = labels[n] < 0 ? 0 : (long)labels[n];
        loss[n] = valid[n] ? l - x[label] + z * (l * l) : 0.f;
    }
}

/* grad = weight * (softmax(x) * (1 + 2 z lse) - onehot(label)) */
static void ce_bwd_(const float *logits, const long long *labels, const float *lse,
                    const float *weight, float *grad, long N, long V, float z, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long n = 0; n < N; n++) {
        const float *x = logits + n * V;
        float *g = grad + n * V;
        const float w = weight[n];
        if (w == 0.f) {
            memset(g, 0, (size_t)V * sizeof(float));
            continue;
        }
        const float l = lse[n], zs = 1.f + 2.f * z * l;
        const __m256 l8 = _mm256_set1_ps(l), zs8 = _mm256_set1_ps(zs), w8 = _mm256_set1_ps(w);
        long i = 0;
        for (; i + 8 <= V; i += 8) {
            __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), l8));
            if (z != 0.f) p = _mm256_mul_ps(p, zs8);
            _mm256_storeu_ps(g + i, _mm256_mul_ps(p, w8));
        }
        for (; i < V; i++) {
            float p = exp1(x[i] - l);
            if (z != 0.f) p *= zs;
            g[i] = p * w;
        }
        const long label = labels[n] < 0 ? 0 : (long)labels[n];
        const float p = exp1(x[label] - l) * (z != 0.f ? zs : 1.f);
        g[label] = (p + -1.f) * w;
    }
}

/* ---- Causal attention for training: q [B, S, H, D], k/v [B, S, K, D] (query head h reads kv
 * head h / (H / K)), out [B, S, H, D], lse [B, H, S] of the scaled scores, D a multiple of 16.
 * The forward keeps a block of 4 query rows of probabilities at a time; the backward recomputes
 * them from lse for one kv head's query heads at a time, with the full [S, S] probabilities and
 * score gradients of one head (the caller bounds S), so that dK and dV are sums over query rows
 * computed as products, not scattered updates. Every product is the 4 x 16 tile below. ------ */

#define QB 4 /* query rows per block (the tile's rows) */

/* c[r][0..15] (+)= alpha * sum_l a_r[l * al] * b[l * ldb + 0..15] for r < nr, a_r = a + r * ar.
 * Rows r >= nr read row 0 and are not stored. */
static inline void tile4x16(const float *a, long ar, long al, const float *b, long ldb, long L,
                            float *c, long ldc, int nr, float alpha, int accumulate) {
    const float *a0 = a, *a1 = a + (nr > 1 ? ar : 0), *a2 = a + (nr > 2 ? 2 * ar : 0),
                *a3 = a + (nr > 3 ? 3 * ar : 0);
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00,
           c30 = c00, c31 = c00;
    for (long l = 0; l < L; l++) {
        const float *bl = b + l * ldb;
        const __m256 b0 = _mm256_loadu_ps(bl), b1 = _mm256_loadu_ps(bl + 8);
        const long o = l * al;
        __m256 x = _mm256_broadcast_ss(a0 + o);
        c00 = _mm256_fmadd_ps(x, b0, c00);
        c01 = _mm256_fmadd_ps(x, b1, c01);
        x = _mm256_broadcast_ss(a1 + o);
        c10 = _mm256_fmadd_ps(x, b0, c10);
        c11 = _mm256_fmadd_ps(x, b1, c11);
        x = _mm256_broadcast_ss(a2 + o);
        c20 = _mm256_fmadd_ps(x, b0, c20);
        c21 = _mm256_fmadd_ps(x, b1, c21);
        x = _mm256_broadcast_ss(a3 + o);
        c30 = _mm256_fmadd_ps(x, b0, c30);
        c31 = _mm256_fmadd_ps(x, b1, c31);
    }
    const __m256 acc[4][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}};
    const __m256 scale = _mm256_set1_ps(alpha);
    for (int r = 0; r < nr; r++) {
        float *cr = c + r * ldc;
        for (int half = 0; half < 2; half++) {
            __m256 val = _mm256_mul_ps(acc[r][half], scale);
            if (accumulate) val = _mm256_add_ps(_mm256_loadu_ps(cr + 8 * half), val);
            _mm256_storeu_ps(cr + 8 * half, val);
        }
    }
}

/* dst[d * SP + j] = src[j * stride + d] for j < S, 0 for S <= j < SP. */
static void transpose_rows(const float *src, long stride, long S, long D, float *dst, long SP) {
    for (long j = 0; j < S; j++)
        for (long d = 0; d < D; d++) dst[d * SP + j] = src[j * stride + d];
    for (long d = 0; d < D; d++)
        for (long j = S; j < SP; j++) dst[d * SP + j] = 0.f;
}

/* Lanes j0 + t < n of an 8-lane chunk starting at j0. */
static inline __m256 lanes_below(long n, long j0) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const long left = n - j0;
    return _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left > 8 ? 8 : left)), lane));
}

/* Row x[0..ncol) of scaled scores, n of them visible: x becomes softmax over the visible ones
 * (0 beyond), and *lse their log-sum-exp. */
static void softmax_row(float *x, long n, long ncol, float *lse) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (long j = 0; j < n; j += 8)
        m8 = _mm256_max_ps(m8, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_loadu_ps(x + j),
                                                lanes_below(n, j)));
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, m8);
    for (int t = 0; t < 8; t++) m = lanes[t] > m ? lanes[t] : m;
    const __m256 mm = _mm256_set1_ps(m);
    __m256 s8 = _mm256_setzero_ps();
    long j = 0;
    for (; j < n; j += 8) {
        const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mm)),
                                       lanes_below(n, j));
        _mm256_storeu_ps(x + j, e);
        s8 = _mm256_add_ps(s8, e);
    }
    const float sum = hsum8(s8);
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    for (long i = 0; i < j; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), inv));
    for (; j < ncol; j += 8) _mm256_storeu_ps(x + j, _mm256_setzero_ps());
    *lse = m + logf(sum);
}

static int attn_fwd_(const float *q, const float *k, const float *v, float *out, float *lse,
                     long B, long S, long H, long K, long D, float scale, int threads) {
    const long G = H / K, SP = (S + 15) / 16 * 16, qs = H * D, ks = K * D;
    const long per_thread = D * SP + QB * SP;
    if (threads > B * H) threads = (int)(B * H); /* one task per (batch, head) */
    float *scratch = malloc(sizeof(float) * (size_t)threads * (size_t)per_thread);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *kt = scratch + (long)omp_get_thread_num() * per_thread, *p = kt + D * SP;
#pragma omp for schedule(static)
        for (long task = 0; task < B * H; task++) {
            const long b = task / H, h = task % H, kv = h / G;
            const float *qb = q + b * S * qs + h * D, *vb = v + b * S * ks + kv * D;
            float *ob = out + b * S * qs + h * D, *lb = lse + task * S;
            transpose_rows(k + b * S * ks + kv * D, ks, S, D, kt, SP);
            for (long i0 = 0; i0 < S; i0 += QB) {
                const int nr = (int)(S - i0 < QB ? S - i0 : QB);
                const long nk = i0 + nr, ncol = (nk + 15) / 16 * 16;
                for (long j0 = 0; j0 < ncol; j0 += 16)
                    tile4x16(qb + i0 * qs, qs, 1, kt + j0, SP, D, p + j0, SP, nr, scale, 0);
                for (int r = 0; r < nr; r++) softmax_row(p + r * SP, i0 + r + 1, ncol, lb + i0 + r);
                for (long d0 = 0; d0 < D; d0 += 16)
                    tile4x16(p, SP, 1, vb + d0, ks, nk, ob + i0 * qs + d0, qs, nr, 1.f, 0);
            }
        }
    }
    free(scratch);
    return 0;
}

/* p = exp(x - lse) and ds = p * (dp - delta) over the n visible entries of a row, 0 up to ncol;
 * x (scaled scores) becomes p, dp becomes ds. */
static void grad_row(float *x, float *dp, long n, long ncol, float lse, float delta) {
    const __m256 l8 = _mm256_set1_ps(lse), d8 = _mm256_set1_ps(delta);
    long j = 0;
    for (; j < n; j += 8) {
        const __m256 keep = lanes_below(n, j);
        const __m256 p = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), l8)), keep);
        _mm256_storeu_ps(x + j, p);
        _mm256_storeu_ps(dp + j, _mm256_mul_ps(p, _mm256_sub_ps(_mm256_loadu_ps(dp + j), d8)));
    }
    for (; j < ncol; j += 8) {
        _mm256_storeu_ps(x + j, _mm256_setzero_ps());
        _mm256_storeu_ps(dp + j, _mm256_setzero_ps());
    }
}

static int attn_bwd_(const float *q, const float *k, const float *v, const float *out,
                     const float *dout, const float *lse, float *dq, float *dk, float *dv, long B,
                     long S, long H, long K, long D, float scale, int threads) {
    const long G = H / K, SP = (S + 15) / 16 * 16, qs = H * D, ks = K * D;
    const long per_thread = 2 * D * SP + 2 * SP * SP + SP;
    if (threads > B * K) threads = (int)(B * K); /* one task per (batch, kv head) */
    float *scratch = malloc(sizeof(float) * (size_t)threads * (size_t)per_thread);
    if (!scratch) return -1;
#pragma omp parallel num_threads(threads)
    {
        float *kt = scratch + (long)omp_get_thread_num() * per_thread, *vt = kt + D * SP,
              *p = vt + D * SP, *ds = p + SP * SP, *delta = ds + SP * SP;
#pragma omp for schedule(static)
        for (long task = 0; task < B * K; task++) {
            const long b = task / K, kv = task % K;
            const float *kb = k + b * S * ks + kv * D, *vb = v + b * S * ks + kv * D;
            float *dkb = dk + b * S * ks + kv * D, *dvb = dv + b * S * ks + kv * D;
            transpose_rows(kb, ks, S, D, kt, SP);
            transpose_rows(vb, ks, S, D, vt, SP);
            for (long j = 0; j < S; j++) {
                memset(dkb + j * ks, 0, sizeof(float) * (size_t)D);
                memset(dvb + j * ks, 0, sizeof(float) * (size_t)D);
            }
            for (long h = kv * G; h < (kv + 1) * G; h++) {
                const long off = b * S * qs + h * D;
                const float *qb = q + off, *ob = out + off, *gb = dout + off;
                const float *lb = lse + (b * H + h) * S;
                float *dqb = dq + off;
                for (long i = 0; i < S; i++) {
                    __m256 acc = _mm256_setzero_ps();
                    for (long d = 0; d < D; d += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(gb + i * qs + d),
                                              _mm256_loadu_ps(ob + i * qs + d), acc);
                    delta[i] = hsum8(acc);
                }
                for (long i0 = 0; i0 < S; i0 += QB) {
                    const int nr = (int)(S - i0 < QB ? S - i0 : QB);
                    const long nk = i0 + nr, ncol = (nk + 15) / 16 * 16;
                    float *pr = p + i0 * SP, *dr = ds + i0 * SP;
                    for (long j0 = 0; j0 < ncol; j0 += 16) {
                        tile4x16(qb + i0 * qs, qs, 1, kt + j0, SP, D, pr + j0, SP, nr, scale, 0);
                        tile4x16(gb + i0 * qs, qs, 1, vt + j0, SP, D, dr + j0, SP, nr, 1.f, 0);
                    }
                    for (int r = 0; r < nr; r++)
                        grad_row(pr + r * SP, dr + r * SP, i0 + r + 1, ncol, lb[i0 + r],
                                 delta[i0 + r]);
                    for (long d0 = 0; d0 < D; d0 += 16)
                        tile4x16(dr, SP, 1, kb + d0, ks, nk, dqb + i0 * qs + d0, qs, nr, scale, 0);
                }
                /* key rows j0.. sum over the query rows i >= j0 that see them */
                for (long j0 = 0; j0 < S; j0 += QB) {
                    const int nr = (int)(S - j0 < QB ? S - j0 : QB);
                    const long L = S - j0;
                    for (long d0 = 0; d0 < D; d0 += 16) {
                        tile4x16(ds + j0 * SP + j0, 1, SP, qb + j0 * qs + d0, qs, L,
                                 dkb + j0 * ks + d0, ks, nr, scale, 1);
                        tile4x16(p + j0 * SP + j0, 1, SP, gb + j0 * qs + d0, qs, L,
                                 dvb + j0 * ks + d0, ks, nr, 1.f, 1);
                    }
                }
            }
        }
    }
    free(scratch);
    return 0;
}

/* ---- Python bindings ------------------------------------------------------------------------ */

#define PTR(type, addr) ((type)(uintptr_t)(addr))

static int bad(const char *call) {
    PyErr_Format(PyExc_ValueError, "%s: a null address, a size below 1 or no threads", call);
    return 1;
}

static PyObject *py_rms_norm_fwd(PyObject *self, PyObject *args) {
    unsigned long long x, w, rstd, out;
    long long N, E;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKLLi", &x, &w, &rstd, &out, &N, &E, &threads)) return NULL;
    if (!x || !w || !rstd || !out || N < 1 || E < 1 || threads < 1) return bad("rms_norm_fwd"), NULL;
    Py_BEGIN_ALLOW_THREADS
    rms_norm_fwd_(PTR(const float *, x), PTR(const float *, w), PTR(const float *, rstd),
                  PTR(float *, out), (long)N, (long)E, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rms_norm_bwd(PyObject *self, PyObject *args) {
    unsigned long long x, w, rstd, dy, dx, dw;
    long long N, E;
    int threads, rc;
    if (!PyArg_ParseTuple(args, "KKKKKKLLi", &x, &w, &rstd, &dy, &dx, &dw, &N, &E, &threads))
        return NULL;
    if (!x || !w || !rstd || !dy || !dx || !dw || N < 1 || E < 1 || threads < 1)
        return bad("rms_norm_bwd"), NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = rms_norm_bwd_(PTR(const float *, x), PTR(const float *, w), PTR(const float *, rstd),
                       PTR(const float *, dy), PTR(float *, dx), PTR(float *, dw), (long)N, (long)E,
                       threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_swiglu_fwd(PyObject *self, PyObject *args) {
    unsigned long long gu, out;
    long long N, F;
    int threads;
    if (!PyArg_ParseTuple(args, "KKLLi", &gu, &out, &N, &F, &threads)) return NULL;
    if (!gu || !out || N < 1 || F < 1 || threads < 1) return bad("swiglu_fwd"), NULL;
    Py_BEGIN_ALLOW_THREADS
    swiglu_fwd_(PTR(const float *, gu), PTR(float *, out), (long)N, (long)F, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_swiglu_bwd(PyObject *self, PyObject *args) {
    unsigned long long gu, dout, dgu;
    long long N, F;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKLLi", &gu, &dout, &dgu, &N, &F, &threads)) return NULL;
    if (!gu || !dout || !dgu || N < 1 || F < 1 || threads < 1) return bad("swiglu_bwd"), NULL;
    Py_BEGIN_ALLOW_THREADS
    swiglu_bwd_(PTR(const float *, gu), PTR(const float *, dout), PTR(float *, dgu), (long)N,
                (long)F, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rope_qkv_fwd(PyObject *self, PyObject *args) {
    unsigned long long qkv, cos, sin, q, k, v;
    long long B, S, H, K, D;
    int cos_batch, threads;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLpi", &qkv, &cos, &sin, &q, &k, &v, &B, &S, &H, &K, &D,
                          &cos_batch, &threads))
        return NULL;
    if (!qkv || !cos || !sin || !q || !k || !v || B < 1 || S < 1 || H < 1 || K < 1 || D < 2 ||
        D % 2 || threads < 1)
        return bad("rope_qkv_fwd (or an odd head dim)"), NULL;
    Py_BEGIN_ALLOW_THREADS
    rope_qkv_fwd_(PTR(const float *, qkv), PTR(const float *, cos), PTR(const float *, sin),
                  PTR(float *, q), PTR(float *, k), PTR(float *, v), (long)B, (long)S, (long)H,
                  (long)K, (long)D, cos_batch, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_rope_qkv_bwd(PyObject *self, PyObject *args) {
    unsigned long long dq, dk, dv, cos, sin, dqkv;
    long long B, S, H, K, D;
    int cos_batch, threads;
    if (!PyArg_ParseTuple(args, "KKKKKKLLLLLpi", &dq, &dk, &dv, &cos, &sin, &dqkv, &B, &S, &H, &K,
                          &D, &cos_batch, &threads))
        return NULL;
    /* dq, dk or dv may be 0: that part of the output had no gradient */
    if (!cos || !sin || !dqkv || B < 1 || S < 1 || H < 1 || K < 1 || D < 2 || D % 2 || threads < 1)
        return bad("rope_qkv_bwd (or an odd head dim)"), NULL;
    Py_BEGIN_ALLOW_THREADS
    rope_qkv_bwd_(PTR(const float *, dq), PTR(const float *, dk), PTR(const float *, dv),
                  PTR(const float *, cos), PTR(const float *, sin), PTR(float *, dqkv), (long)B,
                  (long)S, (long)H, (long)K, (long)D, cos_batch, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int labels_ok(const long long *labels, long long N, long long V) {
    for (long long n = 0; n < N; n++) {
        if (labels[n] >= V) {
            PyErr_Format(PyExc_ValueError, "cross entropy: label %lld at row %lld is outside the "
                         "vocabulary [0, %lld)", labels[n], n, V);
            return 0;
        }
    }
    return 1;
}

static PyObject *py_ce_fwd(PyObject *self, PyObject *args) {
    unsigned long long logits, labels, valid, loss, lse;
    long long N, V;
    float z;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKLLfi", &logits, &labels, &valid, &loss, &lse, &N, &V, &z,
                          &threads))
        return NULL;
    if (!logits || !labels || !valid || !loss || !lse || N < 1 || V < 1 || threads < 1)
        return bad("ce_fwd"), NULL;
    if (!labels_ok(PTR(const long long *, labels), N, V)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ce_fwd_(PTR(const float *, logits), PTR(const long long *, labels),
            PTR(const unsigned char *, valid), PTR(float *, loss), PTR(float *, lse), (long)N,
            (long)V, z, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_ce_bwd(PyObject *self, PyObject *args) {
    unsigned long long logits, labels, lse, weight, grad;
    long long N, V;
    float z;
    int threads;
    if (!PyArg_ParseTuple(args, "KKKKKLLfi", &logits, &labels, &lse, &weight, &grad, &N, &V, &z,
                          &threads))
        return NULL;
    if (!logits || !labels || !lse || !weight || !grad || N < 1 || V < 1 || threads < 1)
        return bad("ce_bwd"), NULL;
    if (!labels_ok(PTR(const long long *, labels), N, V)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ce_bwd_(PTR(const float *, logits), PTR(const long long *, labels), PTR(const float *, lse),
            PTR(const float *, weight), PTR(float *, grad), (long)N, (long)V, z, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static int attn_dims_ok(const char *call, long long B, long long S, long long H, long long K,
                        long long D, float scale, int threads) {
    if (B < 1 || S < 1 || H < 1 || K < 1 || H % K || D < 16 || D % 16 || !(scale > 0) ||
        threads < 1) {
        PyErr_Format(PyExc_ValueError, "%s: bad sizes (B %lld, S %lld, H %lld, K %lld, D %lld: "
                     "H a multiple of K, D of 16) or scale", call, B, S, H, K, D);
        return 0;
    }
    return 1;
}

static PyObject *py_attn_fwd(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, out, lse;
    long long B, S, H, K, D;
    float scale;
    int threads, rc;
    if (!PyArg_ParseTuple(args, "KKKKKLLLLLfi", &q, &k, &v, &out, &lse, &B, &S, &H, &K, &D, &scale,
                          &threads))
        return NULL;
    if (!q || !k || !v || !out || !lse) return bad("attn_fwd"), NULL;
    if (!attn_dims_ok("attn_fwd", B, S, H, K, D, scale, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = attn_fwd_(PTR(const float *, q), PTR(const float *, k), PTR(const float *, v),
                   PTR(float *, out), PTR(float *, lse), (long)B, (long)S, (long)H, (long)K,
                   (long)D, scale, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_attn_bwd(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, out, dout, lse, dq, dk, dv;
    long long B, S, H, K, D;
    float scale;
    int threads, rc;
    if (!PyArg_ParseTuple(args, "KKKKKKKKKLLLLLfi", &q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv,
                          &B, &S, &H, &K, &D, &scale, &threads))
        return NULL;
    if (!q || !k || !v || !out || !dout || !lse || !dq || !dk || !dv) return bad("attn_bwd"), NULL;
    if (!attn_dims_ok("attn_bwd", B, S, H, K, D, scale, threads)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = attn_bwd_(PTR(const float *, q), PTR(const float *, k), PTR(const float *, v),
                   PTR(const float *, out), PTR(const float *, dout), PTR(const float *, lse),
                   PTR(float *, dq), PTR(float *, dk), PTR(float *, dv), (long)B, (long)S, (long)H,
                   (long)K, (long)D, scale, threads);
    Py_END_ALLOW_THREADS
    if (rc) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

static PyMethodDef methods[] = {
    {"rms_norm_fwd", py_rms_norm_fwd, METH_VARARGS, "RMSNorm's w * (x * rstd) over N rows."},
    {"rms_norm_bwd", py_rms_norm_bwd, METH_VARARGS, "RMSNorm backward (dx and dw)."},
    {"swiglu_fwd", py_swiglu_fwd, METH_VARARGS, "silu(gate) * up over [N, 2F] gate | up."},
    {"swiglu_bwd", py_swiglu_bwd, METH_VARARGS, "SwiGLU backward into one [N, 2F] gradient."},
    {"rope_qkv_fwd", py_rope_qkv_fwd, METH_VARARGS, "RoPE on q and k of a fused projection."},
    {"rope_qkv_bwd", py_rope_qkv_bwd, METH_VARARGS, "RoPE backward into one q|k|v gradient."},
    {"ce_fwd", py_ce_fwd, METH_VARARGS, "Per-token cross entropy and log-sum-exp."},
    {"ce_bwd", py_ce_bwd, METH_VARARGS, "Cross-entropy gradient of the logits."},
    {"attn_fwd", py_attn_fwd, METH_VARARGS, "Causal attention forward and its log-sum-exp."},
    {"attn_bwd", py_attn_bwd, METH_VARARGS, "Causal attention backward (dq, dk, dv)."},
    {"simd", simd, METH_NOARGS, "Whether this CPU has the AVX2 and FMA units the build uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "train_ops", "Fused fp32 CPU training kernels.", -1, methods,
};

PyMODINIT_FUNC PyInit_train_ops(void) { return PyModule_Create(&module); }
