/* The group commit's fdatasync thread (spool/syncthread.py): a POSIX thread that never
 * takes the GIL.  The event loop hands it one job at a time (submit: one descriptor to
 * fdatasync; submit_many: up to MAX_ITEMS descriptors to fdatasync, then some to fsync --
 * a round after a segment roll: the closed segment's records, the new segment's, the
 * directory that names it), the thread runs the syncs in order (the first error ends the
 * job), keeps the errno and writes to the loop's notify descriptor (an eventfd the loop
 * waits on); the loop takes the result (result).
 *
 * Why not a worker thread of trio's: its completion has to take the GIL (to run Python
 * code that reports back through run_sync_soon), and on a busy relay the GIL is held by
 * the ingest; the round's 202s then wait for the switch.  Here the hand-back is one
 * write() to an eventfd, without the GIL.
 *
 * One job at a time: submit raises RuntimeError while one is in flight (the caller falls
 * back to a worker thread).  The descriptor stays the caller's: it must not be closed
 * before result() returned the job's errno.  All signals are blocked in the thread (they
 * are the main thread's).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_ITEMS 16

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    int started;        /* the thread runs (join it at close) */
    int stop;
    int waiting;        /* a job was handed over and the thread has not taken it yet */
    int nitems;         /* the job: items[0..nitems) synced in order */
    int ndata;          /* items[0..ndata) get fdatasync, the rest fsync */
    int items[MAX_ITEMS];
    int failed;         /* index of the item that failed (-1: none) */
    int busy;           /* a job was submitted and its result not yet taken */
    int done;           /* its result is there */
    int err;            /* its errno (0: synced) */
    double seconds;     /* how long its fdatasync took */
    int notify_fd;      /* written once per finished job (8 bytes: eventfd's counter) */
    unsigned long long jobs;
} Syncer;

static void *
worker(void *arg)
{
    Syncer *s = (Syncer *)arg;
#ifdef __linux__
    pthread_setname_np(pthread_self(), "spool-fdatasync");   /* top -H, /proc/.../comm */
#endif
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->stop && !s->waiting)
            pthread_cond_wait(&s->cv, &s->mu);
        if (!s->waiting)
            break;                      /* stopping, nothing left */
        int items[MAX_ITEMS];
        int n = s->nitems, ndata = s->ndata;
        memcpy(items, s->items, sizeof items);
        s->waiting = 0;
        pthread_mutex_unlock(&s->mu);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int err = 0, failed = -1;
        for (int i = 0; i < n; i++) {
            int rc = i < ndata ? fdatasync(items[i]) : fsync(items[i]);
            if (rc != 0) {
                err = errno;
                failed = i;
                break;
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &t1);
        pthread_mutex_lock(&s->mu);
        s->err = err;
        s->failed = failed;
        s->seconds = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        s->done = 1;
        s->jobs++;
        int nfd = s->notify_fd;
        pthread_mutex_unlock(&s->mu);
        uint64_t one = 1;
        /* EAGAIN: the counter is full of unread wake-ups, the loop will look anyway */
        while (write(nfd, &one, sizeof one) < 0 && errno == EINTR) {
        }
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

static int
Syncer_init(Syncer *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"notify_fd", NULL};
    int nfd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &nfd))
        return -1;
    if (self->started) {
        PyErr_SetString(PyExc_RuntimeError, "already started");
        return -1;
    }
    if (nfd < 0) {
        PyErr_SetString(PyExc_ValueError, "notify_fd must be a descriptor");
        return -1;
    }
    self->notify_fd = nfd;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);      /* inherited by the thread */
    int rc = pthread_create(&self->thread, NULL, worker, self);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->started = 1;
    return 0;
}

static PyObject *
Syncer_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Syncer *self = (Syncer *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv, NULL);
    self->notify_fd = -1;
    return (PyObject *)self;
}

static int
as_fd(PyObject *o, int *out)
{
    long fd = PyLong_AsLong(o);
    if (fd == -1 && PyErr_Occurred())
        return -1;
    if (fd < 0 || fd > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "fd must be a descriptor");
        return -1;
    }
    *out = (int)fd;
    return 0;
}

/* hand the job (n items, the first ndata to fdatasync) to the thread */
static PyObject *
start_job(Syncer *self, const int *items, int n, int ndata)
{
    pthread_mutex_lock(&self->mu);
    if (!self->started || self->stop || self->busy) {
        const char *why = self->busy ? "a sync is in flight" : "the sync thread is stopped";
        pthread_mutex_unlock(&self->mu);
        PyErr_SetString(PyExc_RuntimeError, why);
        return NULL;
    }
    self->busy = 1;
    self->done = 0;
    memcpy(self->items, items, (size_t)n * sizeof *items);
    self->nitems = n;
    self->ndata = ndata;
    self->waiting = 1;
    pthread_mutex_unlock(&self->mu);
    /* after the unlock: the woken thread does not block on the mutex still held here */
    pthread_cond_signal(&self->cv);
    Py_RETURN_NONE;
}

static PyObject *
Syncer_submit(Syncer *self, PyObject *arg)
{
    int fd;
    if (as_fd(arg, &fd) < 0)
        return NULL;
    return start_job(self, &fd, 1, 1);
}

/* submit_many(datasync_fds, fsync_fds): fdatasync each of the first, then fsync each of
 * the second (a directory), in order, as one job */
