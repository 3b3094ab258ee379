package logjamrelay.spark;

import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Paths;
import java.util.zip.CRC32;

import org.apache.spark.sql.execution.vectorized.WritableColumnVector;

/**
 * Records [start, stop) of one archived spool segment as rows in column vectors: the JVM
 * twin of logjam_relay.pipeline.decode.decode_segment_py (same rows, same error rows, same
 * walk: CRC of every record up to the slice's end, seal record ends it, non-logjam kinds
 * skipped without an index; a damaged record ends the segment with one "corrupt:REASON"
 * row).  tests/test_pipeline_jvm.py compares the two on whole, sliced and damaged files.
 * Columns: {@link #COLUMNS}; a null vector is a column nobody asked for.
 */
final class SegmentDecoder {
    static final String[] COLUMNS = {"app", "env", "topic", "device", "sequence", "created_ms",
        "compression", "body", "error", "segment", "record",
        // the request fields of logs bodies (extract.py; Extract.java), and whether a row's
        // fields were left to the Python definitions (then all six are null here)
        "action", "started_ms", "total_time", "code", "severity", "exceptions", "bad_json",
        "undecided"};
    static final int APP = 0, ENV = 1, TOPIC = 2, DEVICE = 3, SEQUENCE = 4, CREATED = 5,
        COMPRESSION = 6, BODY = 7, ERROR = 8, SEGMENT = 9, RECORD = 10, ACTION = 11,
        STARTED = 12, TOTAL_TIME = 13, CODE = 14, SEVERITY = 15, EXCEPTIONS = 16,
        BAD_JSON = 17, UNDECIDED = 18;

    private static final byte[][] COMP_NAMES = new byte[256][];
    private static final byte[] E_META = ascii("meta"), E_FRAMES = ascii("frames"),
        E_DECOMPRESS = ascii("decompress"), E_UTF8 = ascii("utf8");
    static {
        String[] known = {"none", "zlib", "snappy", "lz4"};
        for (int i = 0; i < 256; i++)
            COMP_NAMES[i] = ascii(i < known.length ? known[i] : "unknown-" + i);
    }

    private final String path;
    private final long segno;
    private final long start;
    private final long stop;
    private final WritableColumnVector[] v;      // by column code; null = not asked for
    private final boolean decode;                // body or error asked for
    private final boolean metaCols;
    private final boolean pairCols;
    private final boolean fieldCols;             // any of ACTION..UNDECIDED asked for
    private final Partials agg;                  // aggregate mode: records go here, no rows
    /** aggregate mode: the loss table's runs of the slice (LossRuns), or null */
    LossRuns.Slice loss;
    /** records left out (no row, not aggregated), ascending (LogjamPartition.skip), or null */
    long[] skip;
    private int skipAt;
    /** the walk reached the end of the readable segment (its seal, damage, or a file
     *  that cannot be read), not only the end of the slice */
    boolean ended;
    private final Extract extract = new Extract();
    private final Bodies bodies = new Bodies();
    private final CRC32 crc = new CRC32();

    /** Hadoop's configuration for a URI path (LogjamPartition.conf()); null: a local path */
    org.apache.hadoop.conf.Configuration conf;
    private byte[] buf;
    private int size;
    private int pos;
    private long idx;                            // index of the record at pos (kind 0 only)
    private boolean walking;
    private boolean done;
    private String pending;                      // an error row still to emit: error text
    private String pendingBody;
    private long pendingRecord;

    // (app-env, topic) interning: open addressing over the record bytes
    private Pair[] table = new Pair[64];
    private int pairs;

    static final class Pair {
        final byte[] key;                        // app_env bytes + topic bytes
        final int la;
        final int hash;
        final byte[] app, env, topic;
        final boolean logs;                      // the topic's bytes start with "logs"
        // Partials' string ids of app, env, topic (-1: not yet), and app/env == heartbeat/""
        int aid = -1, eid, tid;
        boolean heartbeat;

