package logjamrelay.spark;

/**
 * The request fields of one logjam `logs` body (valid UTF-8), the JVM twin of
 * pipeline/_extract.c and of logjam_relay.pipeline.extract.fields_of (json.loads'
 * semantics: whitespace " \t\n\r", strict strings, duplicate keys keep the last, true/false
 * are not numbers).  {@link #run} returns flags: 1 started, 2 total_time, 4 code,
 * 8 severity, 16 action, 32 exceptions; 64 bad_json; 128 = not decided here (as in
 * _extract.c: escapes in a key or in a string it returns, started_at in another ISO form,
 * integers beyond 64 bits, NaN/Infinity, very deep nesting, a BOM or NULs in the first
 * bytes): the caller hands such rows to the Python definitions.  One instance per reader.
 *
 * <p>The walk also checks the UTF-8 of every string (the only place where JSON allows bytes
 * over 0x7F), with the rules of {@link Bodies#utf8}: a body {@link #run} accepts (flags
 * without {@link #F_BAD} and {@link #F_UNDECIDED}) is valid UTF-8, so the caller need not
 * check it first; only for a bad or undecided body must it check (an invalid one is a
 * "utf8" error, not bad_json).
 */
final class Extract {
    static final int F_STARTED = 1, F_TT = 2, F_CODE = 4, F_SEV = 8, F_ACTION = 16, F_EXC = 32,
        F_BAD = 64, F_UNDECIDED = 128;
    private static final int MAX_DEPTH = 500;
    private static final int T_BAD = 0, T_OTHER = 1, T_STR = 2, T_INT = 3, T_FLOAT = 4;
    private static final byte[] K_EXCEPTIONS = SegmentDecoder.ascii("exceptions"),
        K_ACTION = SegmentDecoder.ascii("action"), K_STARTED_MS = SegmentDecoder.ascii("started_ms"),
        K_STARTED_AT = SegmentDecoder.ascii("started_at"),
        K_TOTAL_TIME = SegmentDecoder.ascii("total_time"), K_CODE = SegmentDecoder.ascii("code"),
        K_SEVERITY = SegmentDecoder.ascii("severity");

    // results of the last run
    long started;
    double totalTime;
    int code;
    int severity;
    int actionOff, actionLen;          // in the body buffer (no escapes)
    int excN;                          // strings of the exceptions list
    int[] excOff = new int[16];
    int[] excLen = new int[16];

    // parser state
    private byte[] b;
    private int p, end, depth;
    private boolean undecided;
    // the last scalar value parsed
    private int vType;
    private int vOff, vLen;
    private boolean vEsc;
    private long vInt;
    private boolean vOverflow;
    private double vDouble;

    private void ws() {
        // one comparison for the usual case (no whitespace: every JSON token but
        // whitespace starts above ' '; bytes over 0x7F are negative and fall through)
        while (p < end) {
            byte c = b[p];
            if (c > ' ') break;
            if (c == ' ' || c == '\t' || c == '\n' || c == '\r') p++;
            else break;
        }
    }

    private static boolean hexd(byte c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
    }

    private static final long ONES = 0x0101010101010101L, HIGH = 0x8080808080808080L,
        QUOTES = 0x2222222222222222L, BACKSLASHES = 0x5C5C5C5C5C5C5C5CL,
        SPACES = 0x2020202020202020L;
    /** 8 bytes of a byte[] as one little-endian long (Spark's Platform: Unsafe, no bounds
     *  check -- every read is within [off, off+len) of run(), which checks that range) */
    private static final long BASE = org.apache.spark.unsafe.Platform.BYTE_ARRAY_OFFSET;
    private static final boolean BIG_ENDIAN =
        java.nio.ByteOrder.nativeOrder() == java.nio.ByteOrder.BIG_ENDIAN;

    private static long le8(byte[] a, int i) {
        long x = org.apache.spark.unsafe.Platform.getLong(a, BASE + i);
        return BIG_ENDIAN ? Long.reverseBytes(x) : x;
    }

