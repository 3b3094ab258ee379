/* Batch receive and publish on pyzmq sockets, in C: the relay's per-frame cost (and the
 * relay's ingest pass: drain + stamp + publish + spool records, see below).
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
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>
#include <zlib.h>

#include "../_c/meta.h"         /* the meta frame's check and the stamp (relay/_stamp.c's too) */
#include "../_c/record_crc.h"   /* the spool record's encoding (spool/_segenc.c's too) */

typedef struct { _Alignas(8) unsigned char _[64]; } zmq_msg_t;
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;

static int (*p_msg_init)(zmq_msg_t *);
static int (*p_msg_init_size)(zmq_msg_t *, size_t);
static int (*p_msg_move)(zmq_msg_t *, zmq_msg_t *);
static int (*p_msg_recv)(zmq_msg_t *, void *, int);
static int (*p_msg_close)(zmq_msg_t *);
static void *(*p_msg_data)(zmq_msg_t *);
static size_t (*p_msg_size)(const zmq_msg_t *);
static int (*p_msg_more)(const zmq_msg_t *);
static int (*p_send)(void *, const void *, size_t, int);
static int (*p_msg_send)(zmq_msg_t *, void *, int);
static int (*p_errno)(void);
static int (*p_poll)(zmq_pollitem_t *, int, long);
static int (*p_setsockopt)(void *, int, const void *, size_t);
static const char *(*p_strerror)(int);
/* LZ4 (-x lz4 in the ingest pass): from the python-lz4 extension already loaded */
static int (*p_lz4_compress)(const char *, char *, int, int);
static int (*p_lz4_bound)(int);

enum { ZMQ_DONTWAIT = 1, ZMQ_SNDMORE = 2, ZMQ_POLLIN = 1, ZMQ_XPUB_NODROP = 69 };
#ifndef ENOTSOCK
#define ENOTSOCK 88
#endif

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
    SYM(p_msg_init_size, "zmq_msg_init_size");
    SYM(p_msg_move, "zmq_msg_move");
    SYM(p_msg_recv, "zmq_msg_recv");
    SYM(p_msg_close, "zmq_msg_close");
    SYM(p_msg_data, "zmq_msg_data");
    SYM(p_msg_size, "zmq_msg_size");
    SYM(p_msg_more, "zmq_msg_more");
    SYM(p_send, "zmq_send");
    SYM(p_msg_send, "zmq_msg_send");
    SYM(p_errno, "zmq_errno");
    SYM(p_strerror, "zmq_strerror");
    SYM(p_poll, "zmq_poll");
    SYM(p_setsockopt, "zmq_setsockopt");
#undef SYM
    /* the library stays loaded as long as pyzmq is: keep our reference for good */
    Py_RETURN_NONE;
}

static PyObject *fast_init_lz4(PyObject *self, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path)) return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
    if (!lib) return PyErr_Format(PyExc_OSError, "%s is not loaded: %s", path, dlerror());
    *(void **)(&p_lz4_compress) = dlsym(lib, "LZ4_compress_default");
    *(void **)(&p_lz4_bound) = dlsym(lib, "LZ4_compressBound");
    if (!p_lz4_compress || !p_lz4_bound) {
        p_lz4_compress = NULL;
        return PyErr_Format(PyExc_OSError, "%s: no LZ4_compress_default", path);
    }
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

/* ------------------------------------------------------------------ the hand-over ring
 *
 * ring(max_records) -> capsule: the queue between the event loop (the one producer:
 * publish, ingest_pass) and an XPUB's thread (the one consumer: pump_ring), in place of
 * an inproc PUSH/PULL pair (io/xpubthread.py).  Frames are zmq_msg_t moved in (the frames
 * the ingest pass received, zero-copy) or copied in (publish's Python bytes), in chunks
 * of RING_CHUNK slots allocated as the queue grows (one spare chunk is kept); a record's
 * frames become visible together (`head`, release/acquire).  At most max_records records
 * are queued (0: no bound); a record over it is refused with EAGAIN, as a full PUSH.
 * The consumer sleeps in zmq_poll on an eventfd beside the XPUB; the producer writes the
 * eventfd only when the consumer said it sleeps (`sleeping`, a Dekker pair of seq_cst
 * accesses), so a busy stream costs no system call per record.  ring_stop: the consumer
 * forwards what is queued, then returns PUMP_STOP.  ring_close frees what is left (only
 * once the consumer is gone).  The consumer counts what it forwarded and what went lossy
 * (ring_counts, from any thread): its caller need not come back to Python -- and wait
 * for the GIL, which a busy event loop holds -- to keep them.  ring_kick (any
 * thread) makes ring_pump return PUMP_WATCH: Python work is waiting for the thread.
 */
#define RING_CHUNK 252
#define RING_WAKE_EVERY 256
#define RING_POLL_US 1000

typedef struct rchunk {
    zmq_msg_t m[RING_CHUNK];
    unsigned char more[RING_CHUNK];
    _Atomic(struct rchunk *) next;
} rchunk;

typedef struct {
    /* the producer's (the loop's) */
    rchunk *wc;
    int wpos;
    uint64_t written, rec_in, unsignalled, rec_out_seen;
    /* the consumer's (the XPUB thread's) */
    _Alignas(64) rchunk *rc;
    int rpos;
    uint64_t consumed, taken;
    /* shared */
    _Alignas(64) _Atomic uint64_t head;     /* frames of whole records, committed */
    _Alignas(64) _Atomic uint64_t rec_out;  /* records the consumer took */
    _Alignas(64) _Atomic int sleeping;
    _Atomic int stop;
    _Atomic int kick;                       /* ring_kick: return PUMP_WATCH */
    _Atomic uint64_t fwd_total, drop_total; /* the consumer's counts (ring_counts) */
    _Atomic(rchunk *) spare;
    uint64_t max_records;
    int efd, closed;
} ring_t;

#define RING_CAPSULE "logjam_relay.io._zmqfast.ring"

static rchunk *rchunk_new(void) {
    rchunk *c = malloc(sizeof *c);
    if (c) atomic_init(&c->next, NULL);
    return c;
}