        Pair(byte[] key, int la, int hash) {
            this.key = key;
            this.la = la;
            this.hash = hash;
            String ae = PyText.pyDecode(key, 0, la);
            int dash = ae.lastIndexOf('-');
            String a = dash < 0 ? ae : ae.substring(0, dash);
            String e = dash < 0 ? "" : ae.substring(dash + 1);
            this.app = a.getBytes(StandardCharsets.UTF_8);
            this.env = e.getBytes(StandardCharsets.UTF_8);
            this.topic = PyText.pyDecode(key, la, key.length - la).getBytes(StandardCharsets.UTF_8);
            this.logs = key.length - la >= 4 && key[la] == 'l' && key[la + 1] == 'o'
                && key[la + 2] == 'g' && key[la + 3] == 's';
        }
    }

    SegmentDecoder(String path, long segno, long start, long stop, WritableColumnVector[] vectors) {
        this(path, segno, start, stop, vectors, null);
    }

    /** Aggregate mode: every record of the slice into agg (Partials), no column written;
     *  fill(max) then counts the records walked. */
    SegmentDecoder(String path, long segno, long start, long stop, Partials agg) {
        this(path, segno, start, stop, new WritableColumnVector[COLUMNS.length], agg);
    }

    private SegmentDecoder(String path, long segno, long start, long stop,
                           WritableColumnVector[] vectors, Partials agg) {
        this.agg = agg;
        this.path = path;
        this.segno = segno;
        this.start = start;
        this.stop = stop < 0 ? Long.MAX_VALUE : stop;
        this.v = vectors;
        boolean fields = false;
        for (int c = ACTION; c <= UNDECIDED; c++) fields |= v[c] != null;
        this.fieldCols = fields;
        this.decode = v[BODY] != null || v[ERROR] != null || fields || agg != null;
        this.metaCols = v[DEVICE] != null || v[SEQUENCE] != null || v[CREATED] != null
            || v[COMPRESSION] != null;
        this.pairCols = v[APP] != null || v[ENV] != null || v[TOPIC] != null || fields
            || agg != null;
    }

    static byte[] ascii(String s) {
        return s.getBytes(StandardCharsets.US_ASCII);
    }

    private static long u32(byte[] b, int p) {
        return (b[p] & 0xFFL) | ((b[p + 1] & 0xFFL) << 8) | ((b[p + 2] & 0xFFL) << 16)
            | ((b[p + 3] & 0xFFL) << 24);
    }

    /** the device number of the meta frame at b[s] (big-endian, unsigned 32 bits) */
    private static long device(byte[] b, int s) {
        return ((b[s + 4] & 0xFFL) << 24) | ((b[s + 5] & 0xFFL) << 16)
            | ((b[s + 6] & 0xFFL) << 8) | (b[s + 7] & 0xFFL);
    }

    private static long be64(byte[] b, int p) {
        long x = 0;
        for (int i = 0; i < 8; i++) x = (x << 8) | (b[p + i] & 0xFFL);
        return x;
    }

    // ------------------------------------------------------------------ batches

    /** Fill up to max rows (vectors reset by the caller); 0 when the slice is done. */
    int fill(int max) {
        int row = 0;
        if (done) return 0;
        if (buf == null && !open()) {
            row = flushPending(row);
            done = true;
            ended = true;
            return row;
        }
        if (walking) row = walk(row, max);
        if (!walking) {
            if (row < max) row = flushPending(row);
            if (pending == null) done = true;
        }
        return row;
    }

    private boolean open() {
        try {
            buf = readFile(path, conf);
        } catch (IOException e) {
            return unreadable(e);
        } catch (OutOfMemoryError e) {             // a file over 2 GiB, or no heap left
            return unreadable(e);
        }
        size = buf.length;
        String[] bad = headerProblem(buf);
        if (bad != null) {                      // one row for the file, from its first slice
            if (start == 0)
                error(start, "corrupt:" + bad[0], "{\"offset\": 0, \"message\": " + PyText.str(bad[1]) + "}");
            return false;
        }
        pos = Constants.HEADER_LEN;
        walking = true;
        return true;
    }

