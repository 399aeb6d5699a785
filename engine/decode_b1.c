/* One batch-1 decode step of a Llama-family decoder on the CPU, in fp32, in one call
 * (engine/native_step.py builds the tables and falls back to the lean step for anything else).
 *
 * Why: at batch 1 a step streams every weight once, and the time between the matrix-vector
 * products is ~30 small torch ops a layer. Each runs after a product has flushed the core's
 * caches, so each costs 5-40 us instead of 1-3 (measured: torch.empty(1) takes 10 us right after
 * a 22 MB product, 1 us otherwise). Here the whole step is one C loop under one OpenMP team:
 * the products are split by output rows over the threads, the small work runs on one thread
 * between them, and nothing goes back to Python until the logits are written.
 *
 *   step(model, token, pos, mask, logits, scratch, threads)   -- addresses as ints
 *   simd() -> bool                                            -- this CPU runs the build
 *
 * `model` points to a `Model` (below; engine/native_step.py mirrors it with ctypes). The step
 * computes what DecodeStep does for one row: embedding, per layer RMSNorm, fused q|k|v (+bias),
 * RoPE (rotate-half), the new key/value written at slot `pos` of the row's cache, attention of
 * the query heads over slots 0..pos (grouped kv heads; `mask`, if given, hides slots whose byte
 * is 0), o, residual, RMSNorm, fused gate|up, SwiGLU, down, residual; final RMSNorm and the
 * head. The sums run in another order than torch's, so logits agree to fp32 rounding, not
 * bit for bit (tested against the lean step and HF's greedy tokens).
 *
 * Built by setuptools as an optional extension with AVX2/FMA code generation and OpenMP; the
 * OpenMP runtime it links is the libgomp.so.1 torch has already loaded, so both share one pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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
    float *k, *v; /* this row's cache: slot s, kv head j, dim d at s * ss + j * ks + d */
    long ss, ks;
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

/* y[o0:o1] = W[o0:o1] x for a column-major W: y accumulates x[i] times the contiguous run
 * W[o0:o1, i], four columns at a time, so y is read and written once per four runs. */
static void lin_columns(const Lin *l, const float *x, float *y, long o0, long o1) {
    const long n = l->in, cs = l->cs;
    for (long o = o0; o < o1; o++) y[o] = 0.f;
    long i = 0;
    for (; i + 4 <= n; i += 4) {
        const float *w0 = l->w + i * cs, *w1 = w0 + cs, *w2 = w1 + cs, *w3 = w2 + cs;
        const float x0 = x[i], x1 = x[i + 1], x2 = x[i + 2], x3 = x[i + 3];
#pragma omp simd
        for (long o = o0; o < o1; o++) y[o] += x0 * w0[o] + x1 * w1[o] + x2 * w2[o] + x3 * w3[o];
    }
    for (; i < n; i++) {
        const float *w = l->w + i * cs, xi = x[i];
#pragma omp simd
        for (long o = o0; o < o1; o++) y[o] += xi * w[o];
    }
}

/* y[o0:o1] = W[o0:o1] x for a row-major W: four rows at a time, so four independent sums are in
 * flight. */
static void lin_rows(const Lin *l, const float *x, float *y, long o0, long o1) {
    const long n = l->in;
    long o = o0;
    for (; o + 4 <= o1; o += 4) {
        const float *w0 = l->w + o * l->rs, *w1 = w0 + l->rs, *w2 = w1 + l->rs, *w3 = w2 + l->rs;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
        for (long i = 0; i < n; i++) {
            a0 += w0[i] * x[i];
            a1 += w1[i] * x[i];
            a2 += w2[i] * x[i];
            a3 += w3[i] * x[i];
        }
        y[o] = a0;
        y[o + 1] = a1;
        y[o + 2] = a2;
        y[o + 3] = a3;
    }
    for (; o < o1; o++) {
        const float *w = l->w + o * l->rs;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (long i = 0; i < n; i++) acc += w[i] * x[i];
        y[o] = acc;
    }
}

static void lin_part(const Lin *l, const float *x, float *y, long o0, long o1) {
    if (l->cs == 1)
        lin_rows(l, x, y, o0, o1);
    else
        lin_columns(l, x, y, o0, o1);
    if (l->b)
        for (long o = o0; o < o1; o++) y[o] += l->b[o];
}

/* Inside the team: each thread takes a contiguous block of rows (a multiple of 16), then all
 * wait, so that `y` is complete for whatever runs next. */
static void lin(const Lin *l, const float *x, float *y) {
    const long t = omp_get_thread_num(), n = omp_get_num_threads();
    long per = (l->out + n - 1) / n;
    per = (per + 15) & ~15L;
    const long o0 = t * per, o1 = o0 + per < l->out ? o0 + per : l->out;
    if (o0 < o1) lin_part(l, x, y, o0, o1);
#pragma omp barrier
}