static void ring_free_contents(ring_t *r) {
    /* every slot from the consumer's position to the producer's holds a message */
    rchunk *c = r->rc;
    int pos = r->rpos;
    for (uint64_t i = r->consumed; i < r->written && c; i++) {
        if (pos == RING_CHUNK) {
            c = atomic_load_explicit(&c->next, memory_order_acquire);
            pos = 0;
            if (!c) break;
        }
        p_msg_close(&c->m[pos++]);
    }
    c = r->rc;
    while (c) {
        rchunk *n = atomic_load_explicit(&c->next, memory_order_relaxed);
        free(c);
        c = n;
    }
    free(atomic_exchange(&r->spare, NULL));
    r->rc = r->wc = NULL;
    if (r->efd >= 0) close(r->efd);
    r->efd = -1;
    r->closed = 1;
}

static void ring_capsule_free(PyObject *cap) {
    ring_t *r = PyCapsule_GetPointer(cap, RING_CAPSULE);
    if (!r) return;
    if (!r->closed) ring_free_contents(r);
    free(r);
}

static PyObject *fast_ring(PyObject *self, PyObject *args) {
    unsigned long long max_records;
    if (!p_msg_init_size) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "K", &max_records)) return NULL;
    ring_t *r = calloc(1, sizeof *r);
    if (!r) return PyErr_NoMemory();
    r->max_records = max_records;
    r->rc = r->wc = rchunk_new();
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (!r->wc || r->efd < 0) {
        int e = errno;
        free(r->wc);
        if (r->efd >= 0) close(r->efd);
        free(r);
        if (e == 0 || e == ENOMEM) return PyErr_NoMemory();
        errno = e;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    atomic_init(&r->head, 0);
    atomic_init(&r->rec_out, 0);
    atomic_init(&r->sleeping, 0);
    atomic_init(&r->stop, 0);
    atomic_init(&r->kick, 0);
    atomic_init(&r->fwd_total, 0);
    atomic_init(&r->drop_total, 0);
    atomic_init(&r->spare, NULL);
    PyObject *cap = PyCapsule_New(r, RING_CAPSULE, ring_capsule_free);
    if (!cap) {
        ring_free_contents(r);
        free(r);
    }
    return cap;
}

static ring_t *ring_of(PyObject *obj) {
    ring_t *r = PyCapsule_GetPointer(obj, RING_CAPSULE);
    if (r && r->closed) {
        zmq_error(ENOTSOCK);
        return NULL;
    }
    return r;
}

/* the producer's side: ring_room, then ring_slot per frame, then ring_commit (or
 * ring_rollback); nothing is visible to the consumer before ring_commit */
typedef struct { rchunk *wc; int wpos; uint64_t written; } ring_mark;

static int ring_room(ring_t *r) {
    /* the consumer's count is read only when the last one read says full: the line it
     * lives on is not pulled across cores for every record */
    if (!r->max_records || r->rec_in - r->rec_out_seen < r->max_records) return 1;
    r->rec_out_seen = atomic_load_explicit(&r->rec_out, memory_order_acquire);
    return r->rec_in - r->rec_out_seen < r->max_records;
}

static zmq_msg_t *ring_slot(ring_t *r, int more) {
    if (r->wpos == RING_CHUNK) {
        rchunk *c = atomic_load_explicit(&r->wc->next, memory_order_relaxed);
        if (!c) {
            c = atomic_exchange(&r->spare, NULL);
            if (c) atomic_store_explicit(&c->next, NULL, memory_order_relaxed);
            else if (!(c = rchunk_new())) return NULL;
            atomic_store_explicit(&r->wc->next, c, memory_order_release);
        }
        r->wc = c;
        r->wpos = 0;
    }
    r->wc->more[r->wpos] = (unsigned char)more;
    r->written++;
    return &r->wc->m[r->wpos++];
}

static void ring_wake(ring_t *r) {
    r->unsignalled = 0;
    atomic_thread_fence(memory_order_seq_cst);
    if (atomic_load_explicit(&r->sleeping, memory_order_relaxed) &&
            atomic_exchange(&r->sleeping, 0)) {
        uint64_t one = 1;
        ssize_t rc = write(r->efd, &one, sizeof one);
        (void)rc;    /* EAGAIN: the counter is full, so the consumer is woken anyway */
    }
}

static void ring_commit(ring_t *r) {
    atomic_store_explicit(&r->head, r->written, memory_order_release);
    r->rec_in++;
    if (++r->unsignalled >= RING_WAKE_EVERY) ring_wake(r);
}

static void ring_rollback(ring_t *r, const ring_mark *m) {
    /* close what this record put in (the slots after the mark), forget them */
    rchunk *c = m->wc;
    int pos = m->wpos;
    for (uint64_t i = m->written; i < r->written; i++) {
        if (pos == RING_CHUNK) {
            c = atomic_load_explicit(&c->next, memory_order_relaxed);
            pos = 0;
        }
        p_msg_close(&c->m[pos++]);
    }
    r->wc = m->wc;
    r->wpos = m->wpos;
    r->written = m->written;
}

/* one Python record into the ring (copies): 0, EAGAIN (full: nothing queued), or -1 with
 * a Python error set */
static int ring_put_record(ring_t *r, PyObject *rec) {
    if (!ring_room(r)) return EAGAIN;
    PyObject *seq = PySequence_Fast(rec, "a record must be a sequence of frames");
    if (!seq) return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    if (k == 0) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "empty record");
        return -1;
    }
    ring_mark mk = {r->wc, r->wpos, r->written};
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t j = 0; j < k; j++) {
        Py_buffer view;
        if (PyObject_GetBuffer(items[j], &view, PyBUF_SIMPLE) < 0) goto fail;
        zmq_msg_t *m = ring_slot(r, j < k - 1);
        if (!m || p_msg_init_size(m, (size_t)view.len) < 0) {
            if (m) {   /* the slot was taken: give it an empty message to close */
                p_msg_init(m);
            }
            PyBuffer_Release(&view);
            PyErr_NoMemory();
            goto fail;
        }
        memcpy(p_msg_data(m), view.buf, (size_t)view.len);
        PyBuffer_Release(&view);
    }
    Py_DECREF(seq);
    ring_commit(r);
    return 0;