    /** a string at b[p] == '"'; false when invalid */
    private boolean str() {
        int q = p + 1;
        boolean esc = false;
        byte[] a = b;
        while (q < end) {
            // 8 bytes at a time up to the first '"', '\\' or control character (exact:
            // without a borrow from a lower flagged byte no byte is flagged wrongly, so the
            // lowest flag is the first such byte; the loop below then sees every byte it
            // would have seen one by one but the plain ones)
            while (q + 8 <= end) {
                long x = le8(a, q);
                long t1 = x ^ QUOTES, t2 = x ^ BACKSLASHES;
                // (| x: bytes over 0x7F too, checked as UTF-8 below)
                long m = (((t1 - ONES) & ~t1) | ((t2 - ONES) & ~t2) | ((x - SPACES) & ~x) | x)
                    & HIGH;
                if (m != 0) {
                    q += Long.numberOfTrailingZeros(m) >>> 3;
                    break;
                }
                q += 8;
            }
            if (q >= end) break;
            int c = b[q] & 0xFF;
            if (c == '"') {
                vType = T_STR;
                vOff = p + 1;
                vLen = q - (p + 1);
                vEsc = esc;
                p = q + 1;
                return true;
            }
            if (c >= 0x80) {                     // a UTF-8 sequence (Bodies.utf8's rules)
                int k = utf8At(q);
                if (k == 0) return false;
                q += k;
                continue;
            }
            if (c < 0x20) return false;
            if (c == '\\') {
                esc = true;
                if (q + 1 >= end) return false;
                int d = b[q + 1] & 0xFF;
                if (d == 'u') {
                    if (q + 6 > end || !hexd(b[q + 2]) || !hexd(b[q + 3]) || !hexd(b[q + 4])
                            || !hexd(b[q + 5]))
                        return false;
                    q += 6;
                    continue;
                }
                if (d != '"' && d != '\\' && d != '/' && d != 'b' && d != 'f' && d != 'n'
                        && d != 'r' && d != 't')
                    return false;
                q += 2;
                continue;
            }
            q++;
        }
        return false;
    }

    /** the length of the valid UTF-8 sequence at b[q] (a byte over 0x7F), 0 when invalid
     *  (strict: as Bodies.utf8, Python's bytes.decode) */
    private int utf8At(int q) {
        int c = b[q] & 0xFF;
        if (c >= 0xC2 && c <= 0xDF) {
            if (q + 1 >= end || (b[q + 1] & 0xC0) != 0x80) return 0;
            return 2;
        }
        if (c >= 0xE0 && c <= 0xEF) {
            if (q + 2 >= end) return 0;
            int c1 = b[q + 1] & 0xFF;
            if ((c1 & 0xC0) != 0x80 || (b[q + 2] & 0xC0) != 0x80) return 0;
            if (c == 0xE0 && c1 < 0xA0) return 0;               // overlong
            if (c == 0xED && c1 > 0x9F) return 0;               // surrogates
            return 3;
        }
        if (c >= 0xF0 && c <= 0xF4) {
            if (q + 3 >= end) return 0;
            int c1 = b[q + 1] & 0xFF;
            if ((c1 & 0xC0) != 0x80 || (b[q + 2] & 0xC0) != 0x80 || (b[q + 3] & 0xC0) != 0x80)
                return 0;
            if (c == 0xF0 && c1 < 0x90) return 0;               // overlong
            if (c == 0xF4 && c1 > 0x8F) return 0;               // > U+10FFFF
            return 4;
        }
        return 0;
    }