static void rms_norm(const float *x, const float *w, float eps, float *y, long n) {
    float ss = 0.f;
#pragma omp simd reduction(+ : ss)
    for (long i = 0; i < n; i++) ss += x[i] * x[i];
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (long i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* One query head over slots 0..S-1 of kv head j: out [D]. `sc` holds S scores. */
static void attend(const Model *m, const Layer *ly, const float *q, long j, long S,
                   const unsigned char *mask, float *sc, float *out) {
    const long D = m->D;
    float mx = -INFINITY;
    for (long s = 0; s < S; s++) {
        if (mask && !mask[s]) {
            sc[s] = -INFINITY;
            continue;
        }
        const float *k = ly->k + s * ly->ss + j * ly->ks;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (long d = 0; d < D; d++) acc += q[d] * k[d];
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
        const float *v = ly->v + s * ly->ss + j * ly->ks;
#pragma omp simd
        for (long d = 0; d < D; d++) out[d] += p * v[d];
    }
}

/* Scratch floats: h, x [E]; qkv [(H + 2K) D]; att [H D]; gate_up [2F]; act [F]; cos, sin
 * [D/2]; scores [H (pos + 1)] -- engine/native_step.py sizes it with the same formula. */
static void decode(const Model *m, long token, long pos, const unsigned char *mask,
                   float *logits, float *scratch, int threads) {
    const long E = m->E, H = m->H, K = m->K, D = m->D, F = m->F, half = D / 2, G = H / K;
    const long S = pos + 1;
    float *h = scratch, *x = h + E, *qkv = x + E, *att = qkv + (H + 2 * K) * D;
    float *gu = att + H * D, *act = gu + 2 * F, *cs = act + F, *sn = cs + half;
    float *scores = sn + half;
    for (long i = 0; i < E; i++) h[i] = m->embed[token * E + i];
    for (long j = 0; j < half; j++) {
        const float f = (float)pos * m->inv_freq[j];
        cs[j] = cosf(f) * m->rope_scale;
        sn[j] = sinf(f) * m->rope_scale;
    }
#pragma omp parallel num_threads(threads)
    {
        for (long l = 0; l < m->L; l++) {
            const Layer *ly = &m->layers[l];
#pragma omp single
            rms_norm(h, ly->norm1, ly->eps1, x, E);
            lin(&ly->qkv, x, qkv);
#pragma omp single
            {
                for (long head = 0; head < H + K; head++) { /* rotate the q and k heads */
                    float *u = qkv + head * D;
                    for (long j = 0; j < half; j++) {
                        const float a = u[j], b = u[j + half];
                        u[j] = a * cs[j] - b * sn[j];
                        u[j + half] = b * cs[j] + a * sn[j];
                    }
                }
                for (long j = 0; j < K; j++)
                    for (long d = 0; d < D; d++) {
                        ly->k[pos * ly->ss + j * ly->ks + d] = qkv[(H + j) * D + d];
                        ly->v[pos * ly->ss + j * ly->ks + d] = qkv[(H + K + j) * D + d];
                    }
            }
#pragma omp for schedule(static)
            for (long head = 0; head < H; head++)
                attend(m, ly, qkv + head * D, head / G, S, mask, scores + head * S, att + head * D);
            lin(&ly->o, att, x);
#pragma omp single
            {
                for (long i = 0; i < E; i++) h[i] += x[i];
                rms_norm(h, ly->norm2, ly->eps2, x, E);
            }
            lin(&ly->gate_up, x, gu);
#pragma omp single
            for (long i = 0; i < F; i++) {
                const float g = gu[i];
                act[i] = g / (1.f + expf(-g)) * gu[F + i];
            }
            lin(&ly->down, act, x);
#pragma omp single
            for (long i = 0; i < E; i++) h[i] += x[i];
        }
#pragma omp single
        rms_norm(h, m->final_norm, m->final_eps, x, E);
        lin(&m->head, x, logits);
    }
}

static PyObject *step(PyObject *self, PyObject *args) {
    unsigned long long model, mask, logits, scratch;
    long long token, pos;
    int threads;
    if (!PyArg_ParseTuple(args, "KLLKKKi", &model, &token, &pos, &mask, &logits, &scratch,
                          &threads)) {
        return NULL;
    }
    const Model *m = (const Model *)(uintptr_t)model;
    if (!m || !logits || !scratch || token < 0 || token >= m->V || pos < 0 || threads < 1) {
        PyErr_SetString(PyExc_ValueError,
                        "step(model, token, pos, mask, logits, scratch, threads): null table or "
                        "buffer, token outside the vocabulary, negative position or no threads");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    decode(m, (long)token, (long)pos, (const unsigned char *)(uintptr_t)mask,
           (float *)(uintptr_t)logits, (float *)(uintptr_t)scratch, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"));
}

static PyMethodDef methods[] = {
    {"step", step, METH_VARARGS, "One batch-1 decode step (addresses as ints)."},
    {"simd", simd, METH_NOARGS, "Whether this CPU has the AVX2 and FMA units the build uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "decode_b1", "One batch-1 CPU decode step in C.", -1, methods,
};

PyMODINIT_FUNC PyInit_decode_b1(void) { return PyModule_Create(&module); }
