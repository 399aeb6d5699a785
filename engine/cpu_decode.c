/* One decode step of a Llama-family decoder on the CPU, for up to MAX_ROWS rows, in one call
 * (engine/native_step.py builds the tables and keeps the lean step for anything else). The
 * model is stored in fp32, bf16 or fp16 (weights, norms, embedding and KV cache alike); the
 * arithmetic is fp32 in every case: 16-bit values are widened as they are read, and the new keys
 * and values are rounded to the cache's type as they are written. The typed code is in
 * cpu_decode_typed.h, compiled once per storage type.
 *
 * Why: a decode step streams every weight once, and the lean step runs ~30 small torch ops a
 * layer between the matrix products. Each runs after a product has flushed the core's caches,
 * so each costs 5-40 us instead of 1-3 (measured: torch.empty(1) takes 10 us right after a
 * 22 MB product, 1 us otherwise). Here the whole step is one C loop under one OpenMP team: the
 * products are split by output rows over the threads, the small work is split by rows and
 * heads, and nothing goes back to Python until the logits are written.
 *
 *   step(model, rows, tokens, positions, mask, mask_stride, logits, scratch, threads
 *        [, cache_rows, block_tables, max_blocks, block_size])
 *       -- addresses as ints: tokens and positions int64 [rows], mask uint8 (cache row c's slot
 *          s at mask[c * mask_stride + s], 0 = hidden) or 0, logits fp32 [rows, V]; cache_rows
 *          int64 [rows], the cache row each row reads and writes (default: its own index).
 *          Rows sharing a cache row at consecutive positions are a prompt's tokens: every row
 *          writes its key and value before any attends, so one call prefills a short prompt
 *          (engine/native_step.py, NativeStep.prefill).
 *          Paged cache (engine/paged_pool.py): block_tables int64 [cache rows, max_blocks], the
 *          blocks of each cache row in order (-1 past its last); a layer's k and v then point at
 *          block 0 with rs the block stride, and slot s of cache row c is slot s % block_size of
 *          block block_tables[c][s / block_size].
 *   simd() -> bool   -- this CPU runs the build
 *   block_tables() -> True -- step() reads block tables (builds before the paged cache lack it)
 *
 * `model` points to a `Model` (below; engine/native_step.py mirrors it with ctypes). For each
 * row the step computes what DecodeStep does: embedding, per layer RMSNorm, fused q|k|v
 * (+bias), RoPE (rotate-half) at the row's position, the new key/value written at that slot of
 * the row's cache, attention of the query heads over slots 0..position (grouped kv heads,
 * masked slots hidden), o, residual, RMSNorm, fused gate|up, SwiGLU, down, residual; final
 * RMSNorm and the head. The sums run in another order than torch's, so logits agree to fp32
 * rounding, not bit for bit (tested against the lean step and HF's greedy tokens).
 *
 * Built by setuptools as an optional extension with AVX2/FMA/F16C code generation and OpenMP; the
 * OpenMP runtime it links is the libgomp.so.1 torch has already loaded, so both share one pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* Every weight, norm, bias, embedding and cache pointer below is of the model's storage type
 * (Model.dtype: fp32, or bf16 / fp16 as uint16_t); inv_freq is always fp32. */
typedef struct {
    const void *w, *b; /* W [out, in] at w[o * rs + i * cs] (row-major: cs = 1, column-major:
                          rs = 1); bias or NULL */
    long out, in, rs, cs;
    /* Weight-only quantized (cpu_decode_quant.h): qbits 8 or 4, else 0 (w is of the model's
     * type). Then w holds row-major codes, rs bytes a row, with `scale` fp32 [out, in / group]
     * and, affine, `zero` int8 [out, in / group]; the bias stays of the model's type. */
    long qbits, group;
    const float *scale;
    const int8_t *zero;
} Lin;

typedef struct {
    const void *norm1, *norm2;
    float eps1, eps2;
    Lin qkv, o, gate_up, down;
    void *k, *v; /* cache row r, slot s, kv head j, dim d at r * rs + s * ss + j * ks + d
                    (paged: block r instead of row r, see step's block_tables) */
    long rs, ss, ks;
} Layer;

