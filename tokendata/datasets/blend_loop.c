/* The blend order's greedy loop, compiled (tokendata.datasets.blended.build_blending_indices).
 *
 * Each step serves the dataset furthest behind `weight * max(step, 1) - served`, the first one
 * on ties, in IEEE doubles: the arithmetic of the Python loop `_blend_loop` and of megatron-core's
 * C++ helper, so the order is identical. Built by setuptools as an optional extension; where no
 * C compiler is present the package falls back to the numpy paths.
 *
 *   order(weights: float64 buffer, size: int, picks: int16 buffer, sample_ids: int64 buffer)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

static PyObject *order(PyObject *self, PyObject *args) {
    Py_buffer weights, picks, sample_ids;
    Py_ssize_t size;
    if (!PyArg_ParseTuple(args, "y*nw*w*", &weights, &size, &picks, &sample_ids)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = weights.len / (Py_ssize_t)sizeof(double);
    if (n < 1 || n > INT16_MAX || weights.len != n * (Py_ssize_t)sizeof(double) || size < 0 ||
        picks.len != size * (Py_ssize_t)sizeof(int16_t) ||
        sample_ids.len != size * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError,
                        "order(weights, size, picks, sample_ids): need 1..32767 float64 weights, "
                        "size >= 0, an int16 buffer and an int64 buffer of `size` items each");
        goto done;
    }
    int64_t *served = calloc((size_t)n, sizeof(int64_t));
    if (served == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const double *w = (const double *)weights.buf;
    int16_t *out_picks = (int16_t *)picks.buf;
    int64_t *out_ids = (int64_t *)sample_ids.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t step = 0; step < size; step++) {
        double scale = step > 1 ? (double)step : 1.0;
        Py_ssize_t best = 0;
        double best_error = w[0] * scale - (double)served[0];
        for (Py_ssize_t i = 1; i < n; i++) {
            double error = w[i] * scale - (double)served[i];
            if (error > best_error) {
                best = i;
                best_error = error;
            }
        }
        out_picks[step] = (int16_t)best;
        out_ids[step] = served[best];
        served[best] += 1;
    }
    Py_END_ALLOW_THREADS
    free(served);
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&weights);
    PyBuffer_Release(&picks);
    PyBuffer_Release(&sample_ids);
    return result;
}

static PyMethodDef methods[] = {
    {"order", order, METH_VARARGS,
     "order(weights, size, picks, sample_ids): fill the blend order (dataset id per step, "
     "int16) and each step's sample id within its dataset (int64) in place."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "blend_loop", "The blend order's greedy loop, compiled.", -1, methods,
};

PyMODINIT_FUNC PyInit_blend_loop(void) { return PyModule_Create(&module); }
