/* Batch recompression (-x zlib|lz4) with the GIL released for the whole batch.
 *
 * Compressing message by message from Python in worker threads halves the relay's
 * throughput: every message takes the GIL twice and the event loop waits for it.  Here
 * the output buffers are allocated with the GIL, then every body of the batch is
 * compressed without it, so the worker threads really run beside the event loop.
 *
 * The output is byte-identical to protocols.logjam.compress(): zlib.compress(body)
 * (level -1) and, for lz4, a 4-byte big-endian length + lz4.block.compress(body,
 * store_size=False).  LZ4 is not linked: init() is given the path of the python-lz4
 * extension already loaded in this process and looks up LZ4_compress_default there
 * (dlopen RTLD_NOLOAD), so both use the very same liblz4.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <zlib.h>

static int (*p_lz4_compress)(const char *, char *, int, int);
static int (*p_lz4_bound)(int);

enum { M_ZLIB = 1, M_LZ4 = 3 };

static PyObject *init(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) return PyErr_Format(PyExc_OSError, "%s is not loaded: %s", path, dlerror());
    *(void **)(&p_lz4_compress) = dlsym(lib, "LZ4_compress_default");
    *(void **)(&p_lz4_bound) = dlsym(lib, "LZ4_compressBound");
    if (!p_lz4_compress || !p_lz4_bound)
        return PyErr_Format(PyExc_OSError, "%s: no LZ4_compress_default", path);
    Py_RETURN_NONE;
}

/* compress_batch(bodies, method) -> list of compressed bodies (same order) */
static PyObject *compress_batch(PyObject *self, PyObject *args) {
    PyObject *bodies;
    int method;
    if (!PyArg_ParseTuple(args, "Oi", &bodies, &method)) return NULL;
    if (method != M_ZLIB && method != M_LZ4) return PyErr_Format(PyExc_ValueError, "method %d", method);
    if (method == M_LZ4 && !p_lz4_compress) {
        PyErr_SetString(PyExc_RuntimeError, "_recompress.init() was not called");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(bodies, "bodies must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    long *sizes = PyMem_Calloc((size_t)n + 1, sizeof(long));
    PyObject *out = PyList_New(n);
    Py_ssize_t got = 0;
    int failed = 0;
    if (!views || !sizes || !out) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &views[i], PyBUF_SIMPLE) < 0)
            goto done;
        got = i + 1;
        if (views[i].len > 0x7E000000) {
            PyErr_SetString(PyExc_ValueError, "body too large to compress");
            goto done;
        }
        size_t cap = method == M_LZ4 ? 4 + (size_t)p_lz4_bound((int)views[i].len)
                                     : (size_t)compressBound((uLong)views[i].len);
        PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)cap);
        if (!b) goto done;
        PyList_SET_ITEM(out, i, b);
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        char *dst = PyBytes_AS_STRING(PyList_GET_ITEM(out, i));
        Py_ssize_t cap = PyBytes_GET_SIZE(PyList_GET_ITEM(out, i));
        const char *src = views[i].buf;
        Py_ssize_t len = views[i].len;
        if (method == M_LZ4) {
            dst[0] = (char)(len >> 24); dst[1] = (char)(len >> 16);
            dst[2] = (char)(len >> 8); dst[3] = (char)len;
            int r = p_lz4_compress(src, dst + 4, (int)len, (int)(cap - 4));
            if (r <= 0) { failed = 1; break; }
            sizes[i] = 4 + r;
        } else {
            uLongf dlen = (uLongf)cap;
            if (compress2((Bytef *)dst, &dlen, (const Bytef *)src, (uLong)len,
                          Z_DEFAULT_COMPRESSION) != Z_OK) { failed = 1; break; }
            sizes[i] = (long)dlen;
        }
    }
    Py_END_ALLOW_THREADS
    if (failed) {
        PyErr_SetString(PyExc_RuntimeError, "compression failed");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *b = PyList_GET_ITEM(out, i);
        PyList_SET_ITEM(out, i, NULL);
        if (_PyBytes_Resize(&b, sizes[i]) < 0) goto done;
        PyList_SET_ITEM(out, i, b);
    }
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sizes);
    Py_DECREF(seq);
    return out;
done:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sizes);
    Py_XDECREF(out);
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"init", init, METH_VARARGS, "init(path of the loaded python-lz4 block extension)"},
    {"compress_batch", compress_batch, METH_VARARGS,
     "compress_batch(bodies, method) -> compressed bodies in the logjam format (1 zlib, 3 lz4)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_recompress", "Batch recompression without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__recompress(void) { return PyModule_Create(&module); }