fail:
    ring_rollback(r, &mk);
    Py_DECREF(seq);
    return -1;
}

static PyObject *fast_ring_stop(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    ring_t *r = ring_of(cap);
    if (!r) return NULL;
    atomic_store(&r->stop, 1);
    ring_wake(r);
    Py_RETURN_NONE;
}

/* ring_kick(ring): ring_pump returns PUMP_WATCH soon (any thread: the consumer is woken
 * if it sleeps; the producer's fields are not touched) */
static PyObject *fast_ring_kick(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    ring_t *r = ring_of(cap);
    if (!r) return NULL;
    atomic_store(&r->kick, 1);
    if (atomic_exchange(&r->sleeping, 0)) {
        uint64_t one = 1;
        ssize_t rc = write(r->efd, &one, sizeof one);
        (void)rc;
    }
    Py_RETURN_NONE;
}

/* ring_counts(ring) -> (forwarded, dropped): records the consumer put on the XPUB so far,
 * and of them those sent lossy (a subscriber at its HWM) */
static PyObject *fast_ring_counts(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    ring_t *r = PyCapsule_GetPointer(cap, RING_CAPSULE);
    if (!r) return NULL;
    return Py_BuildValue("(KK)", (unsigned long long)atomic_load(&r->fwd_total),
                         (unsigned long long)atomic_load(&r->drop_total));
}

static PyObject *fast_ring_close(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    ring_t *r = PyCapsule_GetPointer(cap, RING_CAPSULE);
    if (!r) return NULL;
    if (!r->closed) ring_free_contents(r);
    Py_RETURN_NONE;
}