    /** The whole file, read 1 MiB at a time: Files.readAllBytes reads it at once
     *  through a temporary direct buffer of the file's size, so every byte is copied
     *  twice through memory that is not in any cache (0.38-0.46 us per record of the
     *  walk's 0.40-0.46 went there; in 1 MiB pieces 0.22-0.26).  A URI: through Hadoop
     *  ({@link Store}, {@code conf} not null). */
    static byte[] readFile(String path, org.apache.hadoop.conf.Configuration conf)
            throws IOException {
        if (conf != null) return Store.readAll(path, conf);
        java.nio.channels.FileChannel ch = java.nio.channels.FileChannel.open(Paths.get(path),
                java.nio.file.StandardOpenOption.READ);
        try {
            long sz = ch.size();
            if (sz > Integer.MAX_VALUE - 16)
                throw new OutOfMemoryError("Required array size too large");
            byte[] b = new byte[(int) sz];
            int at = 0;
            while (at < b.length) {
                int n = ch.read(java.nio.ByteBuffer.wrap(b, at, Math.min(READ_CHUNK, b.length - at)));
                if (n < 0) break;                  // shorter than it was: the walk sees it torn
                at += n;
            }
            return at < b.length ? java.util.Arrays.copyOf(b, at) : b;
        } finally {
            ch.close();
        }
    }

    private static final int READ_CHUNK = 1 << 20;

    private boolean unreadable(Throwable e) {
        error(start, "unreadable", "{\"path\": " + PyText.str(path) + ", \"message\": "
            + PyText.str(PyText.osError(e, path)) + "}");
        return false;
    }

    /** segment.decode_header's checks: {reason, message} or null. */
    static String[] headerProblem(byte[] b) {
        if (b.length < Constants.HEADER_LEN)
            return new String[] {"short_header", "segment header truncated (" + b.length + " bytes)"};
        byte[] magic = {'L', 'J', 'S', 'P', 'O', 'O', 'L', 0};
        for (int i = 0; i < 8; i++) {
            if (b[i] != magic[i]) {
                byte[] m = new byte[8];
                System.arraycopy(b, 0, m, 0, 8);
                return new String[] {"bad_magic", "not a spool segment (magic " + PyText.pyBytesRepr(m) + ")"};
            }
        }
        CRC32 c = new CRC32();
        c.update(b, 0, 36);
        if (c.getValue() != u32(b, 36)) return new String[] {"header_crc", "segment header CRC mismatch"};
        int version = (b[8] & 0xFF) | ((b[9] & 0xFF) << 8);
        int hlen = (b[10] & 0xFF) | ((b[11] & 0xFF) << 8);
        if (version != 1 || hlen != Constants.HEADER_LEN)
            return new String[] {"bad_version",
                "unsupported segment format version " + version + " (header " + hlen + ")"};
        return null;
    }

    private void error(long record, String error, String body) {
        pending = error;
        pendingBody = body;
        pendingRecord = record;
    }

    private int flushPending(int row) {
        if (pending == null) return row;
        for (int c = 0; c < v.length; c++) if (v[c] != null) v[c].putNull(row);
        if (v[BODY] != null) putBytes(BODY, row, pendingBody.getBytes(StandardCharsets.UTF_8));
        if (v[ERROR] != null) putBytes(ERROR, row, ascii(pending));
        if (v[SEGMENT] != null) { v[SEGMENT].putNotNull(row); v[SEGMENT].putLong(row, segno); }
        if (v[RECORD] != null) { v[RECORD].putNotNull(row); v[RECORD].putInt(row, (int) pendingRecord); }
        if (fieldCols) noFields(row);
        if (agg != null) agg.errorRow(pending);
        pending = null;
        return row + 1;
    }

    private void putBytes(int col, int row, byte[] b) {
        v[col].putNotNull(row);
        v[col].putByteArray(row, b, 0, b.length);
    }

    // ------------------------------------------------------------------ the walk

