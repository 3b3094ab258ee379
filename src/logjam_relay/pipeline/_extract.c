/* The request fields of logjam `logs` bodies, extracted in C straight into Arrow buffers
 * (the C twin of logjam_relay.pipeline.extract.extract_py; tests/test_pipeline_extract.py
 * compares them).
 *
 * extract(data, offsets, rows) -> (started, total_time, code, severity, flags,
 *                                  action_offsets, action_data,
 *                                  exc_list_offsets, exc_offsets, exc_data)
 *   data     the batch's body string buffer; offsets int32[n+1]; rows uint8[n] (1: extract)
 *   started  int64[n], total_time float64[n], code/severity int32[n]
 *   flags    uint8[n]: 1 started, 2 total_time, 4 code, 8 severity, 16 action,
 *            32 exceptions valid; 64 bad_json; 128 = not decided here (escapes in a string
 *            it returns, a key with escapes, started_at in another ISO form, numbers out of
 *            range, NaN/Infinity, very deep nesting): the caller uses the Python path
 *   action_*  string column (offsets int32[n+1] into action_data)
 *   exc_*     list<string> column (list offsets int32[n+1] into the strings, string
 *             offsets int32[m+1] into exc_data)
 * Semantics are json.loads': whitespace " \t\n\r", strict strings (no control characters),
 * duplicate keys keep the last, true/false are not numbers.  The input is valid UTF-8.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define F_STARTED 1
#define F_TT 2
#define F_CODE 4
#define F_SEV 8
#define F_ACTION 16
#define F_EXC 32
#define F_BAD 64
#define F_FALLBACK 128
#define MAX_DEPTH 500

typedef struct { char *p; Py_ssize_t len, cap; } buf_t;

static int buf_put(buf_t *b, const void *src, Py_ssize_t n) {
    if (b->len + n > b->cap) {
        Py_ssize_t nc = b->cap ? b->cap * 2 : 65536;
        while (nc < b->len + n) nc *= 2;
        char *np_ = PyMem_RawRealloc(b->p, (size_t)nc);
        if (!np_) return -1;
        b->p = np_;
        b->cap = nc;
    }
    memcpy(b->p + b->len, src, (size_t)n);
    b->len += n;
    return 0;
}

typedef struct {
    const unsigned char *p, *end;
    int fallback, depth;
} pst;

enum { T_BAD = 0, T_OTHER, T_STR, T_INT, T_FLOAT };

typedef struct {
    int type;
    const unsigned char *s; Py_ssize_t slen; int esc;   /* T_STR */
    int64_t i; int overflow;                            /* T_INT */
    double d;                                           /* T_INT / T_FLOAT */
} val_t;

static inline void ws(pst *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
        s->p++;
}