static PyObject *
Syncer_submit_many(Syncer *self, PyObject *args)
{
    PyObject *data, *full;
    if (!PyArg_ParseTuple(args, "OO", &data, &full))
        return NULL;
    PyObject *seqs[2] = {
        PySequence_Fast(data, "datasync_fds must be a sequence"), NULL};
    if (seqs[0] == NULL)
        return NULL;
    seqs[1] = PySequence_Fast(full, "fsync_fds must be a sequence");
    if (seqs[1] == NULL) {
        Py_DECREF(seqs[0]);
        return NULL;
    }
    int items[MAX_ITEMS];
    int n = 0, ndata = 0;
    PyObject *res = NULL;
    for (int k = 0; k < 2; k++) {
        Py_ssize_t len = PySequence_Fast_GET_SIZE(seqs[k]);
        if (n + len > MAX_ITEMS) {
            PyErr_Format(PyExc_ValueError, "at most %d descriptors in one job", MAX_ITEMS);
            goto out;
        }
        for (Py_ssize_t i = 0; i < len; i++) {
            if (as_fd(PySequence_Fast_GET_ITEM(seqs[k], i), &items[n]) < 0)
                goto out;
            n++;
        }
        if (k == 0)
            ndata = n;
    }
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "no descriptor to sync");
        goto out;
    }
    res = start_job(self, items, n, ndata);
out:
    Py_DECREF(seqs[0]);
    Py_DECREF(seqs[1]);
    return res;
}

/* None while the job runs; else (errno, seconds, index): its errno (0: synced), how long
 * its syncs took together, the index of the descriptor that failed (-1: none; in the
 * order of submit_many's two sequences); the thread is free again */
static PyObject *
Syncer_result(Syncer *self, PyObject *unused)
{
    pthread_mutex_lock(&self->mu);
    if (!self->busy || !self->done) {
        int idle = !self->busy;
        pthread_mutex_unlock(&self->mu);
        if (idle) {
            PyErr_SetString(PyExc_RuntimeError, "no sync was submitted");
            return NULL;
        }
        Py_RETURN_NONE;
    }
    int err = self->err, failed = self->failed;
    double seconds = self->seconds;
    self->busy = 0;
    self->done = 0;
    pthread_mutex_unlock(&self->mu);
    return Py_BuildValue("(idi)", err, seconds, failed);
}

static void
stop_thread(Syncer *self)
{
    pthread_mutex_lock(&self->mu);
    int started = self->started;
    self->stop = 1;
    self->started = 0;
    pthread_cond_signal(&self->cv);
    pthread_mutex_unlock(&self->mu);
    if (started)
        pthread_join(self->thread, NULL);   /* finishes a job in flight first */
}

static PyObject *
Syncer_close(Syncer *self, PyObject *unused)
{
    Py_BEGIN_ALLOW_THREADS
    stop_thread(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *
Syncer_get_busy(Syncer *self, void *closure)
{
    pthread_mutex_lock(&self->mu);
    int busy = self->busy;
    pthread_mutex_unlock(&self->mu);
    return PyBool_FromLong(busy);
}

static PyObject *
Syncer_get_done(Syncer *self, void *closure)
{
    pthread_mutex_lock(&self->mu);
    int done = self->busy && self->done;
    pthread_mutex_unlock(&self->mu);
    return PyBool_FromLong(done);
}

static PyObject *
Syncer_get_jobs(Syncer *self, void *closure)
{
    pthread_mutex_lock(&self->mu);
    unsigned long long jobs = self->jobs;
    pthread_mutex_unlock(&self->mu);
    return PyLong_FromUnsignedLongLong(jobs);
}

static void
Syncer_dealloc(Syncer *self)
{
    stop_thread(self);
    pthread_cond_destroy(&self->cv);
    pthread_mutex_destroy(&self->mu);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Syncer_methods[] = {
    {"submit", (PyCFunction)Syncer_submit, METH_O,
     "submit(fd): fdatasync(fd) in the thread; the fd must stay open until result()"},
    {"submit_many", (PyCFunction)Syncer_submit_many, METH_VARARGS,
     "submit_many(datasync_fds, fsync_fds): fdatasync each of the first, then fsync each "
     "of the second, in order, as one job (at most 16); they stay open until result()"},
    {"result", (PyCFunction)Syncer_result, METH_NOARGS,
     "None while the job runs, else (errno, seconds, index): 0 = synced, the syncs' time, "
     "the descriptor that failed (-1: none)"},
    {"close", (PyCFunction)Syncer_close, METH_NOARGS,
     "end the thread (after the job in flight)"},
    {NULL}
};

static PyGetSetDef Syncer_getset[] = {
    {"busy", (getter)Syncer_get_busy, NULL, "a job was submitted, its result not taken", NULL},
    {"done", (getter)Syncer_get_done, NULL, "the job's result is there, not yet taken", NULL},
    {"jobs", (getter)Syncer_get_jobs, NULL, "jobs finished", NULL},
    {NULL}
};

static PyTypeObject SyncerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "logjam_relay.spool._syncthread.Syncer",
    .tp_basicsize = sizeof(Syncer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "fdatasync in a thread that never takes the GIL; done -> write to notify_fd",
    .tp_new = Syncer_new,
    .tp_init = (initproc)Syncer_init,
    .tp_dealloc = (destructor)Syncer_dealloc,
    .tp_methods = Syncer_methods,
    .tp_getset = Syncer_getset,
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "_syncthread",
    "The group commit's fdatasync thread (see spool/syncthread.py).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__syncthread(void)
{
    if (PyType_Ready(&SyncerType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SyncerType);
    if (PyModule_AddObject(m, "Syncer", (PyObject *)&SyncerType) < 0) {
        Py_DECREF(&SyncerType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