    private int walk(int row, int max) {
        byte[] b = buf;
        while (row < max) {
            if (idx >= stop) { walking = false; break; }
            int rem = size - pos;
            if (rem < Constants.MIN_RECORD) {
                stopAt(pos != size ? "torn" : "no_seal");
                break;
            }
            long bodyLen = u32(b, pos);
            int kind = b[pos + 8] & 0xFF;
            int n = (b[pos + 10] & 0xFF) | ((b[pos + 11] & 0xFF) << 8);
            long la = 0, lt = 0, lb = 0, lm = 0;
            if (rem >= 36) {
                la = u32(b, pos + 20);
                lt = u32(b, pos + 24);
                lb = u32(b, pos + 28);
                lm = u32(b, pos + 32);
            }
            long rendL = pos + 8 + bodyLen;
            if (bodyLen < 12 + 4L * n || bodyLen > Constants.MAX_BODY) { stopAt("bad_length"); break; }
            if (rendL > size) { stopAt("torn"); break; }
            int rend = (int) rendL;
            crc.reset();
            crc.update(b, pos + 8, (int) bodyLen);
            if (crc.getValue() != u32(b, pos + 4)) { stopAt("crc"); break; }
            if (kind != 0) {
                if (kind == Constants.KIND_SEAL) { walking = false; ended = true; break; }
                pos = rend;                     // not a logjam record: no row, no index
                continue;
            }
            long sum = 0;                       // frame lengths: checked before a slice
            if (n == 4) sum = la + lt + lb + lm;  // skips the record, too
            else for (int k = 0; k < n; k++) sum += u32(b, pos + 20 + 4 * k);
            if (pos + 20 + 4L * n + sum != rendL) { stopAt("frame_lengths"); break; }
            if (idx < start) {
                idx++;
                pos = rend;
                continue;
            }
            if (skip != null) {
                while (skipAt < skip.length && skip[skipAt] < idx) skipAt++;
                if (skipAt < skip.length && skip[skipAt] == idx) {
                    idx++;
                    pos = rend;
                    continue;
                }
            }
            if (n == 4) {
                int p = pos + 36;
                int r = p + (int) la + (int) lt;
                int s = r + (int) lb;
                logjamRow(row, b, p, (int) la, (int) lt, r, (int) lb, s, (int) lm);
            } else {
                int l0 = n > 0 ? (int) u32(b, pos + 20) : 0;
                framesRow(row, b, pos + 20 + 4 * n, l0);
            }
            row++;
            idx++;
            pos = rend;
        }
        return row;
    }

    private void stopAt(String reason) {
        walking = false;
        ended = true;
        if (start <= idx && idx < stop) {
            String body = "{\"offset\": " + pos;
            long[] seal = Segments.readSeal(path, conf);
            if (seal != null) body += ", \"records_lost\": " + Math.max(0, seal[0] - idx);
            else if (reason.equals("no_seal"))
                body += ", \"message\": \"segment has no valid seal record (incomplete copy?)\"";
            error(idx, "corrupt:" + reason, body + "}");
        }
    }

    private void common(int row) {
        if (v[SEGMENT] != null) v[SEGMENT].putLong(row, segno);
        if (v[RECORD] != null) v[RECORD].putInt(row, (int) idx);
    }

    private Pair pairRow(int row, byte[] b, int p, int la, int lt) {
        if (!pairCols) return null;
        Pair pr = pair(b, p, la, lt);
        if (v[APP] != null) v[APP].putByteArray(row, pr.app, 0, pr.app.length);
        if (v[ENV] != null) v[ENV].putByteArray(row, pr.env, 0, pr.env.length);
        if (v[TOPIC] != null) v[TOPIC].putByteArray(row, pr.topic, 0, pr.topic.length);
        return pr;
    }