static PyObject *fast_ring_info(PyObject *self, PyObject *args) {
    PyObject *cap;
    if (!PyArg_ParseTuple(args, "O", &cap)) return NULL;
    ring_t *r = ring_of(cap);
    if (!r) return NULL;
    /* records queued, as the producer (the caller) sees them */
    return PyLong_FromUnsignedLongLong(r->rec_in - atomic_load(&r->rec_out));
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
/* publish onto a ring: the same contract (EAGAIN: the ring holds max_records) */
static PyObject *ring_publish(PyObject *cap, PyObject *records, Py_ssize_t start) {
    ring_t *r = ring_of(cap);
    if (!r) return NULL;
    PyObject *seq = PySequence_Fast(records, "records must be a sequence");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Py_ssize_t i = start < 0 ? 0 : start;
    PyObject *res = NULL;
    for (; i < n; i++) {
        int rc = ring_put_record(r, PySequence_Fast_GET_ITEM(seq, i));
        if (rc < 0) goto out;
        if (rc == EAGAIN) break;
    }
    res = Py_BuildValue("(ni)", i, i < n ? EAGAIN : 0);
out:
    ring_wake(r);
    Py_DECREF(seq);
    return res;
}

static PyObject *fast_publish(PyObject *self, PyObject *args) {
    PyObject *hobj, *records;
    Py_ssize_t start;
    if (!p_send) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOn", &hobj, &records, &start)) return NULL;
    if (PyCapsule_CheckExact(hobj)) return ring_publish(hobj, records, start);
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

/* ------------------------------------------------------------------ the ingest pass
 *
 * ingest_pass(in_handle, pub_handle, limit, max_bytes, max_event, good_streams,
 *             good_topics, device, seq, now8, spool_seq, router, replies, accepted)
 *     -> (consumed, total, seq, nfast, nbytes, maxb, spool, last_meta, stop, extra)
 *
 * The relay's ingest hot path without a Python object per message: receives up to limit
 * whole messages from the PULL (router false) or ROUTER socket (no blocking; stops after
 * the message that brings the frame bytes to max_bytes, 0: no bound) and, while every
 * message takes the fast path of relay/stamping.py (PULL: app, topic, body, meta; ROUTER:
 * id, app, topic, body, meta or id, "", app, topic, body, meta; no frame over max_event,
 * stream and topic in the validator's good sets, a 24-byte meta frame with tag CABD/BDCA
 * and version 1), stamps it exactly as Pipeline.commit does (meta CA BD <compression> 01
 * <device u32> <created, or now8 when zero> <seq u64>, seq counting up from seq + 1) and
 * publishes app, topic, body, meta on the XPUB (the received frames are sent on,
 * zero-copy; the meta frame is new).  A ROUTER request (the empty frame) gets its reply
 * [id, app, accepted] appended to `replies`, for the caller to send once the batch is
 * spooled.  With spool_seq >= 0 it also encodes each record as spool/segment.py
 * encode_logjam_batch does (spool sequence numbers from spool_seq; the CRC is zlib's
 * crc32): `spool` (bytes) and `last_meta` (the last record's meta), else both None.
 *
 * consumed: messages taken from the socket (the fast ones, plus the one in `extra` when
 * stop is 1); total: their frame bytes; nfast, nbytes, maxb: the stamped records, their
 * body bytes and largest body; seq: the last sequence number used.
 * stop 0: limit, max_bytes or an empty socket; 1: `extra` is the frames (a list of bytes)
 * of a message off the fast path, received and not stamped (Python classifies it);
 * 2: `extra` is a stamped record (app, topic, body, meta), counted in nfast and in the
 * spool bytes, whose first frame the XPUB refused (EAGAIN: a subscriber at its HWM),
 * for the caller to send lossy (PubSocket._send_lossy) before it calls again.
 * A socket error raises ZMQFastError: at once if nothing was taken yet, else the pass
 * returns what it published (stop 0) and the next call raises.  Nothing of the message
 * the error interrupts was published.
 * Every length comes from libzmq (zmq_msg_size) and is checked before it is used; the
 * frames are never parsed beyond the 24 bytes of a meta frame of that exact size.
 */

#define PP_CACHE 8

typedef struct {
    unsigned char *p;
    size_t len, cap;
} ppbuf;

static int ppbuf_grow(ppbuf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 65536;
    while (cap < b->len + more) cap *= 2;
    unsigned char *p = PyMem_Realloc(b->p, cap);
    if (!p) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

/* 1: the frame's bytes are in the set (a cache of hits first), 0: not, -1: error */
static int pp_known(PyObject *set, PyObject **cache, int *ncache, zmq_msg_t *m) {
    const char *d = p_msg_data(m);
    size_t n = p_msg_size(m);
    for (int k = 0; k < *ncache; k++)
        if ((size_t)PyBytes_GET_SIZE(cache[k]) == n && memcmp(PyBytes_AS_STRING(cache[k]), d, n) == 0)
            return 1;
    PyObject *b = PyBytes_FromStringAndSize(d, (Py_ssize_t)n);
    if (!b) return -1;
    int r = PySet_Contains(set, b);
    if (r == 1 && *ncache < PP_CACHE) cache[(*ncache)++] = b;
    else Py_DECREF(b);
    return r;
}

static PyObject *pp_bytes(zmq_msg_t *m) {
    return PyBytes_FromStringAndSize(p_msg_data(m), (Py_ssize_t)p_msg_size(m));
}

static PyObject *ingest_pass(PyObject *self, PyObject *args) {
    PyObject *hin, *hpub, *gs, *gt, *now8, *replies, *accepted;
    int router, compress = 0;
    Py_ssize_t limit, max_bytes, max_event;
    unsigned long device;
    unsigned long long seq;
    long long spool_seq;
    if (!p_msg_send) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOnnnO!O!kKSLpO!S|i", &hin, &hpub, &limit, &max_bytes,
                          &max_event, &PySet_Type, &gs, &PySet_Type, &gt, &device, &seq, &now8,
                          &spool_seq, &router, &PyList_Type, &replies, &accepted, &compress))
        return NULL;
    if (compress != 0 && (compress != 3 || !p_lz4_compress)) {
        PyErr_Format(PyExc_ValueError, "compress %d: only 3 (lz4, after init_lz4)", compress);
        return NULL;
    }
    if (PyBytes_GET_SIZE(now8) != 8) {
        PyErr_SetString(PyExc_ValueError, "now8 must be 8 bytes");
        return NULL;
    }
    void *sin = handle_of(hin);
    if (!sin) return NULL;
    void *pub = NULL;
    ring_t *ring = NULL;
    if (PyCapsule_CheckExact(hpub)) {
        if (!(ring = ring_of(hpub))) return NULL;
    } else if (!(pub = handle_of(hpub))) {
        return NULL;
    }
    const unsigned char *now = (const unsigned char *)PyBytes_AS_STRING(now8);
    PyObject *cache_a[PP_CACHE], *cache_t[PP_CACHE];
    int nca = 0, nct = 0;
    const int nmax = router ? 6 : 4;     /* frames of the longest fast-path message */
    zmq_msg_t fr[6];
    for (int k = 0; k < 6; k++) p_msg_init(&fr[k]);
    ppbuf sp = {NULL, 0, 0};
    unsigned char meta[LJ_META_LEN], last_meta[LJ_META_LEN];
    Py_ssize_t consumed = 0, nfast = 0, maxb = 0, ncomp = 0;
    size_t total = 0;
    long long nbytes = 0, cbytes = 0;
    ppbuf zb = {NULL, 0, 0};     /* -x lz4: the compressed body before it becomes a frame */
    uint64_t sseq = spool_seq >= 0 ? (uint64_t)spool_seq : 0;
    int stop = 0, err = 0;
    PyObject *extra = NULL, *result = NULL;

    while (consumed < limit && !(max_bytes > 0 && total >= (size_t)max_bytes)) {
        /* one whole message: up to nmax frames into fr[], more go to a list */
        int nf = 0, more = 1, fast = 1;
        while (more) {
            zmq_msg_t *m = nf < nmax ? &fr[nf] : &fr[nmax - 1];
            if (nf >= nmax) {
                /* one frame too many: the message is off the fast path; frames to a list */
                if (!extra) {
                    if (!(extra = PyList_New(0))) goto fail;
                    for (int k = 0; k < nmax; k++) {
                        PyObject *b = pp_bytes(&fr[k]);
                        if (!b || PyList_Append(extra, b) < 0) { Py_XDECREF(b); goto fail; }
                        Py_DECREF(b);
                    }
                }
            }
            int flags = nf == 0 ? ZMQ_DONTWAIT : 0;
            if (p_msg_recv(m, sin, flags) < 0) {
                int e = p_errno();
                if (nf == 0 && (e == EAGAIN || e == EINTR)) goto done;
                if (e == EINTR) continue;
                if (consumed > 0) {
                    /* (a closed socket, a terminated context) what was published is
                     * returned, to be spooled; the next call raises */
                    Py_CLEAR(extra);
                    goto done;
                }
                err = e;
                goto fail;
            }
            size_t sz = p_msg_size(m);
            total += sz;
            if (sz > (size_t)max_event) fast = 0;
            more = p_msg_more(m);
            if (nf >= nmax) {
                PyObject *b = pp_bytes(m);
                if (!b || PyList_Append(extra, b) < 0) { Py_XDECREF(b); goto fail; }
                Py_DECREF(b);
            }
            nf++;
        }
        consumed++;
        /* PULL: app, topic, body, meta; ROUTER: id, app...meta (async) or id, "", app...
         * meta (a request: answered 202 once spooled) */
        int base = 0;
        if (!router) {
            if (nf != 4) fast = 0;
        } else if (nf == 5) {
            base = 1;
        } else if (nf == 6 && p_msg_size(&fr[1]) == 0) {
            base = 2;
        } else {
            fast = 0;
        }
        zmq_msg_t *f = &fr[base];
        const unsigned char *mp = NULL;
        if (fast) {
            mp = p_msg_data(&f[3]);
            fast = lj_meta_plain(mp, p_msg_size(&f[3]));
        }
        if (fast) {
            int r = pp_known(gs, cache_a, &nca, &f[0]);
            if (r < 0) goto fail;
            if (r) r = pp_known(gt, cache_t, &nct, &f[1]);
            if (r < 0) goto fail;
            fast = r;
        }
        if (!fast) {
            if (!extra) {
                if (!(extra = PyList_New(0))) goto fail;
                for (int k = 0; k < nf; k++) {
                    PyObject *b = pp_bytes(&fr[k]);
                    if (!b || PyList_Append(extra, b) < 0) { Py_XDECREF(b); goto fail; }
                    Py_DECREF(b);
                }
            }
            stop = 1;
            goto done;
        }
        /* -x lz4: an uncompressed body is compressed (protocols/logjam.py compress: a
         * 4-byte big-endian length, then the LZ4 block); counted with its original size */
        size_t lb = p_msg_size(&f[2]);
        unsigned char method = mp[2];
        if (compress && method == 0) {
            if (lb > 0x7E000000) {
                PyErr_SetString(PyExc_OverflowError, "body too large for lz4");
                goto fail;
            }
            int cap = p_lz4_bound((int)lb);
            zb.len = 0;
            if (ppbuf_grow(&zb, 4 + (size_t)cap) < 0) goto fail;
            /* an empty body too: python-lz4 gives the one-byte empty block */
            int clen = p_lz4_compress((const char *)p_msg_data(&f[2]), (char *)zb.p + 4,
                                      (int)lb, cap);
            if (clen <= 0) {
                PyErr_SetString(PyExc_RuntimeError, "LZ4_compress_default failed");
                goto fail;
            }
            zb.p[0] = (unsigned char)(lb >> 24); zb.p[1] = (unsigned char)(lb >> 16);
            zb.p[2] = (unsigned char)(lb >> 8); zb.p[3] = (unsigned char)lb;
            zmq_msg_t cm;
            if (p_msg_init_size(&cm, 4 + (size_t)clen) < 0) {
                PyErr_NoMemory();
                goto fail;
            }
            memcpy(p_msg_data(&cm), zb.p, 4 + (size_t)clen);
            p_msg_move(&f[2], &cm);          /* the received body is released */
            p_msg_close(&cm);
            method = (unsigned char)compress;
            ncomp++;
            cbytes += 4 + clen;
        }
        /* stamp */
        seq++;
        lj_stamp(meta, method, (uint32_t)device, mp + 8, now, seq);
        nfast++;
        nbytes += (long long)lb;
        if ((Py_ssize_t)lb > maxb) maxb = (Py_ssize_t)lb;
        lb = p_msg_size(&f[2]);          /* the body as spooled and published */
        /* spool record (before the frames are sent on) */
        if (spool_seq >= 0) {
            size_t la = p_msg_size(&f[0]), lt = p_msg_size(&f[1]);
            size_t body = lj_record4_body(la, lt, lb, LJ_META_LEN);
            if (body > UINT32_MAX) {
                PyErr_SetString(PyExc_OverflowError, "record too large for the spool");
                goto fail;
            }
            if (ppbuf_grow(&sp, LJ_PREFIX + body) < 0) goto fail;
            sp.len = (size_t)(lj_record4_put(sp.p + sp.len, sseq, p_msg_data(&f[0]), (uint32_t)la,
                                             p_msg_data(&f[1]), (uint32_t)lt,
                                             p_msg_data(&f[2]), (uint32_t)lb,
                                             meta, LJ_META_LEN) - sp.p);
            sseq++;
            memcpy(last_meta, meta, LJ_META_LEN);
        }
        /* the 202 reply [id, app, accepted], sent by the caller once the batch is spooled */
        if (base == 2) {
            PyObject *rep = Py_BuildValue("[NNO]", pp_bytes(&fr[0]), pp_bytes(&f[0]), accepted);
            if (!rep || PyList_Append(replies, rep) < 0) {
                Py_XDECREF(rep);
                goto fail;
            }
            Py_DECREF(rep);
        }
        if (ring) {
            /* hand over to the XPUB's thread: the frames move, the meta is copied */
            if (!ring_room(ring)) {
                extra = Py_BuildValue("(NNNy#)", pp_bytes(&f[0]), pp_bytes(&f[1]),
                                      pp_bytes(&f[2]), (const char *)meta, (Py_ssize_t)24);
                if (!extra) goto fail;
                stop = 2;
                goto done;
            }
            ring_mark mk = {ring->wc, ring->wpos, ring->written};
            zmq_msg_t *s = NULL;
            for (int k = 0; k < 4; k++) {
                if (!(s = ring_slot(ring, k < 3))) break;
                if (k < 3) {
                    p_msg_init(s);
                    p_msg_move(s, &f[k]);
                } else if (p_msg_init_size(s, 24) < 0) {
                    p_msg_init(s);
                    s = NULL;
                } else {
                    memcpy(p_msg_data(s), meta, 24);
                }
            }
            if (!s) {
                ring_rollback(ring, &mk);
                PyErr_NoMemory();
                goto fail;
            }
            ring_commit(ring);
            continue;
        }
        /* publish: the first frame may meet a subscriber at its HWM (EAGAIN) */
        int rc;
        while ((rc = p_msg_send(&f[0], pub, ZMQ_SNDMORE | ZMQ_DONTWAIT)) < 0 &&
               p_errno() == EINTR)
            ;
        if (rc < 0) {
            int e = p_errno();
            if (e != EAGAIN) {
                err = e;
                goto fail;
            }
            extra = Py_BuildValue("(NNNy#)", pp_bytes(&f[0]), pp_bytes(&f[1]),
                                  pp_bytes(&f[2]), (const char *)meta, (Py_ssize_t)24);
            if (!extra) goto fail;
            stop = 2;
            goto done;
        }
        for (int k = 1; k < 3; k++) {
            while ((rc = p_msg_send(&f[k], pub, ZMQ_SNDMORE)) < 0 && p_errno() == EINTR)
                ;
            if (rc < 0) { err = p_errno(); goto fail; }
        }
        while ((rc = p_send(pub, meta, 24, 0)) < 0 && p_errno() == EINTR)
            ;
        if (rc < 0) { err = p_errno(); goto fail; }
    }
done:
    {
        PyObject *spool = Py_None, *lm = Py_None;
        if (spool_seq >= 0 && nfast > 0) {
            spool = PyBytes_FromStringAndSize((const char *)sp.p, (Py_ssize_t)sp.len);
            lm = PyBytes_FromStringAndSize((const char *)last_meta, 24);
            if (!spool || !lm) {
                Py_XDECREF(spool);
                Py_XDECREF(lm);
                goto fail;
            }
        } else {
            Py_INCREF(spool);
            Py_INCREF(lm);
        }
        if (!extra) {
            extra = Py_None;
            Py_INCREF(extra);
        }
        result = Py_BuildValue("(nnKnLnNNiNnL)", consumed, (Py_ssize_t)total, seq, nfast,
                               nbytes, maxb, spool, lm, stop, extra, ncomp, cbytes);
        extra = NULL;
    }
fail:
    if (ring) ring_wake(ring);
    for (int k = 0; k < 6; k++) p_msg_close(&fr[k]);
    for (int k = 0; k < nca; k++) Py_DECREF(cache_a[k]);
    for (int k = 0; k < nct; k++) Py_DECREF(cache_t[k]);
    PyMem_Free(sp.p);
    PyMem_Free(zb.p);
    Py_XDECREF(extra);
    if (!result && err) return zmq_error(err);
    return result;
}


/* ------------------------------------------------------------------ the XPUB thread's pump
 *
 * pump(src, xpub, watch, timeout_ms, batch) -> (forwarded, dropped, flags)
 *
 * The loop of the thread that owns an XPUB (io/xpubthread.py), without the GIL: waits up
 * to timeout_ms (-1: no bound) for any of `src` (the inproc PULL the event loop publishes
 * to), `xpub` and the sockets of `watch` (a sequence of handles: the guard's monitor) to
 * become readable, and moves whole messages from src to xpub (zero-copy, at most `batch`
 * per wake-up) until xpub or a watched socket is readable (flags 1 and 2: the guard has
 * work; the pass returns after forwarding what was pending), the timeout passes (flag 8)
 * or src delivers the stop sentinel, a message of one empty frame (flag 16; nothing after
 * it is read).  A message whose first frame meets a subscriber at its HWM (XPUB_NODROP:
 * EAGAIN) is sent again lossy, so that only the slow subscriber misses it (PUB
 * semantics), and counted in `dropped`.  libzmq's own work on xpub -- a subscriber's
 * connection ending walks the whole subscription trie -- happens in these calls, on this
 * thread, with the GIL released.
 */
enum { PUMP_XPUB = 1, PUMP_WATCH = 2, PUMP_TIMEOUT = 8, PUMP_STOP = 16 };
#define PUMP_MAX_WATCH 4

static int pump_send(zmq_msg_t *msg, void *xpub, int flags) {
    int rc;
    while ((rc = p_msg_send(msg, xpub, flags | ZMQ_DONTWAIT)) < 0 && p_errno() == EINTR)
        ;
    return rc;
}

/* one frame with PUB semantics: a record whose first frame meets a subscriber at its HWM
 * (XPUB_NODROP: EAGAIN) is sent lossy (*lossy set; the caller turns NODROP back on after
 * the record's last frame) */
static int pump_send_pub(zmq_msg_t *msg, void *xpub, int flags, int first, int *lossy) {
    int rc = pump_send(msg, xpub, flags);
    if (rc < 0 && first && p_errno() == EAGAIN) {
        int off = 0;
        *lossy = 1;
        p_setsockopt(xpub, ZMQ_XPUB_NODROP, &off, sizeof off);
        rc = pump_send(msg, xpub, flags);
    }
    return rc;
}

/* 1: forwarded (*dropped set when sent lossy), 0: nothing queued, 2: the stop sentinel,
 * -1: error (*err) */
static int pump_one(void *src, void *xpub, zmq_msg_t *msg, int *dropped, int *err) {
    int first = 1, lossy = 0, rc;
    for (;;) {
        while ((rc = p_msg_recv(msg, src, first ? ZMQ_DONTWAIT : 0)) < 0 &&
               p_errno() == EINTR)
            ;
        if (rc < 0) {
            *err = p_errno();
            if (first && *err == EAGAIN) return 0;
            break;
        }
        int more = p_msg_more(msg);
        if (first && !more && p_msg_size(msg) == 0) return 2;
        int flags = more ? ZMQ_SNDMORE : 0;
        rc = pump_send_pub(msg, xpub, flags, first, &lossy);
        if (rc < 0) {
            *err = p_errno();
            /* the rest of this record stays out of the next one: drop it from src */
            while (more && p_msg_recv(msg, src, 0) >= 0) more = p_msg_more(msg);
            break;
        }
        first = 0;
        if (!more) {
            if (lossy) {
                int on = 1;
                p_setsockopt(xpub, ZMQ_XPUB_NODROP, &on, sizeof on);
                *dropped = 1;
            }
            return 1;
        }
    }
    if (lossy) {
        int on = 1;
        p_setsockopt(xpub, ZMQ_XPUB_NODROP, &on, sizeof on);
    }
    return -1;   /* a send failed (the XPUB closed or the context ended): the caller stops */
}

/* items[1] = xpub, items[2..] = the sockets of `watch` (items[0], the source, is the
 * caller's): the number of items, or -1 with a Python error set */
static int pump_items(zmq_pollitem_t *items, void *xpub, PyObject *watch) {
    items[1].socket = xpub;
    int n = 2;
    PyObject *seq = PySequence_Fast(watch, "watch must be a sequence of handles");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) > PUMP_MAX_WATCH) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many sockets to watch");
        return -1;
    }
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        void *h = handle_of(PySequence_Fast_GET_ITEM(seq, i));
        if (!h) {
            Py_DECREF(seq);
            return -1;
        }
        items[n++].socket = h;
    }
    Py_DECREF(seq);
    return n;
}