    private boolean num() {
        int q = p, start = p;
        boolean neg = false, isFloat = false;
        if (q < end && b[q] == '-') { neg = true; q++; }
        if (q >= end) return false;
        if (b[q] == 'I') { undecided = true; return false; }       // -Infinity
        long fast = 0;                           // the digits' value (wraps past 18 digits)
        if (b[q] == '0') q++;
        else if (b[q] >= '1' && b[q] <= '9') {
            while (q < end) {
                int d = b[q] - '0';
                if (d < 0 || d > 9) break;
                fast = fast * 10 + d;
                q++;
            }
        }
        else return false;
        int intEnd = q;
        boolean fracOk = true;
        if (q < end && b[q] == '.') {
            int r = q + 1;
            while (r < end && b[r] >= '0' && b[r] <= '9') r++;
            if (r == q + 1) fracOk = false;                      // "1." : the int, then junk
            else { isFloat = true; q = r; }
        }
        if (fracOk && q < end && (b[q] == 'e' || b[q] == 'E')) {
            int r = q + 1;
            if (r < end && (b[r] == '+' || b[r] == '-')) r++;
            int d0 = r;
            while (r < end && b[r] >= '0' && b[r] <= '9') r++;
            if (r > d0) { isFloat = true; q = r; }
        }
        if (!isFloat) q = intEnd;
        if (isFloat) {
            vType = T_FLOAT;                     // parsed only when kept (floatValue)
            vOff = start;
            vLen = q - start;
        } else {
            long acc = 0;
            boolean of = false;
            int k0 = start + (neg ? 1 : 0);
            if (q - k0 <= 18) {                  // 18 digits cannot overflow: no check
                acc = fast;
                k0 = q;
            }
            for (int k = k0; k < q; k++) {
                int dgt = b[k] - '0';
                // acc * 10 + dgt within [0, 2^63] (the magnitude of Long.MIN_VALUE)
                if (acc > (Long.MAX_VALUE - dgt) / 10) {
                    if (neg && acc == 922337203685477580L && dgt == 8 && k == q - 1) {
                        acc = Long.MIN_VALUE;   // exactly -2^63
                        continue;
                    }
                    of = true;
                    break;
                }
                acc = acc * 10 + dgt;
            }
            vType = T_INT;
            vOverflow = of;
            vInt = of ? 0 : (neg && acc != Long.MIN_VALUE ? -acc : acc);
            vDouble = (double) vInt;
        }
        p = q;
        return true;
    }

    /** the float of the number at b[off, off+len) (Java's parser rounds correctly, as
     *  Python's float() does) */
    private double floatValue(int off, int len) {
        // Clinger's fast path: up to 15 digits (exact in a double) times or over an exact
        // power of ten (<= 1e22) is one correctly rounded operation, the same double
        int q = off, e = off + len;
        boolean neg = b[q] == '-';
        if (neg) q++;
        long m = 0;
        int digits = 0, scale = 0;
        for (; q < e && b[q] >= '0' && b[q] <= '9'; q++, digits++) m = m * 10 + (b[q] - '0');
        if (q < e && b[q] == '.') {
            for (q++; q < e && b[q] >= '0' && b[q] <= '9'; q++, digits++, scale--)
                m = m * 10 + (b[q] - '0');
        }
        if (digits <= 15) {
            int x = 0;
            boolean ok = true;
            if (q < e) {                         // the exponent (num() checked its form)
                q++;
                boolean xneg = b[q] == '-';
                if (b[q] == '-' || b[q] == '+') q++;
                for (; q < e; q++) {
                    x = x * 10 + (b[q] - '0');
                    if (x > 400) { ok = false; break; }
                }
                if (xneg) x = -x;
            }
            int p10 = scale + x;
            if (ok && p10 >= -22 && p10 <= 22) {
                double d = (double) m;
                d = p10 < 0 ? d / POW10[-p10] : d * POW10[p10];
                return neg ? -d : d;
            }
        }
        return Double.parseDouble(new String(b, off, len, java.nio.charset.StandardCharsets.US_ASCII));
    }

