package logjamrelay.spark;

import java.util.zip.DataFormatException;
import java.util.zip.Inflater;

/**
 * Record bodies: decompression within {@link Constants#MAX_DECOMPRESSED} and the strict
 * UTF-8 check, the JVM twin of pipeline/_bodies.c (which follows the Python libraries:
 * zlib.decompress ignoring bytes after the stream, the snap crate's raw decoder,
 * LZ4_decompress_safe plus the exact-length check).  Where _bodies.c leaves a block
 * "undecided" for the Python library (LZ4 blocks that break the end-of-block rules), this
 * class asks lz4-java's safe decompressor, the same algorithm.  One instance per reader
 * (not thread-safe); {@link #out} holds the last body, {@link #len} its length.
 */
final class Bodies {
    byte[] out = new byte[1 << 16];
    int len;
    private final Inflater inflater = new Inflater();
    private NativeInflate fast;         // on the first zlib body; null: Inflater alone
    private boolean fastTried;
    private Object lz4;                 // net.jpountz.lz4.LZ4SafeDecompressor, on first use

    /** Decompress buf[off, off+n) with method comp (1 zlib, 2 snappy, 3 lz4) into out;
     *  false when it does not decompress (within the limit). */
    boolean decompress(byte[] buf, int off, int n, int comp) {
        if (comp == 1) return zlib(buf, off, n);
        if (comp == 2) return snappy(buf, off, n);
        if (comp == 3) return lz4(buf, off, n);
        return false;
    }

    private void room(int want) {
        if (out.length < want) {
            int c = out.length;
            while (c < want) c = c > (1 << 29) ? Integer.MAX_VALUE - 16 : c * 2;
            out = new byte[c];
        }
    }

    private boolean zlib(byte[] buf, int off, int n) {
        if (!fastTried) {
            fastTried = true;
            fast = NativeInflate.create();
        }
        if (fast != null) {
            room(1 << 16);
            int got = fast.inflate(buf, off, n, out);
            if (got >= 0) { len = got; return true; }
        }
        Inflater z = inflater;
        z.reset();
        z.setInput(buf, off, n);
        // the whole buffer at once (at least 64 KiB, kept between bodies): one inflate call
        // for nearly every body, where a window of 4n + 256 bytes needed a second call and
        // a copy for bodies that compress better than 4:1
        long want = Math.min(Math.max((long) n * 4 + 256, out.length), Constants.MAX_DECOMPRESSED);
        room((int) want);
        int have = 0;
        try {
            for (;;) {
                int got = z.inflate(out, have, (int) want - have);
                have += got;
                if (z.finished()) { len = have; return true; }
                if (z.needsDictionary()) return false;
                if (got == 0 && !z.needsInput() && have < want) return false;   // no progress
                if (have == want) {                         // output full: grow
                    if (want >= Constants.MAX_DECOMPRESSED) return false;
                    want = Math.min(want * 2, Constants.MAX_DECOMPRESSED);
                    byte[] bigger = new byte[(int) Math.max(want, out.length)];
                    System.arraycopy(out, 0, bigger, 0, have);
                    out = bigger;
                    continue;
                }
                if (z.needsInput()) return false;           // input exhausted: truncated
            }
        } catch (DataFormatException e) {
            return false;
        }
    }

    private boolean snappy(byte[] src, int off, int n) {
        if (n == 0) return false;
        long length = 0;
        int h = 0;
        int shift = 0;
        for (;;) {
            if (h >= n || shift > 63) return false;
            int b = src[off + h++] & 0xFF;
            length |= (long) (b & 0x7F) << shift;
            if (b < 0x80) break;
            shift += 7;
        }
        if (length < 0 || length > Constants.MAX_DECOMPRESSED) return false;
        if (length > (long) (n - h) * 22 + 64) return false;
        int dlen = (int) length;
        room(dlen);
        byte[] dst = out;
        int d = 0;
        int s = h;
        while (s < n) {
            int tag = src[off + s++] & 0xFF;
            if ((tag & 3) == 0) {                                   // literal
                long l = (tag >> 2) + 1;
                if (l >= 61) {
                    int k = (int) l - 60;
                    if (s + 4 > n) return false;                    // snap wants 4 bytes
                    long v = (src[off + s] & 0xFFL) | ((src[off + s + 1] & 0xFFL) << 8)
                            | ((src[off + s + 2] & 0xFFL) << 16) | ((src[off + s + 3] & 0xFFL) << 24);
                    if (k < 4) v &= (1L << (8 * k)) - 1;
                    l = v + 1;
                    s += k;
                }
                if (n - s < l || dlen - d < l) return false;
                System.arraycopy(src, off + s, dst, d, (int) l);
                s += (int) l;
                d += (int) l;
                continue;
            }
            int l;
            long o;
            if ((tag & 3) == 1) {
                if (s >= n) return false;
                l = 4 + ((tag >> 2) & 7);
                o = ((long) (tag >> 5) << 8) | (src[off + s] & 0xFF);
                s += 1;
            } else if ((tag & 3) == 2) {
                if (s + 2 > n) return false;
                l = (tag >> 2) + 1;
                o = (src[off + s] & 0xFF) | ((src[off + s + 1] & 0xFF) << 8);
                s += 2;
            } else {
                if (s + 4 > n) return false;
                l = (tag >> 2) + 1;
                o = (src[off + s] & 0xFFL) | ((src[off + s + 1] & 0xFFL) << 8)
                        | ((src[off + s + 2] & 0xFFL) << 16) | ((src[off + s + 3] & 0xFFL) << 24);
                s += 4;
            }
            if (o == 0 || o > d) return false;
            if (dlen - d < l) return false;
            int from = d - (int) o;
            if (o >= l) {
                System.arraycopy(dst, from, dst, d, l);
                d += l;
            } else {
                for (int i = 0; i < l; i++) dst[d++] = dst[from + i];
            }
        }
        if (d != dlen) return false;
        len = dlen;
        return true;
    }

