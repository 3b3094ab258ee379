/* The Courier output's event mapping in C, for the common case.
 *
 * event(frames, prefix, decompress) -> bytes | None
 *
 * For a logjam message with an acceptable meta frame (24 bytes, tag CABD or BDCA,
 * version 1), a body that is plain or that ``decompress(body, comp)`` decodes, valid
 * UTF-8 and valid JSON (RFC 8259, as Python's json with NaN/Infinity rejected), and a
 * creation time up to year 9999, it returns exactly what courier.record_to_event_py
 * returns.  In every other case it returns None and the caller uses the Python mapping,
 * which tags the event; so both paths give the same bytes for every record.
 * ``prefix`` is the cached ``,"app":..,"env":..,"topic":..,"host":..,`` part.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define isdigit(c) ((c) >= '0' && (c) <= '9')
#define isxdigit(c) (isdigit(c) || ((c) >= 'a' && (c) <= 'f') || ((c) >= 'A' && (c) <= 'F'))

#define MAX_DEPTH 500      /* deeper documents are left to Python (it decides by its recursion limit) */

typedef struct { const unsigned char *p, *end; int depth; int unsure; } js_t;

static int utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        size_t need;
        unsigned char lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) need = 1;
        else if (c == 0xE0) { need = 2; lo = 0xA0; }
        else if (c >= 0xE1 && c <= 0xEC) need = 2;
        else if (c == 0xED) { need = 2; hi = 0x9F; }
        else if (c >= 0xEE && c <= 0xEF) need = 2;
        else if (c == 0xF0) { need = 3; lo = 0x90; }
        else if (c >= 0xF1 && c <= 0xF3) need = 3;
        else if (c == 0xF4) { need = 3; hi = 0x8F; }
        else return 0;
        if (n - i <= need) return 0;
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (size_t k = 2; k <= need; k++)
            if (s[i + k] < 0x80 || s[i + k] > 0xBF) return 0;
        i += need + 1;
    }
    return 1;
}

static inline void ws(js_t *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int value(js_t *j);

static int string(js_t *j) {          /* at '"' */
    j->p++;
    while (j->p < j->end) {
        unsigned char c = *j->p++;
        if (c == '"') return 1;
        if (c < 0x20) return 0;
        if (c == '\\') {
            if (j->p >= j->end) return 0;
            c = *j->p++;
            if (c == 'u') {
                for (int k = 0; k < 4; k++, j->p++)
                    if (j->p >= j->end || !isxdigit(*j->p)) return 0;
            } else if (!strchr("\"\\/bfnrt", c) || c == 0) {
                return 0;
            }
        }
    }
    return 0;
}

static int number(js_t *j) {
    if (j->p < j->end && *j->p == '-') j->p++;
    if (j->p >= j->end) return 0;
    if (*j->p == '0') j->p++;
    else if (*j->p >= '1' && *j->p <= '9') { while (j->p < j->end && isdigit(*j->p)) j->p++; }
    else return 0;
    if (j->p < j->end && *j->p == '.') {
        j->p++;
        if (j->p >= j->end || !isdigit(*j->p)) return 0;
        while (j->p < j->end && isdigit(*j->p)) j->p++;
    }
    if (j->p < j->end && (*j->p == 'e' || *j->p == 'E')) {
        const unsigned char *save = j->p;
        j->p++;
        if (j->p < j->end && (*j->p == '+' || *j->p == '-')) j->p++;
        if (j->p >= j->end || !isdigit(*j->p)) { j->p = save; return 1; }  /* "1e" = 1 then junk */
        while (j->p < j->end && isdigit(*j->p)) j->p++;
    }
    return 1;
}

static int literal(js_t *j, const char *w) {
    size_t n = strlen(w);
    if ((size_t)(j->end - j->p) < n || memcmp(j->p, w, n) != 0) return 0;
    j->p += n;
    return 1;
}

static int value(js_t *j) {
    if (j->p >= j->end) return 0;
    unsigned char c = *j->p;
    if (c == '{' || c == '[') {
        if (++j->depth > MAX_DEPTH) { j->unsure = 1; return 0; }
        unsigned char close = c == '{' ? '}' : ']';
        j->p++;
        ws(j);
        if (j->p < j->end && *j->p == close) { j->p++; j->depth--; return 1; }
        for (;;) {
            if (c == '{') {
                if (j->p >= j->end || *j->p != '"' || !string(j)) return 0;
                ws(j);
                if (j->p >= j->end || *j->p != ':') return 0;
                j->p++;
                ws(j);
            }
            if (!value(j)) return 0;
            ws(j);
            if (j->p >= j->end) return 0;
            if (*j->p == close) { j->p++; j->depth--; return 1; }
            if (*j->p != ',') return 0;
            j->p++;
            ws(j);
        }
    }
    if (c == '"') return string(j);
    if (c == '-' || isdigit(c)) return number(j);
    return literal(j, "true") || literal(j, "false") || literal(j, "null");
}

/* 1 valid, 0 invalid, -1 unsure (too deep: let Python decide) */
static int json_valid(const unsigned char *s, size_t n) {
    if (!utf8_valid(s, n)) return 0;
    js_t j = {s, s + n, 0, 0};
    ws(&j);
    int ok = value(&j);
    if (j.unsure) return -1;
    if (!ok) return 0;
    ws(&j);
    return j.p == j.end;
}

static inline uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v = (v << 8) | p[i];
    return v;
}

