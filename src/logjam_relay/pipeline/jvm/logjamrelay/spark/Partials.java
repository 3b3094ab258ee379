package logjamrelay.spark;

import java.util.Arrays;

import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;

/**
 * The partial aggregation of one partition, the JVM twin of
 * logjam_relay.pipeline.partial.partial_batch: {@link SegmentDecoder} hands every record
 * here (no row, no column vector), and the partition's reader emits one row per group in
 * the schema of partial.PARTIAL_DDL ({@link #SCHEMA}), which Spark merges exactly as the
 * python engine's rows (stats.merge_partials): the tables are the same by construction,
 * the exact percentiles from the same sorted values.
 *
 * <ul>
 * <li>K_REQUEST: (minute, app, env, action) of a valid logs record (no error, JSON object):
 *     count, tt_n, tt_sum, tt_max, the total_time values, apdex, code and severity counts;</li>
 * <li>K_EXCEPTION: (minute, app, env, action, exception): count of the string entries;</li>
 * <li>K_TOPIC: (minute(created), app, env, topic) of the other topics but heartbeats;</li>
 * <li>K_OTHER: rows, bad (an error), corrupt (corrupt:*), bad_json;</li>
 * <li>K_UNDECIDED: count = the logs bodies {@link Extract} leaves to Python's json rules
 *     (the caller then runs the python engine).</li>
 * </ul>
 */
final class Partials {
    static final int K_REQUEST = 0, K_EXCEPTION = 1, K_TOPIC = 2, K_OTHER = 3, K_UNDECIDED = 4;
    static final String[] COUNTS = {"count", "tt_n", "apdex_s", "apdex_t", "http_2xx",
        "http_3xx", "http_4xx", "http_5xx", "severity_0", "severity_1", "severity_2",
        "severity_3", "severity_4", "severity_5", "rows", "bad", "corrupt", "bad_json"};
    /** column indexes in {@link #SCHEMA} */
    static final int C_KIND = 0, C_MINUTE = 1, C_APP = 2, C_ENV = 3, C_NAME = 4, C_EXC = 5,
        C_SUM = 6, C_MAX = 7, C_VALUES = 8, C_COUNTS = 9;
    /** partial.partial_schema(): partial.PARTIAL_DDL with tt_values holding no nulls
     *  (array&lt;double&gt; with containsNull false: Spark's sort_array of the merged values
     *  then sorts a double[] instead of boxed Doubles with a comparator) */
    static final StructType SCHEMA;
    /** partial.PARTIAL_DDL as written (containsNull true), which the reader accepts too */
    static final StructType SCHEMA_DDL;
    static {
        StructField[] f = new StructField[C_COUNTS + COUNTS.length];
        f[C_KIND] = DataTypes.createStructField("kind", DataTypes.IntegerType, true);
        f[C_MINUTE] = DataTypes.createStructField("minute_ms", DataTypes.LongType, true);
        f[C_APP] = DataTypes.createStructField("app", DataTypes.StringType, true);
        f[C_ENV] = DataTypes.createStructField("env", DataTypes.StringType, true);
        f[C_NAME] = DataTypes.createStructField("name", DataTypes.StringType, true);
        f[C_EXC] = DataTypes.createStructField("exception", DataTypes.StringType, true);
        f[C_SUM] = DataTypes.createStructField("tt_sum", DataTypes.DoubleType, true);
        f[C_MAX] = DataTypes.createStructField("tt_max", DataTypes.DoubleType, true);
        f[C_VALUES] = DataTypes.createStructField("tt_values",
            DataTypes.createArrayType(DataTypes.DoubleType, false), true);
        for (int i = 0; i < COUNTS.length; i++)
            f[C_COUNTS + i] = DataTypes.createStructField(COUNTS[i], DataTypes.LongType, true);
        SCHEMA = DataTypes.createStructType(f);
        StructField[] g = (StructField[]) f.clone();
        g[C_VALUES] = DataTypes.createStructField("tt_values",
            DataTypes.createArrayType(DataTypes.DoubleType, true), true);
        SCHEMA_DDL = DataTypes.createStructType(g);
    }
    private static final byte[] UNKNOWN = SegmentDecoder.ascii("unknown"),
        HEARTBEAT = SegmentDecoder.ascii("heartbeat");

    private final double t, t4;                  // apdex T and 4T (ms)
    long rows, bad, corrupt, badJson, undecided;