static long elapsed_ms(const struct timespec *t0) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long)(t.tv_sec - t0->tv_sec) * 1000 + (t.tv_nsec - t0->tv_nsec) / 1000000;
}

static PyObject *fast_pump(PyObject *self, PyObject *args) {
    PyObject *sobj, *xobj, *watch;
    long timeout;
    Py_ssize_t batch;
    if (!p_poll) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOln", &sobj, &xobj, &watch, &timeout, &batch)) return NULL;
    void *src = handle_of(sobj);
    if (!src) return NULL;
    void *xpub = handle_of(xobj);
    if (!xpub) return NULL;
    zmq_pollitem_t items[2 + PUMP_MAX_WATCH];
    memset(items, 0, sizeof items);
    items[0].socket = src;
    int n = pump_items(items, xpub, watch);
    if (n < 0) return NULL;
    long forwarded = 0, dropped = 0;
    int flags = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    zmq_msg_t msg;
    p_msg_init(&msg);
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long wait = timeout;
    for (;;) {
        for (int i = 0; i < n; i++) {
            items[i].events = ZMQ_POLLIN;
            items[i].revents = 0;
        }
        int rc = p_poll(items, n, wait);
        if (rc < 0) {
            if (p_errno() != EINTR) {
                err = p_errno();
                break;
            }
        } else {
            if (items[1].revents & ZMQ_POLLIN) flags |= PUMP_XPUB;
            for (int i = 2; i < n; i++)
                if (items[i].revents & ZMQ_POLLIN) flags |= PUMP_WATCH;
            if (items[0].revents & ZMQ_POLLIN) {
                for (Py_ssize_t k = 0; k < batch; k++) {
                    int d = 0;
                    int r = pump_one(src, xpub, &msg, &d, &err);
                    if (r == 0) {
                        err = 0;
                        break;
                    }
                    if (r < 0) goto out;
                    if (r == 2) {
                        flags |= PUMP_STOP;
                        goto out;
                    }
                    forwarded++;
                    dropped += d;
                }
            }
            if (flags) break;
            if (rc == 0 || (timeout >= 0 && elapsed_ms(&t0) >= timeout)) {
                /* timed out, or kept busy forwarding past the timeout: the caller's
                 * counters and the guard's round are due */
                flags |= PUMP_TIMEOUT;
                break;
            }
        }
        if (timeout >= 0) {
            wait = timeout - elapsed_ms(&t0);
            if (wait < 0) wait = 0;
        }
    }
out:
    p_msg_close(&msg);
    Py_END_ALLOW_THREADS
    if (err) return zmq_error(err);
    return Py_BuildValue("(lli)", forwarded, dropped, flags);
}