    /** the request fields of a row that has none (not logs, not decoded) */
    private void noFields(int row) {
        for (int c = ACTION; c <= EXCEPTIONS; c++) if (v[c] != null) v[c].putNull(row);
        if (v[BAD_JSON] != null) { v[BAD_JSON].putNotNull(row); v[BAD_JSON].putBoolean(row, false); }
        if (v[UNDECIDED] != null) { v[UNDECIDED].putNotNull(row); v[UNDECIDED].putBoolean(row, false); }
    }

    /** the request fields of a logs body src[off, off+len) (valid UTF-8) */
    private void fields(int row, byte[] src, int off, int len) {
        Extract x = extract;
        int f = x.run(src, off, len);
        if (v[ACTION] != null) {
            if ((f & Extract.F_ACTION) != 0) v[ACTION].putByteArray(row, src, x.actionOff, x.actionLen);
            else v[ACTION].putNull(row);
        }
        if (v[STARTED] != null) {
            if ((f & Extract.F_STARTED) != 0) v[STARTED].putLong(row, x.started);
            else v[STARTED].putNull(row);
        }
        if (v[TOTAL_TIME] != null) {
            if ((f & Extract.F_TT) != 0) v[TOTAL_TIME].putDouble(row, x.totalTime);
            else v[TOTAL_TIME].putNull(row);
        }
        if (v[CODE] != null) {
            if ((f & Extract.F_CODE) != 0) v[CODE].putInt(row, x.code);
            else v[CODE].putNull(row);
        }
        if (v[SEVERITY] != null) {
            if ((f & Extract.F_SEV) != 0) v[SEVERITY].putInt(row, x.severity);
            else v[SEVERITY].putNull(row);
        }
        if (v[EXCEPTIONS] != null) {
            if ((f & Extract.F_EXC) != 0) {
                WritableColumnVector e = v[EXCEPTIONS];
                WritableColumnVector child = e.arrayData();
                int first = child.getElementsAppended();
                for (int k = 0; k < x.excN; k++) child.appendByteArray(src, x.excOff[k], x.excLen[k]);
                e.putArray(row, first, x.excN);
            } else {
                v[EXCEPTIONS].putNull(row);
            }
        }
        if (v[BAD_JSON] != null) v[BAD_JSON].putBoolean(row, (f & Extract.F_BAD) != 0);
        if (v[UNDECIDED] != null) v[UNDECIDED].putBoolean(row, (f & Extract.F_UNDECIDED) != 0);
    }

    private void nullMeta(int row) {
        if (v[DEVICE] != null) v[DEVICE].putNull(row);
        if (v[SEQUENCE] != null) v[SEQUENCE].putNull(row);
        if (v[CREATED] != null) v[CREATED].putNull(row);
        if (v[COMPRESSION] != null) v[COMPRESSION].putNull(row);
    }

    private void framesRow(int row, byte[] b, int p, int l0) {
        common(row);
        pairRow(row, b, p, l0, 0);
        nullMeta(row);
        if (v[BODY] != null) v[BODY].putNull(row);
        if (v[ERROR] != null) v[ERROR].putByteArray(row, E_FRAMES, 0, E_FRAMES.length);
        if (fieldCols) noFields(row);
        if (agg != null) agg.badRecord();
    }

