/* Batch receive and publish on pyzmq sockets, in C: the relay's per-frame cost.
 *
 * pyzmq costs ~1 us per frame on the hot path (recv + getsockopt(RCVMORE) per frame,
 * send per frame), which was most of the relay's CPU.  This module does the same calls
 * to libzmq in a C loop.  It does not link against libzmq: init() is given the path of
 * the libzmq that pyzmq has already loaded (found in /proc/self/maps by zmq_fast.py),
 * and looks the few functions up with dlopen(RTLD_NOLOAD) + dlsym, so it always talks
 * to the very library instance that owns the socket (pyzmq's ``Socket.underlying``).
 *
 * Optional: when it cannot be built or initialised, zmq_trio uses pyzmq alone.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>

typedef struct { _Alignas(8) unsigned char _[64]; } zmq_msg_t;

static int (*p_msg_init)(zmq_msg_t *);
static int (*p_msg_recv)(zmq_msg_t *, void *, int);
static int (*p_msg_close)(zmq_msg_t *);
static void *(*p_msg_data)(zmq_msg_t *);
static size_t (*p_msg_size)(const zmq_msg_t *);
static int (*p_msg_more)(const zmq_msg_t *);
static int (*p_send)(void *, const void *, size_t, int);
static int (*p_errno)(void);
static const char *(*p_strerror)(int);

enum { ZMQ_DONTWAIT = 1, ZMQ_SNDMORE = 2 };

static PyObject *ZMQFastError;   /* raised with (errno, message) */

static PyObject *zmq_error(int err) {
    PyObject *args = Py_BuildValue("(is)", err, p_strerror ? p_strerror(err) : "zmq error");
    if (args) {
        PyErr_SetObject(ZMQFastError, args);
        Py_DECREF(args);
    }
    return NULL;
}

static PyObject *fast_init(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) {
        PyErr_Format(PyExc_OSError, "libzmq %s is not loaded: %s", path, dlerror());
        return NULL;
    }
#define SYM(var, name)                                                              \
    *(void **)(&var) = dlsym(lib, name);                                            \
    if (!var) {                                                                     \
        PyErr_Format(PyExc_OSError, "%s: no symbol %s", path, name);                \
        return NULL;                                                                \
    }
    SYM(p_msg_init, "zmq_msg_init");
    SYM(p_msg_recv, "zmq_msg_recv");
    SYM(p_msg_close, "zmq_msg_close");
    SYM(p_msg_data, "zmq_msg_data");
    SYM(p_msg_size, "zmq_msg_size");
    SYM(p_msg_more, "zmq_msg_more");
    SYM(p_send, "zmq_send");
    SYM(p_errno, "zmq_errno");
    SYM(p_strerror, "zmq_strerror");
#undef SYM
    /* the library stays loaded as long as pyzmq is: keep our reference for good */
    Py_RETURN_NONE;
}

static void *handle_of(PyObject *obj) {
    void *h = PyLong_AsVoidPtr(obj);
    if (!h && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "null socket handle");
    return h;
}

/* Up to limit whole messages, no blocking; stops after the message that brings the
 * bytes received to max_bytes or more (0: no byte bound).  *total and *biggest get the
 * bytes of all frames and of the largest frame. */
static PyObject *drain_impl(void *sock, Py_ssize_t limit, size_t max_bytes, size_t *total,
                            size_t *biggest) {
    size_t sum = 0, big = 0;
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    zmq_msg_t msg;
    p_msg_init(&msg);
    for (Py_ssize_t n = 0; n < limit; n++) {
        PyObject *frames = NULL;
        int flags = ZMQ_DONTWAIT;
        for (;;) {
            if (p_msg_recv(&msg, sock, flags) < 0) {
                int err = p_errno();
                if (flags == ZMQ_DONTWAIT && frames == NULL &&
                        (err == EAGAIN || err == EINTR)) {
                    goto done;                  /* nothing (more) queued right now */
                }
                if (err == EINTR) continue;     /* rest of a message: it is there */
                Py_XDECREF(frames);
                p_msg_close(&msg);
                Py_DECREF(out);
                return zmq_error(err);
            }
            if (!frames && !(frames = PyList_New(0))) goto fail;
            size_t sz = p_msg_size(&msg);
            sum += sz;
            if (sz > big) big = sz;
            PyObject *b = PyBytes_FromStringAndSize(p_msg_data(&msg), (Py_ssize_t)sz);
            if (!b || PyList_Append(frames, b) < 0) {
                Py_XDECREF(b);
                Py_DECREF(frames);
                goto fail;
            }
            Py_DECREF(b);
            if (!p_msg_more(&msg)) break;
            flags = 0;   /* ZeroMQ delivers a multipart message whole */
        }
        if (PyList_Append(out, frames) < 0) {
            Py_DECREF(frames);
            goto fail;
        }
        Py_DECREF(frames);
        if (max_bytes && sum >= max_bytes) break;
    }
done:
    p_msg_close(&msg);
    *total = sum;
    *biggest = big;
    return out;
fail:
    p_msg_close(&msg);
    Py_DECREF(out);
    return NULL;
}