    private boolean lz4(byte[] buf, int off, int n0) {
        if (n0 < 4) return false;
        long mm = ((buf[off] & 0xFFL) << 24) | ((buf[off + 1] & 0xFFL) << 16)
                | ((buf[off + 2] & 0xFFL) << 8) | (buf[off + 3] & 0xFFL);
        if (mm > Constants.MAX_DECOMPRESSED) return false;
        int m = (int) mm;
        int src = off + 4;
        int n = n0 - 4;
        if (m == 0) { len = 0; return n == 1 && buf[src] == 0; }
        if (n == 0) return false;
        if ((long) m > (long) n * 255 + 16) return false;           // cannot produce that much
        room(m);
        byte[] dst = out;
        int ip = 0;
        int op = 0;
        boolean strict = true;                                      // within the library's rules
        for (;;) {
            if (ip >= n) return false;
            int token = buf[src + ip++] & 0xFF;
            long l = token >> 4;
            if (l == 15) {
                int b;
                do {
                    if (ip >= n) return false;
                    b = buf[src + ip++] & 0xFF;
                    l += b;
                } while (b == 255);
            }
            if (l > n - ip || l > m - op) return false;
            System.arraycopy(buf, src + ip, dst, op, (int) l);
            ip += (int) l;
            op += (int) l;
            if (ip == n) break;                                     // the last sequence
            if (op > m - Math.min(m, 12) || ip > n - Math.min(n, 8) || m < 12 || n < 8)
                strict = false;
            if (n - ip < 2) return false;
            int o = (buf[src + ip] & 0xFF) | ((buf[src + ip + 1] & 0xFF) << 8);
            ip += 2;
            long ml = token & 15;
            if (ml == 15) {
                int b;
                do {
                    if (ip >= n) return false;
                    b = buf[src + ip++] & 0xFF;
                    ml += b;
                } while (b == 255);
                if (ip + 4 > n) strict = false;
            }
            ml += 4;
            if (o > op) return false;
            if (ml > m - op) return false;
            if (op + ml > m - Math.min(m, 5) || m < 5) strict = false;
            int mli = (int) ml;
            if (o == 0) {
                strict = false;
                java.util.Arrays.fill(dst, op, op + mli, (byte) 0);
                op += mli;
            } else if (o >= mli) {
                System.arraycopy(dst, op - o, dst, op, mli);
                op += mli;
            } else {
                for (int i = 0; i < mli; i++, op++) dst[op] = dst[op - o];
            }
            if (ip >= n) return false;                              // a match cannot end a block
        }
        if (op != m) return false;
        if (!strict) return lz4Library(buf, src, n, m);
        len = m;
        return true;
    }

    /** LZ4_decompress_safe(src, dst, n, m) == m through lz4-java (on Spark's class path). */
    private boolean lz4Library(byte[] buf, int src, int n, int m) {
        try {
            if (lz4 == null) lz4 = net.jpountz.lz4.LZ4Factory.fastestInstance().safeDecompressor();
            int got = ((net.jpountz.lz4.LZ4SafeDecompressor) lz4).decompress(buf, src, n, out, 0, m);
            if (got != m) return false;
            len = m;
            return true;
        } catch (RuntimeException e) {
            return false;
        }
    }

    private static final long BASE = org.apache.spark.unsafe.Platform.BYTE_ARRAY_OFFSET;
    private static final long HIGH = 0x8080808080808080L;

    /** Strict UTF-8 (what Python's bytes.decode("utf-8") accepts). */
    static boolean utf8(byte[] s, int off, int n) {
        if (off < 0 || n < 0 || off > s.length - n)
            throw new ArrayIndexOutOfBoundsException(off + "+" + n + " of " + s.length);
        int i = off;
        int end = off + n;
        while (i < end) {
            // ASCII runs 8 bytes at a time: one 8-byte read (Spark's Platform: Unsafe, within
            // [off, off+n), checked above) and one test of the 8 high bits
            while (i + 8 <= end
                    && (org.apache.spark.unsafe.Platform.getLong(s, BASE + i) & HIGH) == 0)
                i += 8;
            if (i >= end) break;
            int c = s[i];
            if (c >= 0) { i++; continue; }
            c &= 0xFF;
            if (c >= 0xC2 && c <= 0xDF) {
                if (i + 1 >= end || (s[i + 1] & 0xC0) != 0x80) return false;
                i += 2;
            } else if (c >= 0xE0 && c <= 0xEF) {
                if (i + 2 >= end) return false;
                int c1 = s[i + 1] & 0xFF;
                if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80) return false;
                if (c == 0xE0 && c1 < 0xA0) return false;           // overlong
                if (c == 0xED && c1 > 0x9F) return false;           // surrogates
                i += 3;
            } else if (c >= 0xF0 && c <= 0xF4) {
                if (i + 3 >= end) return false;
                int c1 = s[i + 1] & 0xFF;
                if ((c1 & 0xC0) != 0x80 || (s[i + 2] & 0xC0) != 0x80 || (s[i + 3] & 0xC0) != 0x80)
                    return false;
                if (c == 0xF0 && c1 < 0x90) return false;           // overlong
                if (c == 0xF4 && c1 > 0x8F) return false;           // > U+10FFFF
                i += 4;
            } else {
                return false;
            }
        }
        return true;
    }

    void close() {
        inflater.end();
        if (fast != null) fast.free();
    }
}