    private void logjamRow(int row, byte[] b, int p, int la, int lt, int r, int lb, int s, int lm) {
        common(row);
        Pair pr = pairRow(row, b, p, la, lt);
        boolean want = fieldCols && pr.logs;
        if (fieldCols && !want) noFields(row);
        int comp = -1;
        if (lm == 24 && b[s + 3] == 1 && ((b[s] == (byte) 0xCA && b[s + 1] == (byte) 0xBD)
                || (b[s] == (byte) 0xBD && b[s + 1] == (byte) 0xCA)))
            comp = b[s + 2] & 0xFF;
        if (comp < 0) {
            nullMeta(row);
            if (v[BODY] != null) v[BODY].putNull(row);
            if (v[ERROR] != null) v[ERROR].putByteArray(row, E_META, 0, E_META.length);
            if (want) noFields(row);
            if (agg != null) agg.badRecord();
            return;
        }
        if (agg != null) {
            if (loss != null)
                loss.add(device(b, s), be64(b, s + 16), be64(b, s + 8));
            aggregate(b, s, r, lb, comp, pr);
            return;
        }
        if (metaCols) {
            if (v[DEVICE] != null) v[DEVICE].putLong(row, device(b, s));
            if (v[CREATED] != null) v[CREATED].putLong(row, be64(b, s + 8));
            if (v[SEQUENCE] != null) v[SEQUENCE].putLong(row, be64(b, s + 16));
            if (v[COMPRESSION] != null) v[COMPRESSION].putByteArray(row, COMP_NAMES[comp], 0,
                COMP_NAMES[comp].length);
        }
        if (!decode) return;
        byte[] src;
        int off;
        int len;
        if (comp == 0) {
            src = b;
            off = r;
            len = lb;
        } else if (bodies.decompress(b, r, lb, comp)) {
            src = bodies.out;
            off = 0;
            len = bodies.len;
        } else {
            if (v[BODY] != null) v[BODY].putNull(row);
            if (v[ERROR] != null) v[ERROR].putByteArray(row, E_DECOMPRESS, 0, E_DECOMPRESS.length);
            if (want) noFields(row);
            return;
        }
        if (!Bodies.utf8(src, off, len)) {
            if (v[BODY] != null) v[BODY].putNull(row);
            if (v[ERROR] != null) v[ERROR].putByteArray(row, E_UTF8, 0, E_UTF8.length);
            if (want) noFields(row);
            return;
        }
        if (v[BODY] != null) v[BODY].putByteArray(row, src, off, len);
        if (v[ERROR] != null) v[ERROR].putNull(row);
        if (want) fields(row, src, off, len);
    }

    /** aggregate mode: the record (its meta frame at b[s], body at b[r, r+lb)) into agg */
    private void aggregate(byte[] b, int s, int r, int lb, int comp, Pair pr) {
        long created = be64(b, s + 8);
        byte[] src;
        int off;
        int len;
        if (comp == 0) {
            src = b;
            off = r;
            len = lb;
        } else if (bodies.decompress(b, r, lb, comp)) {
            src = bodies.out;
            off = 0;
            len = bodies.len;
        } else {
            agg.badBody(pr, created);
            return;
        }
        if (pr.logs) {
            // Extract checks the UTF-8 of the strings it walks: a body it accepts is valid
            // UTF-8; a bad or undecided one is checked whole (invalid: error utf8 as before)
            int f = extract.run(src, off, len);
            if ((f & (Extract.F_BAD | Extract.F_UNDECIDED)) != 0 && !Bodies.utf8(src, off, len))
                agg.badBody(pr, created);
            else
                agg.request(pr, created, f, extract, src);
        } else if (!Bodies.utf8(src, off, len)) {
            agg.badBody(pr, created);
        } else {
            agg.other(pr, created);
        }
    }

    private Pair pair(byte[] b, int p, int la, int lt) {
        int n = la + lt;
        int h = la * 31 + n;
        for (int i = 0; i < n; i++) h = h * 31 + b[p + i];
        int mask = table.length - 1;
        for (int slot = h & mask;; slot = (slot + 1) & mask) {
            Pair e = table[slot];
            if (e == null) break;
            if (e.hash == h && e.la == la && e.key.length == n
                    && java.util.Arrays.equals(e.key, 0, n, b, p, p + n))
                return e;
        }
        byte[] key = new byte[n];
        System.arraycopy(b, p, key, 0, n);
        Pair e = new Pair(key, la, h);
        if (++pairs * 2 > table.length) {
            Pair[] old = table;
            table = new Pair[old.length * 2];
            for (int i = 0; i < old.length; i++) if (old[i] != null) insert(old[i]);
        }
        insert(e);
        return e;
    }

    private void insert(Pair e) {
        int mask = table.length - 1;
        int slot = e.hash & mask;
        while (table[slot] != null) slot = (slot + 1) & mask;
        table[slot] = e;
    }

    void close() {
        bodies.close();
        buf = null;
    }
}