/* ring_pump(ring, xpub, watch, timeout_ms, batch) -> (forwarded, dropped, flags): pump's
 * loop (above) with the ring as its source: same flags, PUMP_STOP once ring_stop was
 * called and everything queued before it is forwarded, PUMP_WATCH also after ring_kick --
 * but PUMP_TIMEOUT only once timeout_ms passed without a record: while records flow the
 * thread stays here, without the GIL.  Back in Python it would wait for the GIL (a busy
 * event loop holds it: a switch interval, 5 ms, per wait) with the records piling up in
 * the ring (PUB one-way p99 18.8 ms at 100k msg/s, docs/operations.md); its counts are kept here
 * (ring_counts), and what Python must do is announced (the XPUB readable, a watched
 * socket, ring_kick). */

/* the records taken so far become room for the producer */
static inline void ring_release(ring_t *r) {
    atomic_store_explicit(&r->rec_out, r->taken, memory_order_release);
}

static inline uint64_t ring_avail(ring_t *r) {
    return atomic_load_explicit(&r->head, memory_order_acquire) - r->consumed;
}

static zmq_msg_t *ring_next(ring_t *r, int *more) {
    if (r->rpos == RING_CHUNK) {
        rchunk *n = atomic_load_explicit(&r->rc->next, memory_order_acquire);
        rchunk *old = atomic_exchange(&r->spare, r->rc);
        free(old);
        r->rc = n;
        r->rpos = 0;
    }
    *more = r->rc->more[r->rpos];
    r->consumed++;
    return &r->rc->m[r->rpos++];
}