static void *drain_args(PyObject *hobj) {
    if (!p_msg_recv) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    return handle_of(hobj);
}

/* drain(handle, limit) -> [[frame, ...], ...]: up to limit whole messages, no blocking */
static PyObject *fast_drain(PyObject *self, PyObject *args) {
    PyObject *hobj;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "On", &hobj, &limit)) return NULL;
    void *sock = drain_args(hobj);
    if (!sock) return NULL;
    size_t total, biggest;
    return drain_impl(sock, limit, 0, &total, &biggest);
}

/* drain_bytes(handle, limit, max_bytes) -> (messages, total_bytes, biggest_frame): like
 * drain, and stops after the message that brings the bytes to max_bytes (0: no bound) */
static PyObject *fast_drain_bytes(PyObject *self, PyObject *args) {
    PyObject *hobj;
    Py_ssize_t limit, max_bytes;
    if (!PyArg_ParseTuple(args, "Onn", &hobj, &limit, &max_bytes)) return NULL;
    void *sock = drain_args(hobj);
    if (!sock) return NULL;
    size_t total = 0, biggest = 0;
    PyObject *out = drain_impl(sock, limit, max_bytes > 0 ? (size_t)max_bytes : 0, &total,
                               &biggest);
    if (!out) return NULL;
    return Py_BuildValue("(Nnn)", out, (Py_ssize_t)total, (Py_ssize_t)biggest);
}

static int send_frame(void *sock, PyObject *f, int flags) {
    if (PyBytes_CheckExact(f))
        return p_send(sock, PyBytes_AS_STRING(f), (size_t)PyBytes_GET_SIZE(f), flags);
    Py_buffer view;
    if (PyObject_GetBuffer(f, &view, PyBUF_SIMPLE) < 0) return -2;
    int rc = p_send(sock, view.buf, (size_t)view.len, flags);
    PyBuffer_Release(&view);
    return rc;
}

/* publish(handle, records, start) -> (index, errno): sends records[start:] in order and
 * stops at the first record whose FIRST frame could not be sent (EAGAIN at the HWM,
 * EHOSTUNREACH from a ROUTER_MANDATORY socket, ...): (its index, the error).  All sent:
 * (len(records), 0).  An error after a record's first frame raises (ZeroMQ sends a
 * multipart message atomically, so it does not happen short of a closed socket).
 * Each record is a sequence of frames (bytes or buffer objects). */
static PyObject *fast_publish(PyObject *self, PyObject *args) {
    PyObject *hobj, *records;
    Py_ssize_t start;
    if (!p_send) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOn", &hobj, &records, &start)) return NULL;
    void *sock = handle_of(hobj);
    if (!sock) return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t i = start < 0 ? 0 : start;
    for (; i < n; i++) {
        PyObject *rec = PySequence_Fast(PySequence_Fast_GET_ITEM(seq, i),
                                        "a record must be a sequence of frames");
        if (!rec) goto fail;
        Py_ssize_t k = PySequence_Fast_GET_SIZE(rec);
        if (k == 0) {
            Py_DECREF(rec);
            PyErr_SetString(PyExc_ValueError, "empty record");
            goto fail;
        }
        PyObject **items = PySequence_Fast_ITEMS(rec);
        for (Py_ssize_t j = 0; j < k; j++) {
            int flags = (j < k - 1 ? ZMQ_SNDMORE : 0) | (j == 0 ? ZMQ_DONTWAIT : 0);
            int rc;
            while ((rc = send_frame(sock, items[j], flags)) == -1 && p_errno() == EINTR)
                ;
            if (rc == -2) {
                Py_DECREF(rec);
                goto fail;
            }
            if (rc < 0) {
                int err = p_errno();
                Py_DECREF(rec);
                if (j == 0) {
                    Py_DECREF(seq);
                    return Py_BuildValue("(ni)", i, err);
                }
                Py_DECREF(seq);
                return zmq_error(err);
            }
        }
        Py_DECREF(rec);
    }
    Py_DECREF(seq);
    return Py_BuildValue("(ni)", n, 0);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"init", fast_init, METH_VARARGS, "init(libzmq_path): bind to the loaded libzmq"},
    {"drain", fast_drain, METH_VARARGS,
     "drain(handle, limit) -> list of whole messages (lists of bytes), without blocking"},
    {"drain_bytes", fast_drain_bytes, METH_VARARGS,
     "drain_bytes(handle, limit, max_bytes) -> (messages, total bytes, largest frame)"},
    {"publish", fast_publish, METH_VARARGS,
     "publish(handle, records, start) -> (index, errno) of the first record not sent"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_zmqfast", "Batch receive/publish for pyzmq sockets.", -1, methods,
};

PyMODINIT_FUNC PyInit__zmqfast(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    ZMQFastError = PyErr_NewException("logjam_relay.io._zmqfast.ZMQFastError",
                                      PyExc_OSError, NULL);
    if (!ZMQFastError || PyModule_AddObjectRef(m, "ZMQFastError", ZMQFastError) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