static int hexd(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

/* a string at s->p == '"'; returns 0 when invalid */
static int str(pst *s, val_t *v) {
    const unsigned char *p = s->p + 1, *e = s->end;
    int esc = 0;
    while (p < e) {
        unsigned char c = *p;
        if (c == '"') {
            v->type = T_STR;
            v->s = s->p + 1;
            v->slen = p - (s->p + 1);
            v->esc = esc;
            s->p = p + 1;
            return 1;
        }
        if (c < 0x20) return 0;
        if (c == '\\') {
            esc = 1;
            if (p + 1 >= e) return 0;
            c = p[1];
            if (c == 'u') {
                if (p + 6 > e || !hexd(p[2]) || !hexd(p[3]) || !hexd(p[4]) || !hexd(p[5]))
                    return 0;
                p += 6;
                continue;
            }
            if (!strchr("\"\\/bfnrt", c) || c == 0) return 0;
            p += 2;
            continue;
        }
        p++;
    }
    return 0;
}

static int num(pst *s, val_t *v) {
    const unsigned char *p = s->p, *e = s->end, *start = p;
    int neg = 0, isfloat = 0;
    if (p < e && *p == '-') { neg = 1; p++; }
    if (p >= e) return 0;
    if (*p == 'I') { s->fallback = 1; return 0; }          /* -Infinity */
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9') { while (p < e && *p >= '0' && *p <= '9') p++; }
    else return 0;
    const unsigned char *int_end = p;
    if (p < e && *p == '.') {
        const unsigned char *q = p + 1;
        while (q < e && *q >= '0' && *q <= '9') q++;
        if (q == p + 1) goto end_number;                    /* "1." : the int, then junk */
        isfloat = 1;
        p = q;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        const unsigned char *q = p + 1;
        if (q < e && (*q == '+' || *q == '-')) q++;
        const unsigned char *d0 = q;
        while (q < e && *q >= '0' && *q <= '9') q++;
        if (q > d0) { isfloat = 1; p = q; }
    }
end_number:
    if (!isfloat) p = int_end;
    {
        char tmp[64];
        Py_ssize_t n = p - start;
        if (isfloat) {
            if (n >= (Py_ssize_t)sizeof(tmp)) { s->fallback = 1; v->type = T_OTHER; s->p = p; return 1; }
            memcpy(tmp, start, (size_t)n);
            tmp[n] = 0;
            v->type = T_FLOAT;
            v->d = strtod(tmp, NULL);
        } else {
            uint64_t acc = 0;
            int of = 0;
            for (const unsigned char *q = start + neg; q < p; q++) {
                unsigned dgt = (unsigned)(*q - '0');
                if (acc > (UINT64_MAX - dgt) / 10) { of = 1; break; }
                acc = acc * 10 + dgt;
            }
            if (!of && (neg ? acc > (uint64_t)INT64_MAX + 1 : acc > (uint64_t)INT64_MAX)) of = 1;
            v->type = T_INT;
            v->overflow = of;
            v->i = of ? 0 : (neg ? (int64_t)(0 - acc) : (int64_t)acc);
            v->d = (double)v->i;
        }
    }
    s->p = p;
    return 1;
}

static int value(pst *s, val_t *v);

static int lit(pst *s, const char *w, Py_ssize_t n) {
    if (s->end - s->p < n || memcmp(s->p, w, (size_t)n) != 0) return 0;
    s->p += n;
    return 1;
}

/* skip any value (validating it); v receives its type and scalar contents */
static int value(pst *s, val_t *v) {
    v->type = T_OTHER;
    if (s->p >= s->end) return 0;
    unsigned char c = *s->p;
    if (c == '"') return str(s, v);
    if (c == '-' || (c >= '0' && c <= '9')) return num(s, v);
    if (c == 't') return lit(s, "true", 4);
    if (c == 'f') return lit(s, "false", 5);
    if (c == 'n') return lit(s, "null", 4);
    if (c == 'N' || c == 'I') { s->fallback = 1; return 0; }     /* NaN, Infinity */
    if (c == '[' || c == '{') {
        if (++s->depth > MAX_DEPTH) { s->fallback = 1; return 0; }
        int obj = c == '{';
        s->p++;
        ws(s);
        if (s->p < s->end && *s->p == (obj ? '}' : ']')) { s->p++; s->depth--; return 1; }
        for (;;) {
            val_t k;
            if (obj) {
                if (s->p >= s->end || *s->p != '"' || !str(s, &k)) return 0;
                ws(s);
                if (s->p >= s->end || *s->p != ':') return 0;
                s->p++;
                ws(s);
            }
            if (!value(s, &k)) return 0;
            ws(s);
            if (s->p >= s->end) return 0;
            if (*s->p == ',') { s->p++; ws(s); continue; }
            if (*s->p == (obj ? '}' : ']')) { s->p++; s->depth--; return 1; }
            return 0;
        }
    }
    return 0;
}

static int days_in_month(int y, int m) {
    static const int d[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (m == 2 && ((y % 4 == 0 && y % 100 != 0) || y % 400 == 0)) return 29;
    return d[m - 1];
}

static int64_t days_from_civil(int64_t y, int m, int d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    int64_t yoe = y - era * 400;
    int64_t doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + doe - 719468;
}

static int dig(const unsigned char *p, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (p[i] < '0' || p[i] > '9') return 0;
        v = v * 10 + (p[i] - '0');
    }
    *out = v;
    return 1;
}

/* YYYY-MM-DD[T ]HH:MM:SS[.f{1,3}][Z|+HH:MM|-HH:MM] -> epoch ms; 0 = another form */
static int iso_ms(const unsigned char *p, Py_ssize_t n, int64_t *out) {
    int y, mo, d, h, mi, se, frac = 0, oh = 0, om = 0, sign = 0;
    if (n < 19 || p[4] != '-' || p[7] != '-' || (p[10] != 'T' && p[10] != ' ') ||
        p[13] != ':' || p[16] != ':')
        return 0;
    if (!dig(p, 4, &y) || !dig(p + 5, 2, &mo) || !dig(p + 8, 2, &d) || !dig(p + 11, 2, &h) ||
        !dig(p + 14, 2, &mi) || !dig(p + 17, 2, &se))
        return 0;
    if (y < 1 || mo < 1 || mo > 12 || d < 1 || d > days_in_month(y, mo) || h > 23 ||
        mi > 59 || se > 59)
        return 0;
    Py_ssize_t i = 19;
    if (i < n && p[i] == '.') {
        int k = 0;
        i++;
        while (i < n && p[i] >= '0' && p[i] <= '9' && k < 4) { frac = frac * 10 + (p[i] - '0'); i++; k++; }
        if (k == 0 || k > 3) return 0;
        while (k < 3) { frac *= 10; k++; }
    }
    if (i < n) {
        if (p[i] == 'Z' && i + 1 == n) { i++; }
        else if ((p[i] == '+' || p[i] == '-') && i + 6 == n && p[i + 3] == ':') {
            sign = p[i] == '-' ? -1 : 1;
            if (!dig(p + i + 1, 2, &oh) || !dig(p + i + 4, 2, &om) || oh > 23 || om > 59)
                return 0;
            i = n;
        } else return 0;
    }
    int64_t secs = days_from_civil(y, mo, d) * 86400 + h * 3600 + mi * 60 + se
                   - sign * (oh * 3600 + om * 60);
    *out = secs * 1000 + frac;
    return 1;
}

static int key_is(const val_t *k, const char *name) {
    size_t n = strlen(name);
    return (size_t)k->slen == n && memcmp(k->s, name, n) == 0;
}

static PyObject *extract(PyObject *self, PyObject *args) {
    Py_buffer vd, vo, vr;
    if (!PyArg_ParseTuple(args, "y*y*y*", &vd, &vo, &vr)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = vr.len;
    const unsigned char *data = vd.buf, *rows = vr.buf;
    const int32_t *offs = vo.buf;
    if (vo.len < (n + 1) * 4) {
        PyErr_SetString(PyExc_ValueError, "offsets too short");
        goto out0;
    }
    PyObject *o_started = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *o_tt = PyBytes_FromStringAndSize(NULL, n * 8);
    PyObject *o_code = PyBytes_FromStringAndSize(NULL, n * 4);
    PyObject *o_sev = PyBytes_FromStringAndSize(NULL, n * 4);
    PyObject *o_flags = PyBytes_FromStringAndSize(NULL, n);
    PyObject *o_aoff = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
    PyObject *o_loff = PyBytes_FromStringAndSize(NULL, (n + 1) * 4);
    buf_t adata = {0}, edata = {0}, eoffs = {0};
    int ok = o_started && o_tt && o_code && o_sev && o_flags && o_aoff && o_loff;
    if (ok) {
        int64_t *started = (int64_t *)PyBytes_AS_STRING(o_started);
        double *tt = (double *)PyBytes_AS_STRING(o_tt);
        int32_t *code = (int32_t *)PyBytes_AS_STRING(o_code);
        int32_t *sev = (int32_t *)PyBytes_AS_STRING(o_sev);
        uint8_t *flags = (uint8_t *)PyBytes_AS_STRING(o_flags);
        int32_t *aoff = (int32_t *)PyBytes_AS_STRING(o_aoff);
        int32_t *loff = (int32_t *)PyBytes_AS_STRING(o_loff);
        int32_t nexc = 0, zero = 0;
        int nomem = 0;
        Py_BEGIN_ALLOW_THREADS
        if (buf_put(&eoffs, &zero, 4) < 0) nomem = 1;
        aoff[0] = 0;
        loff[0] = 0;
        for (Py_ssize_t r = 0; r < n && !nomem; r++) {
            started[r] = 0; tt[r] = 0; code[r] = 0; sev[r] = 0;
            uint8_t f = 0;
            Py_ssize_t excs_mark = edata.len, eoffs_mark = eoffs.len;
            int32_t nexc_mark = nexc;
            if (rows[r]) {
                pst s = {data + offs[r], data + offs[r + 1], 0, 0};
                val_t action = {0}, sms = {0}, sat = {0}, vtt = {0}, vcode = {0}, vsev = {0};
                int has_exc = 0, bad = 0;
                int32_t exc_n = 0;
                if (s.end - s.p >= 1 && (s.p[0] == 0xEF || s.p[0] == 0 ||
                        (s.end - s.p >= 2 && s.p[1] == 0) || (s.end - s.p >= 3 && s.p[2] == 0) ||
                        (s.end - s.p >= 4 && s.p[3] == 0)))
                    s.fallback = 1;          /* BOM or NULs: json.loads guesses an encoding */
                ws(&s);
                if (s.fallback) {
                    bad = 0;
                } else if (s.p >= s.end || *s.p != '{') {
                    val_t v;
                    bad = 1;
                    if (value(&s, &v)) { ws(&s); }     /* a valid non-object: still bad */
                    if (s.fallback) bad = 0;
                } else {
                    s.p++;
                    s.depth = 1;
                    ws(&s);
                    int closed = 0;
                    if (s.p < s.end && *s.p == '}') { s.p++; closed = 1; }
                    while (!closed) {
                        val_t k, v;
                        if (s.p >= s.end || *s.p != '"' || !str(&s, &k)) { bad = 1; break; }
                        if (k.esc) s.fallback = 1;
                        ws(&s);
                        if (s.p >= s.end || *s.p != ':') { bad = 1; break; }
                        s.p++;
                        ws(&s);
                        int is_exc = key_is(&k, "exceptions");
                        if (is_exc && s.p < s.end && *s.p == '[') {
                            /* the list: keep its strings (the last "exceptions" wins) */
                            edata.len = excs_mark; eoffs.len = eoffs_mark; nexc = nexc_mark;
                            exc_n = 0;
                            has_exc = 1;
                            s.p++;
                            if (++s.depth > MAX_DEPTH) { s.fallback = 1; bad = 1; break; }
                            ws(&s);
                            int done = 0;
                            if (s.p < s.end && *s.p == ']') { s.p++; done = 1; s.depth--; }
                            while (!done) {
                                val_t e;
                                if (!value(&s, &e)) { bad = 1; break; }
                                if (e.type == T_STR) {
                                    if (e.esc) s.fallback = 1;
                                    int32_t end_ = (int32_t)(edata.len + e.slen);
                                    if (buf_put(&edata, e.s, e.slen) < 0 ||
                                            buf_put(&eoffs, &end_, 4) < 0) { nomem = 1; break; }
                                    nexc++;
                                    exc_n++;
                                }
                                ws(&s);
                                if (s.p < s.end && *s.p == ',') { s.p++; ws(&s); continue; }
                                if (s.p < s.end && *s.p == ']') { s.p++; s.depth--; done = 1; break; }
                                bad = 1;
                                break;
                            }
                            if (bad || nomem) break;
                        } else {
                            if (!value(&s, &v)) { bad = 1; break; }
                            if (is_exc) { has_exc = 0; edata.len = excs_mark; eoffs.len = eoffs_mark; nexc = nexc_mark; exc_n = 0; }
                            else if (key_is(&k, "action")) action = v;
                            else if (key_is(&k, "started_ms")) sms = v;
                            else if (key_is(&k, "started_at")) sat = v;
                            else if (key_is(&k, "total_time")) vtt = v;
                            else if (key_is(&k, "code")) vcode = v;
                            else if (key_is(&k, "severity")) vsev = v;
                        }
                        ws(&s);
                        if (s.p < s.end && *s.p == ',') { s.p++; ws(&s); continue; }
                        if (s.p < s.end && *s.p == '}') { s.p++; closed = 1; break; }
                        bad = 1;
                        break;
                    }
                    if (!bad) {
                        ws(&s);
                        if (s.p != s.end) bad = 1;               /* extra data */
                    }
                }
                if (nomem) break;
                if (s.fallback) {
                    f = F_FALLBACK;
                } else if (bad) {
                    f = F_BAD;
                } else {
                    if (action.type == T_STR) {
                        if (action.esc) f |= F_FALLBACK;
                        else if (buf_put(&adata, action.s, action.slen) < 0) { nomem = 1; break; }
                        else f |= F_ACTION;
                    }
                    if (sms.type == T_INT) {
                        if (sms.overflow) f |= F_FALLBACK;
                        else { started[r] = sms.i; f |= F_STARTED; }
                    } else if (sat.type == T_STR) {
                        int64_t ms;
                        if (!sat.esc && iso_ms(sat.s, sat.slen, &ms)) { started[r] = ms; f |= F_STARTED; }
                        else f |= F_FALLBACK;
                    }
                    if (vtt.type == T_FLOAT || vtt.type == T_INT) {
                        if (vtt.type == T_INT && vtt.overflow) f |= F_FALLBACK;
                        else { tt[r] = vtt.d; f |= F_TT; }
                    }
                    if (vcode.type == T_INT) {
                        if (vcode.overflow) f |= F_FALLBACK;
                        else if (vcode.i >= INT32_MIN && vcode.i <= INT32_MAX) { code[r] = (int32_t)vcode.i; f |= F_CODE; }
                    }
                    if (vsev.type == T_INT) {
                        if (vsev.overflow) f |= F_FALLBACK;
                        else if (vsev.i >= INT32_MIN && vsev.i <= INT32_MAX) { sev[r] = (int32_t)vsev.i; f |= F_SEV; }
                    }
                    if (has_exc) f |= F_EXC;
                }
                if (f & F_FALLBACK) f = F_FALLBACK;
                if (!(f & F_EXC)) { edata.len = excs_mark; eoffs.len = eoffs_mark; nexc = nexc_mark; }
            }
            flags[r] = f;
            aoff[r + 1] = (int32_t)adata.len;
            loff[r + 1] = nexc;
        }
        Py_END_ALLOW_THREADS
        if (nomem) {
            PyErr_NoMemory();
        } else {
            result = Py_BuildValue("(OOOOOOy#Oy#y#)", o_started, o_tt, o_code, o_sev, o_flags,
                                   o_aoff, adata.p ? adata.p : "", adata.len, o_loff,
                                   eoffs.p, eoffs.len, edata.p ? edata.p : "", edata.len);
        }
    } else {
        PyErr_NoMemory();
    }
    Py_XDECREF(o_started); Py_XDECREF(o_tt); Py_XDECREF(o_code); Py_XDECREF(o_sev);
    Py_XDECREF(o_flags); Py_XDECREF(o_aoff); Py_XDECREF(o_loff);
    PyMem_RawFree(adata.p); PyMem_RawFree(edata.p); PyMem_RawFree(eoffs.p);
out0:
    PyBuffer_Release(&vd); PyBuffer_Release(&vo); PyBuffer_Release(&vr);
    return result;
}

static PyMethodDef methods[] = {
    {"extract", extract, METH_VARARGS,
     "extract(data, offsets, rows) -> (started, total_time, code, severity, flags, "
     "action_offsets, action_data, exc_list_offsets, exc_offsets, exc_data)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_extract", "Request fields of logjam bodies, in C.", -1, methods,
};

PyMODINIT_FUNC PyInit__extract(void) { return PyModule_Create(&module); }