    // every string a key holds (apps, envs, actions, topics, exceptions) by id
    private final Strings strings = new Strings();
    private final int unknown;
    // request groups: (minute, app, env, name) -> index, and their accumulators
    private final Keys groups = new Keys();
    private long[] cnt = new long[64], apS = new long[64],
        apT = new long[64], http = new long[64 * 4], sev = new long[64 * 6];
    private double[] sum = new double[64], max = new double[64];
    private double[][] vals = new double[64][];
    private int[] nv = new int[64];
    private int[][] excId = new int[64][];
    private long[][] excCnt = new long[64][];
    private int[] excN = new int[64];
    // topic groups: (minute, app, env, topic) -> index, and their counts
    private final Keys topics = new Keys();
    private long[] tcnt = new long[64];

    Partials(double apdexMs) {
        t = apdexMs;
        t4 = 4 * apdexMs;
        unknown = strings.id(UNKNOWN, 0, UNKNOWN.length);
    }

    static double apdexOption(String s) {
        if (s == null || s.trim().isEmpty()) return 500.0;
        String v = s.trim();
        if (v.equals("inf") || v.equals("+inf")) return Double.POSITIVE_INFINITY;
        if (v.equals("-inf")) return Double.NEGATIVE_INFINITY;
        if (v.equals("nan")) return Double.NaN;
        return Double.parseDouble(v);
    }

    // ------------------------------------------------------------------ records

    /** an error row of the decoder (corrupt:REASON, unreadable) */
    void errorRow(String error) {
        rows++;
        bad++;
        if (error.startsWith("corrupt")) corrupt++;
    }

    /** a record with an error and no created_ms (meta, frames) */
    void badRecord() {
        rows++;
        bad++;
    }

    /** a record with an error but its meta (decompress, utf8): still a topic count */
    void badBody(SegmentDecoder.Pair pr, long created) {
        bad++;
        other(pr, created);
    }

    /** a decoded record of another topic than logs* (or a logs record with an error) */
    void other(SegmentDecoder.Pair pr, long created) {
        rows++;
        if (pr.logs) return;
        ids(pr);
        if (pr.heartbeat) return;
        int k = topics.find(Constants.minute(created), pr.aid, pr.eid, pr.tid);
        if (k == tcnt.length) tcnt = Arrays.copyOf(tcnt, k * 2);
        tcnt[k]++;
    }

    private void ids(SegmentDecoder.Pair pr) {
        if (pr.aid >= 0) return;
        pr.aid = strings.id(pr.app, 0, pr.app.length);
        pr.eid = strings.id(pr.env, 0, pr.env.length);
        pr.tid = strings.id(pr.topic, 0, pr.topic.length);
        pr.heartbeat = pr.env.length == 0 && Arrays.equals(pr.app, HEARTBEAT);
    }

    /** a decoded logs record: {@link Extract#run}'s flags f, its results in x, over src */
    void request(SegmentDecoder.Pair pr, long created, int f, Extract x, byte[] src) {
        rows++;
        if ((f & Extract.F_UNDECIDED) != 0) { undecided++; return; }
        if ((f & Extract.F_BAD) != 0) { badJson++; return; }
        ids(pr);
        long ms = (f & Extract.F_STARTED) != 0 && Constants.inRange(x.started) ? x.started : created;
        int name = (f & Extract.F_ACTION) != 0 ? strings.id(src, x.actionOff, x.actionLen) : unknown;
        int g = groups.find(Constants.minute(ms), pr.aid, pr.eid, name);
        if (g == cnt.length) grow(g * 2);
        cnt[g]++;
        if ((f & Extract.F_TT) != 0) {
            double tt = x.totalTime;
            int n = nv[g];
            if (n == 0) {
                sum[g] = 0.0 + tt;               // as Arrow's sum: from +0.0
                max[g] = tt;
            } else {
                sum[g] += tt;
                if (tt > max[g]) max[g] = tt;
            }
            double[] a = vals[g];
            if (a == null) vals[g] = a = new double[8];
            else if (n == a.length) vals[g] = a = Arrays.copyOf(a, n * 2);
            a[n] = tt;
            nv[g] = n + 1;
            if (tt <= t) apS[g]++;
            else if (tt <= t4) apT[g]++;
        }
        if ((f & Extract.F_CODE) != 0) {
            int c = x.code;
            if (c >= 200 && c < 600) http[g * 4 + c / 100 - 2]++;
        }
        if ((f & Extract.F_SEV) != 0) {
            int s = x.severity;
            if (s >= 0 && s <= 5) sev[g * 6 + s]++;
        }
        if ((f & Extract.F_EXC) != 0) {
            for (int k = 0; k < x.excN; k++) exception(g, strings.id(src, x.excOff[k], x.excLen[k]));
        }
    }