typedef struct {
    long E, H, K, D, F, V, L; /* hidden, heads, kv heads, head dim, ffn, vocab, layers */
    const void *embed;        /* [V, E] row-major */
    const void *final_norm;
    float final_eps;
    Lin head;
    const float *inv_freq; /* [D / 2] */
    float rope_scale, scale;
    Layer *layers;
    long dtype; /* DTYPE_F32, DTYPE_BF16 or DTYPE_F16 */
    /* A quantized token embedding (qembed.qbits 8 or 4; embed is then NULL): row t of the
     * table is qembed's weight row t, dequantized as it is read (cpu_decode_quant.h). */
    Lin qembed;
} Model;

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2

#define MAX_ROWS 64

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* bf16 <-> fp32: a bf16 value is the top half of an fp32's bits; rounding to bf16 is to
 * nearest, ties to even, as torch's conversion (NaN stays NaN). */
static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline __m256 bf16_load8(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#include "cpu_decode_quant.h"

#define CACHE_ROW(b) (crows ? crows[b] : (b))
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)
#define NAME(f) CAT(f, SFX)

#define WT float
#define SFX _f32
#define LD1(v) (v)
#define LD8(p) _mm256_loadu_ps(p)
#define ST1(v) (v)
#define PREFETCH_NEXT(a, b) ((void)0)
#include "cpu_decode_typed.h"

#define WT uint16_t
#define SFX _bf16
#define LD1(v) bf16_to_f32(v)
#define LD8(p) bf16_load8(p)
#define ST1(v) f32_to_bf16(v)
/* One-row products over bf16 weights reached ~22 GB/s on the AMD EPYC test machine, against
 * 33-35 for fp32, until the next four rows' lines were asked for ahead (28-37 GB/s, scratch
 * loop; the first and third row's lines sufficed, all four was slower). */
#define PREFETCH_NEXT(a, b) (_mm_prefetch((const char *)(a), _MM_HINT_T0), \
                             _mm_prefetch((const char *)(b), _MM_HINT_T0))
#include "cpu_decode_typed.h"

/* fp16 (F16C: every AVX2 CPU has it) converts in hardware, rounding to nearest-even as torch's
 * conversion; values beyond fp16's range become Inf, as they do in torch. */
#define WT uint16_t
#define SFX _f16
#define LD1(v) _cvtsh_ss(v)
#define LD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#define ST1(v) _cvtss_sh((v), _MM_FROUND_TO_NEAREST_INT)
#define PREFETCH_NEXT(a, b) (_mm_prefetch((const char *)(a), _MM_HINT_T0), \
                             _mm_prefetch((const char *)(b), _MM_HINT_T0))
#include "cpu_decode_typed.h"