/* one whole record (the caller saw one available) onto xpub: 1 (*dropped set when sent
 * lossy) or -1 (*err; the rest of the record is closed) */
static int ring_forward(ring_t *r, void *xpub, int *dropped, int *err) {
    int first = 1, lossy = 0, more, rc;
    for (;;) {
        zmq_msg_t *m = ring_next(r, &more);
        int flags = more ? ZMQ_SNDMORE : 0;
        rc = pump_send_pub(m, xpub, flags, first, &lossy);
        if (rc < 0) {
            *err = p_errno();
            p_msg_close(m);
            while (more) p_msg_close(ring_next(r, &more));
            break;
        }
        first = 0;
        if (!more) break;
    }
    if (lossy) {
        int on = 1;
        p_setsockopt(xpub, ZMQ_XPUB_NODROP, &on, sizeof on);
    }
    r->taken++;        /* published to the producer by ring_release */
    if (rc < 0) return -1;
    *dropped = lossy;
    return 1;
}

static PyObject *fast_ring_pump(PyObject *self, PyObject *args) {
    PyObject *cap, *xobj, *watch;
    long timeout;
    Py_ssize_t batch;
    if (!p_poll) {
        PyErr_SetString(PyExc_RuntimeError, "_zmqfast.init() was not called");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "OOOln", &cap, &xobj, &watch, &timeout, &batch)) return NULL;
    ring_t *r = ring_of(cap);
    if (!r) return NULL;
    void *xpub = handle_of(xobj);
    if (!xpub) return NULL;
    zmq_pollitem_t items[2 + PUMP_MAX_WATCH];
    memset(items, 0, sizeof items);
    items[0].socket = NULL;
    items[0].fd = r->efd;
    int n = pump_items(items, xpub, watch);
    if (n < 0) return NULL;
    long forwarded = 0, dropped = 0;
    int flags = 0, err = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec t0, last_poll = {0, 0};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    long wait = timeout;
    for (;;) {
        long w = wait;
        int rc = 0, polled = 1;
        if (ring_avail(r)) {
            /* busy: the XPUB (a zmq_poll costs two system calls) is looked at every
             * RING_POLL_US only, the records keep moving in between */
            w = 0;
            struct timespec now;
            clock_gettime(CLOCK_MONOTONIC, &now);
            if ((now.tv_sec - last_poll.tv_sec) * 1000000L +
                    (now.tv_nsec - last_poll.tv_nsec) / 1000 < RING_POLL_US)
                polled = 0;
        } else {
            atomic_store(&r->sleeping, 1);             /* seq_cst: see ring_wake */
            if (atomic_load(&r->head) != r->consumed || atomic_load(&r->stop)) {
                atomic_store_explicit(&r->sleeping, 0, memory_order_relaxed);
                w = 0;
            }
        }
        if (polled) {
            for (int i = 0; i < n; i++) {
                items[i].events = ZMQ_POLLIN;
                items[i].revents = 0;
            }
            rc = p_poll(items, n, w);
            atomic_store_explicit(&r->sleeping, 0, memory_order_relaxed);
            clock_gettime(CLOCK_MONOTONIC, &last_poll);
            if (rc < 0) {
                if (p_errno() != EINTR) {
                    err = p_errno();
                    break;
                }
                continue;
            }
            if (items[0].revents & ZMQ_POLLIN) {
                uint64_t v;
                ssize_t got = read(r->efd, &v, sizeof v);
                (void)got;
            }
            if (items[1].revents & ZMQ_POLLIN) flags |= PUMP_XPUB;
            for (int i = 2; i < n; i++)
                if (items[i].revents & ZMQ_POLLIN) flags |= PUMP_WATCH;
        }
        if (atomic_load_explicit(&r->kick, memory_order_relaxed) &&
                atomic_exchange(&r->kick, 0))
            flags |= PUMP_WATCH;
        long fwd_before = forwarded, drop_before = dropped;
        /* the producer's position is read once per round, the room given back every
         * 64 records: neither line crosses cores per record */
        uint64_t end = atomic_load_explicit(&r->head, memory_order_acquire);
        for (Py_ssize_t k = 0; k < batch && r->consumed < end; k++) {
            int d = 0;
            int fr = ring_forward(r, xpub, &d, &err);
            if ((k & 63) == 63 || fr < 0) ring_release(r);
            if (fr < 0) goto out;
            forwarded++;
            dropped += d;
            if (r->consumed == end && k + 1 < batch)
                end = atomic_load_explicit(&r->head, memory_order_acquire);
        }
        ring_release(r);
        if (forwarded != fwd_before) {
            /* counted here (ring_counts); and the idle timeout starts again */
            atomic_fetch_add_explicit(&r->fwd_total, (uint64_t)(forwarded - fwd_before),
                                      memory_order_relaxed);
            if (dropped != drop_before)
                atomic_fetch_add_explicit(&r->drop_total, (uint64_t)(dropped - drop_before),
                                          memory_order_relaxed);
            clock_gettime(CLOCK_MONOTONIC, &t0);
            wait = timeout;
        }
        if (atomic_load(&r->stop) && !ring_avail(r)) {   /* stop first: see ring_stop */
            flags |= PUMP_STOP;
            break;
        }
        if (flags) break;
        if ((polled && rc == 0 && w == wait && wait >= 0) ||
                (timeout >= 0 && elapsed_ms(&t0) >= timeout)) {
            flags |= PUMP_TIMEOUT;
            break;
        }
        if (timeout >= 0) {
            wait = timeout - elapsed_ms(&t0);
            if (wait < 0) wait = 0;
        }
    }