    private void exception(int g, int id) {
        int n = excN[g];
        int[] ids = excId[g];
        if (ids == null) {
            excId[g] = ids = new int[4];
            excCnt[g] = new long[4];
        }
        for (int i = 0; i < n; i++) {
            if (ids[i] == id) { excCnt[g][i]++; return; }
        }
        if (n == ids.length) {
            excId[g] = ids = Arrays.copyOf(ids, n * 2);
            excCnt[g] = Arrays.copyOf(excCnt[g], n * 2);
        }
        ids[n] = id;
        excCnt[g][n] = 1;
        excN[g] = n + 1;
    }

    private void grow(int n) {
        cnt = Arrays.copyOf(cnt, n);
        apS = Arrays.copyOf(apS, n);
        apT = Arrays.copyOf(apT, n);
        http = Arrays.copyOf(http, n * 4);
        sev = Arrays.copyOf(sev, n * 6);
        sum = Arrays.copyOf(sum, n);
        max = Arrays.copyOf(max, n);
        vals = (double[][]) Arrays.copyOf(vals, n);
        nv = Arrays.copyOf(nv, n);
        excId = (int[][]) Arrays.copyOf(excId, n);
        excCnt = (long[][]) Arrays.copyOf(excCnt, n);
        excN = Arrays.copyOf(excN, n);
    }

    // ------------------------------------------------------------------ rows out

    private int phase;                           // 0 requests, 1 exceptions, 2 topics, 3 other, 4 undecided
    private int gi, ej;

    /** Up to max partial rows into v (SCHEMA's columns, reset by the caller); 0 at the end. */
    int emit(WritableColumnVector[] v, int max) {
        int row = 0;
        while (row < max && phase < 5) {
            if (phase == 0) {
                if (gi >= groups.size) { phase = 1; gi = 0; ej = 0; continue; }
                requestRow(v, row++, gi++);
            } else if (phase == 1) {
                if (gi >= groups.size) { phase = 2; gi = 0; continue; }
                if (ej >= excN[gi]) { gi++; ej = 0; continue; }
                keyRow(v, row, K_EXCEPTION, groups, gi);
                putString(v[C_EXC], row, excId[gi][ej]);
                v[C_COUNTS].putLong(row, excCnt[gi][ej]);
                row++;
                ej++;
            } else if (phase == 2) {
                if (gi >= topics.size) { phase = 3; continue; }
                keyRow(v, row, K_TOPIC, topics, gi);
                v[C_COUNTS].putLong(row, tcnt[gi]);
                row++;
                gi++;
            } else if (phase == 3) {
                nullKey(v, row, K_OTHER);
                v[C_COUNTS + 14].putLong(row, rows);
                v[C_COUNTS + 15].putLong(row, bad);
                v[C_COUNTS + 16].putLong(row, corrupt);
                v[C_COUNTS + 17].putLong(row, badJson);
                row++;
                phase = 4;
            } else {
                if (undecided > 0) {
                    nullKey(v, row, K_UNDECIDED);
                    v[C_COUNTS].putLong(row, undecided);
                    row++;
                }
                phase = 5;
            }
        }
        return row;
    }

    private void zeros(WritableColumnVector[] v, int row, int kind) {
        v[C_KIND].putInt(row, kind);
        for (int c = C_COUNTS; c < v.length; c++) v[c].putLong(row, 0);
        v[C_EXC].putNull(row);
        v[C_SUM].putNull(row);
        v[C_MAX].putNull(row);
        v[C_VALUES].putNull(row);
    }

    private void nullKey(WritableColumnVector[] v, int row, int kind) {
        zeros(v, row, kind);
        v[C_MINUTE].putNull(row);
        v[C_APP].putNull(row);
        v[C_ENV].putNull(row);
        v[C_NAME].putNull(row);
    }

    private void keyRow(WritableColumnVector[] v, int row, int kind, Keys keys, int i) {
        zeros(v, row, kind);
        v[C_MINUTE].putLong(row, keys.minute[i]);
        putString(v[C_APP], row, keys.a[i]);
        putString(v[C_ENV], row, keys.b[i]);
        putString(v[C_NAME], row, keys.c[i]);
    }

    private void putString(WritableColumnVector c, int row, int id) {
        byte[] s = strings.bytes[id];
        c.putNotNull(row);
        c.putByteArray(row, s, 0, s.length);
    }