static PyObject *step(PyObject *self, PyObject *args) {
    unsigned long long model, tokens, positions, mask, logits, scratch, cache_rows = 0;
    unsigned long long block_tables = 0;
    long long rows, mask_stride, max_blocks = 0, block_size = 0;
    int threads;
    if (!PyArg_ParseTuple(args, "KLKKKLKKi|KKLL", &model, &rows, &tokens, &positions, &mask,
                          &mask_stride, &logits, &scratch, &threads, &cache_rows, &block_tables,
                          &max_blocks, &block_size)) {
        return NULL;
    }
    const long long *bt = (const long long *)(uintptr_t)block_tables;
    const Model *m = (const Model *)(uintptr_t)model;
    const long long *tok = (const long long *)(uintptr_t)tokens;
    const long long *pos = (const long long *)(uintptr_t)positions;
    const long long *crows = (const long long *)(uintptr_t)cache_rows;
    if (!m || !tok || !pos || !logits || !scratch || rows < 1 || rows > MAX_ROWS ||
        threads < 1 || mask_stride < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "step(model, rows, tokens, positions, mask, mask_stride, logits, scratch, "
                        "threads): a null table or buffer, rows outside 1..64, no threads or a "
                        "negative mask stride");
        return NULL;
    }
    if (bt && (max_blocks < 1 || block_size < 1)) {
        PyErr_SetString(PyExc_ValueError, "step: block tables need max_blocks and block_size >= 1");
        return NULL;
    }
    for (long long b = 0; b < rows; b++) {
        if (bt && pos[b] >= max_blocks * block_size) {
            PyErr_Format(PyExc_ValueError, "step: row %lld's position %lld is past its %lld blocks",
                         b, pos[b], max_blocks);
            return NULL;
        }
        if (bt) {
            const long long c = crows ? crows[b] : b;
            for (long long i = 0; i <= pos[b] / block_size; i++)
                if (bt[c * max_blocks + i] < 0) {
                    PyErr_Format(PyExc_ValueError, "step: row %lld has no block %lld", b, i);
                    return NULL;
                }
        }
        if (tok[b] < 0 || tok[b] >= m->V || pos[b] < 0) {
            PyErr_Format(PyExc_ValueError,
                         "step: row %lld has token %lld (the vocabulary has %ld) at position %lld",
                         b, tok[b], m->V, pos[b]);
            return NULL;
        }
        if (crows && (crows[b] < 0 || crows[b] >= MAX_ROWS)) {
            PyErr_Format(PyExc_ValueError, "step: row %lld names cache row %lld", b, crows[b]);
            return NULL;
        }
    }
    if (m->dtype != DTYPE_F32 && m->dtype != DTYPE_BF16 && m->dtype != DTYPE_F16) {
        PyErr_Format(PyExc_ValueError,
                     "step: model dtype %ld is none of fp32 (0), bf16 (1) and fp16 (2)", m->dtype);
        return NULL;
    }
    const unsigned char *row_mask = (const unsigned char *)(uintptr_t)mask;
    Py_BEGIN_ALLOW_THREADS
    if (m->dtype == DTYPE_BF16)
        decode_bf16(m, (long)rows, tok, pos, crows, row_mask, (long)mask_stride, bt,
                   (long)max_blocks, (long)block_size,
                    (float *)(uintptr_t)logits, (float *)(uintptr_t)scratch, threads);
    else if (m->dtype == DTYPE_F16)
        decode_f16(m, (long)rows, tok, pos, crows, row_mask, (long)mask_stride, bt,
                   (long)max_blocks, (long)block_size,
                   (float *)(uintptr_t)logits, (float *)(uintptr_t)scratch, threads);
    else
        decode_f32(m, (long)rows, tok, pos, crows, row_mask, (long)mask_stride, bt,
                   (long)max_blocks, (long)block_size,
                   (float *)(uintptr_t)logits, (float *)(uintptr_t)scratch, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *args) {
    __builtin_cpu_init();
    return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                           __builtin_cpu_supports("f16c"));
}

/* sizeof(Lin): engine/native_step.py checks it against its ctypes mirror, so a build older
 * than the Python tables (another Lin layout) is never called. */
static PyObject *lin_bytes(PyObject *self, PyObject *args) { return PyLong_FromSize_t(sizeof(Lin)); }
/* sizeof(Model): checked as lin_bytes is (a build without the quantized embedding differs). */
static PyObject *model_bytes(PyObject *self, PyObject *args) { return PyLong_FromSize_t(sizeof(Model)); }
static PyObject *block_tables(PyObject *self, PyObject *args) { Py_RETURN_TRUE; }

static PyMethodDef methods[] = {
    {"lin_bytes", lin_bytes, METH_NOARGS, "sizeof(Lin), the layout this build reads."},
    {"model_bytes", model_bytes, METH_NOARGS, "sizeof(Model), the layout this build reads."},
    {"step", step, METH_VARARGS, "One decode step of up to 64 rows (addresses as ints)."},
    {"block_tables", block_tables, METH_NOARGS,
     "Whether step() takes block tables (a build older than the paged KV cache does not)."},
    {"simd", simd, METH_NOARGS, "Whether this CPU has the AVX2, FMA and F16C units the build uses."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cpu_decode", "One CPU decode step in C.", -1, methods,
};

PyMODINIT_FUNC PyInit_cpu_decode(void) { return PyModule_Create(&module); }