out:
    Py_END_ALLOW_THREADS
    if (err) return zmq_error(err);
    return Py_BuildValue("(lli)", forwarded, dropped, flags);
}

#define INGEST_PASS_DOC \
    "ingest_pass(in, pub, limit, max_bytes, max_event, good_streams, good_topics, device, " \
    "seq, now8, spool_seq, router, replies, accepted[, compress]) -> (consumed, total, seq, " \
    "nfast, nbytes, maxb, spool, last_meta, stop, extra, ncompressed, compressed_bytes)"

static PyMethodDef methods[] = {
    {"init", fast_init, METH_VARARGS, "init(libzmq_path): bind to the loaded libzmq"},
    {"init_lz4", fast_init_lz4, METH_VARARGS,
     "init_lz4(path): bind to the liblz4 of the loaded python-lz4 extension (-x lz4 in "
     "ingest_pass)"},
    {"drain", fast_drain, METH_VARARGS,
     "drain(handle, limit) -> list of whole messages (lists of bytes), without blocking"},
    {"drain_bytes", fast_drain_bytes, METH_VARARGS,
     "drain_bytes(handle, limit, max_bytes) -> (messages, total bytes, largest frame)"},
    {"publish", fast_publish, METH_VARARGS,
     "publish(handle, records, start) -> (index, errno) of the first record not sent"},
    {"ingest_pass", ingest_pass, METH_VARARGS, INGEST_PASS_DOC},
    {"ring", fast_ring, METH_VARARGS,
     "ring(max_records) -> the hand-over queue of an XPUB's thread (0: no bound); publish "
     "and ingest_pass take it in place of a socket handle"},
    {"ring_pump", fast_ring_pump, METH_VARARGS,
     "ring_pump(ring, xpub, watch, timeout_ms, batch) -> (forwarded, dropped, flags): pump "
     "with the ring as its source"},
    {"ring_stop", fast_ring_stop, METH_VARARGS,
     "ring_stop(ring): ring_pump returns PUMP_STOP once what is queued is forwarded"},
    {"ring_close", fast_ring_close, METH_VARARGS,
     "ring_close(ring): free what is queued (only once no thread pumps it)"},
    {"ring_queued", fast_ring_info, METH_VARARGS, "ring_queued(ring) -> records queued"},
    {"ring_kick", fast_ring_kick, METH_VARARGS,
     "ring_kick(ring): ring_pump returns PUMP_WATCH soon (any thread)"},
    {"ring_counts", fast_ring_counts, METH_VARARGS,
     "ring_counts(ring) -> (forwarded, dropped): the consumer's counts so far"},
    {"pump", fast_pump, METH_VARARGS,
     "pump(src, xpub, watch, timeout_ms, batch) -> (forwarded, dropped, flags): the XPUB "
     "thread's forwarding loop, without the GIL"},
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