static PyObject *event(PyObject *self, PyObject *args) {
    PyObject *frames, *prefix, *decompress;
    if (!PyArg_ParseTuple(args, "OSO", &frames, &prefix, &decompress)) return NULL;
    if (!PyList_Check(frames) && !PyTuple_Check(frames)) Py_RETURN_NONE;
    if (PySequence_Fast_GET_SIZE(frames) < 4) Py_RETURN_NONE;
    PyObject **fr = PySequence_Fast_ITEMS(frames);
    if (!PyBytes_CheckExact(fr[2]) || !PyBytes_CheckExact(fr[3]) || PyBytes_GET_SIZE(fr[3]) != 24)
        Py_RETURN_NONE;
    const unsigned char *m = (const unsigned char *)PyBytes_AS_STRING(fr[3]);
    if (!((m[0] == 0xCA && m[1] == 0xBD) || (m[0] == 0xBD && m[1] == 0xCA)) || m[3] != 1)
        Py_RETURN_NONE;
    uint64_t created = be(m + 8, 8);
    if (created / 1000 > 253402300799ULL) Py_RETURN_NONE;       /* past year 9999 */
    PyObject *raw;
    if (m[2] == 0) {
        raw = fr[2];
        Py_INCREF(raw);
    } else {
        raw = PyObject_CallFunction(decompress, "Oi", fr[2], (int)m[2]);
        if (!raw) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
            PyErr_Clear();
            Py_RETURN_NONE;
        }
        if (!PyBytes_Check(raw)) { Py_DECREF(raw); Py_RETURN_NONE; }
    }
    const unsigned char *b = (const unsigned char *)PyBytes_AS_STRING(raw);
    size_t blen = (size_t)PyBytes_GET_SIZE(raw);
    if (json_valid(b, blen) != 1) { Py_DECREF(raw); Py_RETURN_NONE; }
    time_t secs = (time_t)(created / 1000);
    struct tm tm;
    if (!gmtime_r(&secs, &tm)) { Py_DECREF(raw); Py_RETURN_NONE; }
    char head[256];
    int hl = snprintf(head, sizeof head, "{\"@timestamp\":\"%04d-%02d-%02dT%02d:%02d:%02d.%03dZ\"",
                      tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                      tm.tm_sec, (int)(created % 1000));
    char tail[160];
    int tl = snprintf(tail, sizeof tail,
                      "\"logjam\":{\"device\":%llu,\"sequence\":%llu,\"created_ms\":%llu},\"payload\":",
                      (unsigned long long)be(m + 4, 4), (unsigned long long)be(m + 16, 8),
                      (unsigned long long)created);
    Py_ssize_t plen = PyBytes_GET_SIZE(prefix);
    PyObject *out = PyBytes_FromStringAndSize(NULL, hl + plen + tl + (Py_ssize_t)blen + 1);
    if (!out) { Py_DECREF(raw); return NULL; }
    char *o = PyBytes_AS_STRING(out);
    memcpy(o, head, (size_t)hl); o += hl;
    memcpy(o, PyBytes_AS_STRING(prefix), (size_t)plen); o += plen;
    memcpy(o, tail, (size_t)tl); o += tl;
    memcpy(o, b, blen); o += blen;
    *o = '}';
    Py_DECREF(raw);
    return out;
}

static PyObject *is_json(PyObject *self, PyObject *args) {
    Py_buffer v;
    if (!PyArg_ParseTuple(args, "y*", &v)) return NULL;
    int r = json_valid(v.buf, (size_t)v.len);
    PyBuffer_Release(&v);
    if (r < 0) Py_RETURN_NONE;
    return PyBool_FromLong(r);
}

static PyMethodDef methods[] = {
    {"event", event, METH_VARARGS, "event(frames, prefix, decompress) -> bytes or None"},
    {"is_json", is_json, METH_VARARGS, "is_json(bytes) -> True, False, or None (too deep to say)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_courierenc", "Courier event mapping in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__courierenc(void) { return PyModule_Create(&module); }