    private static final double[] POW10 = {1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9,
        1e10, 1e11, 1e12, 1e13, 1e14, 1e15, 1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

    private boolean lit(String w) {
        int n = w.length();
        if (end - p < n) return false;
        for (int i = 0; i < n; i++) if (b[p + i] != w.charAt(i)) return false;
        p += n;
        return true;
    }

    /** skip any value (validating it); the scalar's type and contents in v* */
    private boolean value() {
        vType = T_OTHER;
        if (p >= end) return false;
        int c = b[p];
        if (c == '"') return str();
        if (c == '-' || (c >= '0' && c <= '9')) return num();
        if (c == 't') return lit("true");
        if (c == 'f') return lit("false");
        if (c == 'n') return lit("null");
        if (c == 'N' || c == 'I') { undecided = true; return false; }    // NaN, Infinity
        if (c == '[' || c == '{') {
            if (++depth > MAX_DEPTH) { undecided = true; return false; }
            boolean obj = c == '{';
            byte close = (byte) (obj ? '}' : ']');
            p++;
            ws();
            if (p < end && b[p] == close) { p++; depth--; vType = T_OTHER; return true; }
            for (;;) {
                if (obj) {
                    if (p >= end || b[p] != '"' || !str()) return false;
                    ws();
                    if (p >= end || b[p] != ':') return false;
                    p++;
                    ws();
                }
                if (!value()) return false;
                ws();
                if (p >= end) return false;
                if (b[p] == ',') { p++; ws(); continue; }
                if (b[p] == close) { p++; depth--; vType = T_OTHER; return true; }
                return false;
            }
        }
        return false;
    }

    private boolean keyIs(int off, int len, byte[] name) {
        if (len != name.length) return false;
        for (int i = 0; i < len; i++) if (b[off + i] != name[i]) return false;
        return true;
    }

    private void addExc(int off, int len) {
        if (excN == excOff.length) {
            int[] a = new int[excN * 2], l = new int[excN * 2];
            System.arraycopy(excOff, 0, a, 0, excN);
            System.arraycopy(excLen, 0, l, 0, excN);
            excOff = a;
            excLen = l;
        }
        excOff[excN] = off;
        excLen[excN] = len;
        excN++;
    }

    /** Extract the fields of buf[off, off+len); returns the flags. */
    int run(byte[] buf, int off, int len) {
        if (off < 0 || len < 0 || off + len > buf.length || off + len < 0)
            throw new IndexOutOfBoundsException("Extract.run: " + off + "+" + len + " of " + buf.length);
        b = buf;
        p = off;
        end = off + len;
        depth = 0;
        undecided = false;
        excN = 0;
        int n = end - p;
        if (n >= 1 && (b[p] == (byte) 0xEF || b[p] == 0 || (n >= 2 && b[p + 1] == 0)
                || (n >= 3 && b[p + 2] == 0) || (n >= 4 && b[p + 3] == 0)))
            return F_UNDECIDED;                  // BOM or NULs: json.loads guesses an encoding
        ws();
        if (p >= end || b[p] != '{') {
            if (value()) ws();                   // a valid non-object: still bad
            return undecided ? F_UNDECIDED : F_BAD;
        }
        // fields seen: type, offsets/values
        int aType = T_BAD, aOff = 0, aLen = 0;
        boolean aEsc = false;
        int smType = T_BAD;
        long smInt = 0;
        boolean smOf = false;
        int saType = T_BAD, saOff = 0, saLen = 0;
        boolean saEsc = false;
        int ttType = T_BAD, ttOff = 0, ttLen = 0;
        double ttD = 0;
        boolean ttOf = false;
        int cType = T_BAD;
        long cInt = 0;
        boolean cOf = false;
        int sType = T_BAD;
        long sInt = 0;
        boolean sOf = false;
        boolean hasExc = false;
        boolean bad = false;
        p++;
        depth = 1;
        ws();
        boolean closed = false;
        if (p < end && b[p] == '}') { p++; closed = true; }
        while (!closed) {
            if (p >= end || b[p] != '"' || !str()) { bad = true; break; }
            int kOff = vOff, kLen = vLen;
            if (vEsc) undecided = true;
            ws();
            if (p >= end || b[p] != ':') { bad = true; break; }
            p++;
            ws();
            boolean isExc = keyIs(kOff, kLen, K_EXCEPTIONS);
            if (isExc && p < end && b[p] == '[') {
                // the list: keep its strings (the last "exceptions" wins)
                excN = 0;
                hasExc = true;
                p++;
                if (++depth > MAX_DEPTH) { undecided = true; bad = true; break; }
                ws();
                boolean done = false;
                if (p < end && b[p] == ']') { p++; done = true; depth--; }
                while (!done) {
                    if (!value()) { bad = true; break; }
                    if (vType == T_STR) {
                        if (vEsc) undecided = true;
                        addExc(vOff, vLen);
                    }
                    ws();
                    if (p < end && b[p] == ',') { p++; ws(); continue; }
                    if (p < end && b[p] == ']') { p++; depth--; done = true; break; }
                    bad = true;
                    break;
                }
                if (bad) break;
            } else {
                if (!value()) { bad = true; break; }
                if (isExc) { hasExc = false; excN = 0; }
                else if (keyIs(kOff, kLen, K_ACTION)) {
                    aType = vType; aOff = vOff; aLen = vLen; aEsc = vEsc;
                } else if (keyIs(kOff, kLen, K_STARTED_MS)) {
                    smType = vType; smInt = vInt; smOf = vOverflow;
                } else if (keyIs(kOff, kLen, K_STARTED_AT)) {
                    saType = vType; saOff = vOff; saLen = vLen; saEsc = vEsc;
                } else if (keyIs(kOff, kLen, K_TOTAL_TIME)) {
                    ttType = vType; ttD = vDouble; ttOf = vOverflow; ttOff = vOff; ttLen = vLen;
                } else if (keyIs(kOff, kLen, K_CODE)) {
                    cType = vType; cInt = vInt; cOf = vOverflow;
                } else if (keyIs(kOff, kLen, K_SEVERITY)) {
                    sType = vType; sInt = vInt; sOf = vOverflow;
                }
            }
            ws();
            if (p < end && b[p] == ',') { p++; ws(); continue; }
            if (p < end && b[p] == '}') { p++; closed = true; break; }
            bad = true;
            break;
        }
        if (!bad) {
            ws();
            if (p != end) bad = true;            // extra data
        }
        if (undecided) return F_UNDECIDED;
        if (bad) return F_BAD;
        int f = 0;
        if (aType == T_STR) {
            if (aEsc) return F_UNDECIDED;
            actionOff = aOff;
            actionLen = aLen;
            f |= F_ACTION;
        }
        if (smType == T_INT) {
            if (smOf) return F_UNDECIDED;
            started = smInt;
            f |= F_STARTED;
        } else if (saType == T_STR) {
            long ms = saEsc ? IsoTime.NONE : IsoTime.parse(b, saOff, saLen);
            if (ms == IsoTime.NONE) return F_UNDECIDED;
            started = ms;
            f |= F_STARTED;
        }
        if (ttType == T_FLOAT || ttType == T_INT) {
            if (ttType == T_INT && ttOf) return F_UNDECIDED;
            totalTime = ttType == T_FLOAT ? floatValue(ttOff, ttLen) : ttD;
            f |= F_TT;
        }
        if (cType == T_INT) {
            if (cOf) return F_UNDECIDED;
            if (cInt >= Integer.MIN_VALUE && cInt <= Integer.MAX_VALUE) { code = (int) cInt; f |= F_CODE; }
        }
        if (sType == T_INT) {
            if (sOf) return F_UNDECIDED;
            if (sInt >= Integer.MIN_VALUE && sInt <= Integer.MAX_VALUE) { severity = (int) sInt; f |= F_SEV; }
        }
        if (hasExc) f |= F_EXC;
        else excN = 0;
        return f;
    }
}
