/* One decode step of a Llama-family decoder on the CPU, in fp32, for up to MAX_ROWS rows, in one
 * call (engine/native_step.py builds the tables and keeps the lean step for anything else).
 *
 * Why: a decode step streams every weight once, and the lean step runs ~30 small torch ops a
 * layer between the matrix products. Each runs after a product has flushed the core's caches,
 * so each costs 5-40 us instead of 1-3 (measured: torch.empty(1) takes 10 us right after a
 * 22 MB product, 1 us otherwise). Here the whole step is one C loop under one OpenMP team: the
 * products are split by output rows over the threads, the small work is split by rows and
 * heads, and nothing goes back to Python until the logits are written.
 *
 *   step(model, rows, tokens, positions, mask, mask_stride, logits, scratch, threads)
 *       -- addresses as ints: tokens and positions int64 [rows], mask uint8 (row r's slot s at
 *          mask[r * mask_stride + s], 0 = hidden) or 0, logits fp32 [rows, V]
 *   simd() -> bool   -- this CPU runs the build
 *
 * `model` points to a `Model` (below; engine/native_step.py mirrors it with ctypes). For each
 * row the step computes what DecodeStep does: embedding, per layer RMSNorm, fused q|k|v
 * (+bias), RoPE (rotate-half) at the row's position, the new key/value written at that slot of
 * the row's cache, attention of the query heads over slots 0..position (grouped kv heads,
 * masked slots hidden), o, residual, RMSNorm, fused gate|up, SwiGLU, down, residual; final
 * RMSNorm and the head. The sums run in another order than torch's, so logits agree to fp32
 * rounding, not bit for bit (tested against the lean step and HF's greedy tokens).
 *
 * Built by setuptools as an optional extension with AVX2/FMA code generation and OpenMP; the
 * OpenMP runtime it links is the libgomp.so.1 torch has already loaded, so both share one pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>

typedef struct {
    const float *w, *b; /* W [out, in] at w[o * rs + i * cs] (row-major: cs = 1, column-major:
                           rs = 1); bias or NULL */
    long out, in, rs, cs;
} Lin;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    Lin qkv, o, gate_up, down;
    float *k, *v; /* cache row r, slot s, kv head j, dim d at r * rs + s * ss + j * ks + d */
    long rs, ss, ks;
} Layer;

typedef struct {
    long E, H, K, D, F, V, L; /* hidden, heads, kv heads, head dim, ffn, vocab, layers */
    const float *embed;       /* [V, E] row-major */
    const float *final_norm;
    float final_eps;
    Lin head;
    const float *inv_freq; /* [D / 2] */
    float rope_scale, scale;
    Layer *layers;
} Model;

#define MAX_ROWS 64

/* Y[b, o0:o1] = W[o0:o1] X[b] for a column-major W: each row's y accumulates x[i] times the
 * contiguous run W[o0:o1, i], four columns at a time; the four runs are reused for every row
 * while they are in the core's cache. */
static void lin_columns(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                        long o1) {
    const long n = l->in, cs = l->cs;
    for (long b = 0; b < B; b++)
        for (long o = o0; o < o1; o++) Y[b * ys + o] = 0.f;
    long i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *w0 = l->w + i * cs, *w1 = w0 + cs, *w2 = w1 + cs, *w3 = w2 + cs;
        for (long b = 0; b < B; b++) {
            const float *x = X + b * xs;
            const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
            float *y = Y + b * ys;
#pragma omp simd
            for (long o = o0; o < o1; o++)
                y[o] += x0 * w0[o] + x1 * w1[o] + x2 * w2[o] + x3 * w3[o];
        }
    }
    for (; i < n; i++) {
        const float *w = l->w + i * cs;
        for (long b = 0; b < B; b++) {
            const float xi = X[b * xs + i];
            float *y = Y + b * ys;
#pragma omp simd
            for (long o = o0; o < o1; o++) y[o] += xi * w[o];
        }
    }
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[3 r + q] = w_q . x_r for three weight rows w0..w2 and four inputs x0..x3 of n features:
 * twelve sums in twelve registers, each weight and input vector loaded once per 8 features
 * (7 loads for 12 multiply-adds). */
static void dot3x4(const float *const w[3], const float *const x[4], long n, float *out) {
    __m256 acc[12];
    for (int k = 0; k < 12; k++) acc[k] = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 u = _mm256_loadu_ps(w[0] + i), v = _mm256_loadu_ps(w[1] + i);
        const __m256 t = _mm256_loadu_ps(w[2] + i);
        for (int r = 0; r < 4; r++) {
            const __m256 xv = _mm256_loadu_ps(x[r] + i);
            acc[3 * r] = _mm256_fmadd_ps(u, xv, acc[3 * r]);
            acc[3 * r + 1] = _mm256_fmadd_ps(v, xv, acc[3 * r + 1]);
            acc[3 * r + 2] = _mm256_fmadd_ps(t, xv, acc[3 * r + 2]);
        }
    }
    for (int k = 0; k < 12; k++) out[k] = hsum(acc[k]);
    for (; i < n; i++)
        for (int r = 0; r < 4; r++)
            for (int q = 0; q < 3; q++) out[3 * r + q] += w[q][i] * x[r][i];
}