    private void requestRow(WritableColumnVector[] v, int row, int g) {
        keyRow(v, row, K_REQUEST, groups, g);
        int n = nv[g];
        v[C_COUNTS].putLong(row, cnt[g]);
        v[C_COUNTS + 1].putLong(row, n);
        v[C_COUNTS + 2].putLong(row, apS[g]);
        v[C_COUNTS + 3].putLong(row, apT[g]);
        for (int k = 0; k < 4; k++) v[C_COUNTS + 4 + k].putLong(row, http[g * 4 + k]);
        for (int k = 0; k < 6; k++) v[C_COUNTS + 8 + k].putLong(row, sev[g * 6 + k]);
        if (n > 0) {
            v[C_SUM].putNotNull(row);
            v[C_SUM].putDouble(row, sum[g]);
            v[C_MAX].putNotNull(row);
            v[C_MAX].putDouble(row, max[g]);
            WritableColumnVector child = v[C_VALUES].arrayData();
            int first = child.getElementsAppended();
            child.appendDoubles(n, vals[g], 0);
            v[C_VALUES].putNotNull(row);
            v[C_VALUES].putArray(row, first, n);
            vals[g] = null;                      // emitted once
        }
    }

    // ------------------------------------------------------------------ tables

    /** byte strings interned to ids (open addressing) */
    static final class Strings {
        byte[][] bytes = new byte[64][];
        private int[] hashes = new int[64];
        private int[] slots = new int[128];      // id + 1, 0 = free
        private int size;

        int id(byte[] b, int off, int len) {
            int h = len;
            for (int i = 0; i < len; i++) h = h * 31 + b[off + i];
            h ^= h >>> 16;
            int mask = slots.length - 1;
            for (int s = h & mask;; s = (s + 1) & mask) {
                int e = slots[s];
                if (e == 0) break;
                byte[] k = bytes[e - 1];
                if (hashes[e - 1] == h && k.length == len
                        && Arrays.equals(k, 0, len, b, off, off + len))
                    return e - 1;
            }
            int id = size++;
            if (id == bytes.length) {
                bytes = (byte[][]) Arrays.copyOf(bytes, id * 2);
                hashes = Arrays.copyOf(hashes, id * 2);
            }
            bytes[id] = Arrays.copyOfRange(b, off, off + len);
            hashes[id] = h;
            if (size * 2 > slots.length) {
                slots = new int[slots.length * 2];
                for (int i = 0; i < size; i++) place(i);
            } else {
                place(id);
            }
            return id;
        }

        private void place(int id) {
            int mask = slots.length - 1;
            int s = hashes[id] & mask;
            while (slots[s] != 0) s = (s + 1) & mask;
            slots[s] = id + 1;
        }
    }

    /** (minute, a, b, c) keys to dense indexes (open addressing) */
    static final class Keys {
        long[] minute = new long[64];
        int[] a = new int[64], b = new int[64], c = new int[64];
        private int[] hashes = new int[64];
        private int[] slots = new int[128];      // index + 1, 0 = free
        int size;

        /** the key's index (a new one is size - 1 afterwards) */
        int find(long m, int x, int y, int z) {
            int h = (int) (m ^ (m >>> 32)) * 0x9E3779B1 + x * 0x85EBCA6B + y * 0xC2B2AE35 + z * 0x27D4EB2F;
            h ^= h >>> 15;
            int mask = slots.length - 1;
            for (int s = h & mask;; s = (s + 1) & mask) {
                int e = slots[s];
                if (e == 0) break;
                int i = e - 1;
                if (hashes[i] == h && minute[i] == m && a[i] == x && b[i] == y && c[i] == z)
                    return i;
            }
            int i = size++;
            if (i == minute.length) {
                int n = i * 2;
                minute = Arrays.copyOf(minute, n);
                a = Arrays.copyOf(a, n);
                b = Arrays.copyOf(b, n);
                c = Arrays.copyOf(c, n);
                hashes = Arrays.copyOf(hashes, n);
            }
            minute[i] = m;
            a[i] = x;
            b[i] = y;
            c[i] = z;
            hashes[i] = h;
            if (size * 2 > slots.length) {
                slots = new int[slots.length * 2];
                for (int k = 0; k < size; k++) place(k);
            } else {
                place(i);
            }
            return i;
        }

        private void place(int i) {
            int mask = slots.length - 1;
            int s = hashes[i] & mask;
            while (slots[s] != 0) s = (s + 1) & mask;
            slots[s] = i + 1;
        }
    }
}