/* Y[b, o0:o1] = W[o0:o1] X[b] for a row-major W. One row: four weight rows at a time, so four
 * independent sums are in flight. Several: three weight rows against four inputs at a time
 * (twelve sums); the three weight rows are read from memory once and from the cache for the
 * next inputs. */
static void lin_rows(const Lin *l, long B, const float *X, long xs, float *Y, long ys, long o0,
                     long o1) {
    const long n = l->in, rs = l->rs;
    long o = o0;
    if (B == 1) {
        const float *x = X;
        for (; o + 4 <= o1; o += 4) {
            const float *w0 = l->w + o * rs, *w1 = w0 + rs, *w2 = w1 + rs, *w3 = w2 + rs;
            float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
            for (long i = 0; i < n; i++) {
                a0 += w0[i] * x[i];
                a1 += w1[i] * x[i];
                a2 += w2[i] * x[i];
                a3 += w3[i] * x[i];
            }
            Y[o] = a0;
            Y[o + 1] = a1;
            Y[o + 2] = a2;
            Y[o + 3] = a3;
        }
    }
    for (; o < o1; o += 3) {
        const long nw = o1 - o < 3 ? o1 - o : 3;
        /* weight rows past o1 and inputs past the last row repeat the first; their sums are not
         * stored */
        const float *w[3] = {l->w + o * rs, l->w + (o + (nw > 1)) * rs, l->w + (o + 2 * (nw > 2)) * rs};
        for (long b = 0; b < B; b += 4) {
            const long nb = B - b < 4 ? B - b : 4;
            const float *x[4];
            for (long r = 0; r < 4; r++) x[r] = X + (b + (r < nb ? r : 0)) * xs;
            float sums[12];
            dot3x4(w, x, n, sums);
            for (long r = 0; r < nb; r++)
                for (long q = 0; q < nw; q++) Y[(b + r) * ys + o + q] = sums[3 * r + q];
        }
    }
}

/* Inside the team: each thread takes a contiguous block of output rows (a multiple of 16), then
 * all wait, so that Y is complete for whatever runs next. */
static void lin(const Lin *l, long B, const float *X, long xs, float *Y, long ys) {
    const long t = omp_get_thread_num(), n = omp_get_num_threads();
    long per = (l->out + n - 1) / n;
    per = (per + 15) & ~15L;
    const long o0 = t * per, o1 = o0 + per < l->out ? o0 + per : l->out;
    if (o0 < o1) {
        if (l->cs == 1)
            lin_rows(l, B, X, xs, Y, ys, o0, o1);
        else
            lin_columns(l, B, X, xs, Y, ys, o0, o1);
        if (l->b)
            for (long b = 0; b < B; b++)
                for (long o = o0; o < o1; o++) Y[b * ys + o] += l->b[o];
    }
#pragma omp barrier
}

static void rms_norm(const float *x, const float *w, float eps, float *y, long n) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* One query head of one row over that row's slots 0..S-1 of kv head j: out [D]; `sc` holds S
 * scores; `k` and `v` point at the row's slot 0, kv head j. */
static void attend(const Model *m, const float *k, const float *v, long ss, const float *q, long S,
                   const unsigned char *mask, float *sc, float *out) {
    const long D = m->D;
    float mx = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (mask && !mask[s]) {
            sc[s] = -INFINITY;
            continue;
        }
        const float *ks = k + s * ss;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (long d = 0; d < D; d++) acc += q[d] * ks[d];
        sc[s] = acc * m->scale;
        if (sc[s] > mx) mx = sc[s];
    }
    float sum = 0.f;
    for (long s = 0; s < S; s++) {
        sc[s] = sc[s] == -INFINITY ? 0.f : expf(sc[s] - mx);
        sum += sc[s];
    }
    for (long d = 0; d < D; d++) out[d] = 0.f;
    for (long s = 0; s < S; s++) {
        if (sc[s] == 0.f) continue;
        const float p = sc[s] / sum;
        const float *vs = v + s * ss;
#pragma omp simd
        for (long d = 0; d < D; d++) out[d] += p * vs[d];
    }
}

/* Scratch floats, for B rows and T = 1 + the largest position: h, x [B E]; qkv [B (H + 2K) D];
 * att [B H D]; gate_up [B 2F]; act [B F]; cos, sin [B D/2]; scores [B H T] -- engine/
 * native_step.py sizes it with the same formula. */
static void decode(const Model *m, long B, const long long *tokens, const long long *positions,
                   const unsigned char *mask, long mask_stride, float *logits, float *scratch,
                   int threads) {
    const long E = m->E, H = m->H, K = m->K, D = m->D, F = m->F, half = D / 2, G = H / K;
    const long Q = (H + 2 * K) * D;
    long T = 0;
    for (long b = 0; b < B; b++)
        if (positions[b] + 1 > T) T = positions[b] + 1;
    float *h = scratch, *x = h + B * E, *qkv = x + B * E, *att = qkv + B * Q;
    float *gu = att + B * H * D, *act = gu + B * 2 * F, *cs = act + B * F, *sn = cs + B * half;
    float *scores = sn + B * half;
    for (long b = 0; b < B; b++) {
        for (long i = 0; i < E; i++) h[b * E + i] = m->embed[tokens[b] * E + i];
        for (long j = 0; j < half; j++) {
            const float f = (float)positions[b] * m->inv_freq[j];
            cs[b * half + j] = cosf(f) * m->rope_scale;
            sn[b * half + j] = sinf(f) * m->rope_scale;
        }
    }
#pragma omp parallel num_threads(threads)
    {
        for (long l = 0; l < m->L; l++) {
            const Layer *ly = &m->layers[l];
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) rms_norm(h + b * E, ly->norm1, ly->eps1, x + b * E, E);
            lin(&ly->qkv, B, x, E, qkv, Q);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) {
                const long pos = positions[b];
                const float *c = cs + b * half, *s = sn + b * half;
                for (long head = 0; head < H + K; head++) { /* rotate the q and k heads */
                    float *u = qkv + b * Q + head * D;
                    for (long j = 0; j < half; j++) {
                        const float u0 = u[j], u1 = u[j + half];
                        u[j] = u0 * c[j] - u1 * s[j];
                        u[j + half] = u1 * c[j] + u0 * s[j];
                    }
                }
                float *kr = ly->k + b * ly->rs + pos * ly->ss, *vr = ly->v + b * ly->rs + pos * ly->ss;
                for (long j = 0; j < K; j++)
                    for (long d = 0; d < D; d++) {
                        kr[j * ly->ks + d] = qkv[b * Q + (H + j) * D + d];
                        vr[j * ly->ks + d] = qkv[b * Q + (H + K + j) * D + d];
                    }
            }
#pragma omp for schedule(static) collapse(2)
            for (long b = 0; b < B; b++)
                for (long head = 0; head < H; head++) {
                    const long j = head / G;
                    attend(m, ly->k + b * ly->rs + j * ly->ks, ly->v + b * ly->rs + j * ly->ks,
                           ly->ss, qkv + b * Q + head * D, positions[b] + 1,
                           mask ? mask + b * mask_stride : NULL, scores + (b * H + head) * T,
                           att + (b * H + head) * D);
                }
            lin(&ly->o, B, att, H * D, x, E);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++) {
                for (long i = 0; i < E; i++) h[b * E + i] += x[b * E + i];
                rms_norm(h + b * E, ly->norm2, ly->eps2, x + b * E, E);
            }
            lin(&ly->gate_up, B, x, E, gu, 2 * F);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++)
                for (long i = 0; i < F; i++) {
                    const float g = gu[b * 2 * F + i];
                    act[b * F + i] = g / (1.f + expf(-g)) * gu[b * 2 * F + F + i];
                }
            lin(&ly->down, B, act, F, x, E);
#pragma omp for schedule(static)
            for (long b = 0; b < B; b++)
                for (long i = 0; i < E; i++) h[b * E + i] += x[b * E + i];
        }
#pragma omp for schedule(static)
        for (long b = 0; b < B; b++) rms_norm(h + b * E, m->final_norm, m->final_eps, x + b * E, E);
        lin(&m->head, B, x, E, logits, m->V);
    }
}

static PyObject *step(PyObject *self, PyObject *args) {
    unsigned long long model, tokens, positions, mask, logits, scratch;
    long long rows, mask_stride;
    int threads;
    if (!PyArg_ParseTuple(args, "KLKKKLKKi", &model, &rows, &tokens, &positions, &mask,
                          &mask_stride, &logits, &scratch, &threads)) {
        return NULL;
    }
    const Model *m = (const Model *)(uintptr_t)model;
    const long long *tok = (const long long *)(uintptr_t)tokens;
    const long long *pos = (const long long *)(uintptr_t)positions;
    if (!m || !tok || !pos || !logits || !scratch || rows < 1 || rows > MAX_ROWS ||
        threads < 1 || mask_stride < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "step(model, rows, tokens, positions, mask, mask_stride, logits, scratch, "
                        "threads): a null table or buffer, rows outside 1..64, no threads or a "
                        "negative mask stride");
        return NULL;
    }
    for (long long b = 0; b < rows; b++) {
        if (tok[b] < 0 || tok[b] >= m->V || pos[b] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "step: row %lld has token %lld (the vocabulary has %ld) at position %lld",
                         b, tok[b], m->V, pos[b]);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    decode(m, (long)rows, tok, pos, (const unsigned char *)(uintptr_t)mask, (long)mask_stride,
           (float *)(uintptr_t)logits, (float *)(uintptr_t)scratch, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS, "One decode step of up to 64 rows (addresses as ints)."},
    {"simd", simd, METH_NOARGS, "Whether this CPU has the AVX2 and FMA units the build uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cpu_decode", "One CPU decode step in C.", -1, methods,
};

PyMODINIT_FUNC PyInit_cpu_decode(void) { return PyModule_Create(&module); }
