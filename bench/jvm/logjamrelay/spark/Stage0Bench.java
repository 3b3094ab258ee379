package logjamrelay.spark;

import java.lang.management.GarbageCollectorMXBean;
import java.lang.management.ManagementFactory;
import java.lang.management.ThreadMXBean;
import java.util.List;
import java.util.zip.CRC32;

import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/**
 * Stage 0 of the jvm engine without Spark (bench/bench_stage0.py): every segment of an
 * archive through SegmentDecoder + Partials as PartialScan.Reader does it, in THREADS
 * threads (one segment at a time each), PASSES times; prints per pass the CPU of the
 * worker threads, the process CPU (JIT and GC threads included), the JIT compilation time
 * so far, and a digest of the emitted partial rows (equal digests: equal partial rows).
 *
 *   java -cp JAR:SPARK_JARS logjamrelay.spark.Stage0Bench DIR PASSES THREADS
 */
public final class Stage0Bench {
    static List segs;
    static int next;
    static long records;
    static long digest;

    static synchronized Object[] take() {
        return next < segs.size() ? (Object[]) segs.get(next++) : null;
    }

    static synchronized void done(long rows, long d) {
        records += rows;
        digest += d;                          // order-free sum of per-segment digests
    }

    static String mode = "agg";

    /** the other modes: only the walk (CRC, record and segment columns), or the walk and
     *  the bodies (decompression, UTF-8 check: the error column) */
    static long rowsOnly(String path, long segno, boolean bodies) {
        WritableColumnVector[] v = new WritableColumnVector[SegmentDecoder.COLUMNS.length];
        v[SegmentDecoder.RECORD] = new OnHeapColumnVector(32768, org.apache.spark.sql.types.DataTypes.IntegerType);
        if (bodies)
            v[SegmentDecoder.ERROR] = new OnHeapColumnVector(32768, org.apache.spark.sql.types.DataTypes.StringType);
        SegmentDecoder dec = new SegmentDecoder(path, segno, 0, -1, v);
        long rows = 0;
        ThreadMXBean tm = ManagementFactory.getThreadMXBean();
        long c0 = tm.getCurrentThreadCpuTime();
        try {
            for (;;) {
                for (int i = 0; i < v.length; i++) if (v[i] != null) v[i].reset();
                int n = dec.fill(32768);
                if (n == 0) break;
                rows += n;
            }
        } finally {
            dec.close();
        }
        decodeCpu(tm.getCurrentThreadCpuTime() - c0);
        done(rows, 0);
        return rows;
    }

    static long decodeNs;

    static synchronized void decodeCpu(long ns) {
        decodeNs += ns;
    }

    static long segment(String path, long segno) {
        if (!mode.equals("agg")) return rowsOnly(path, segno, mode.equals("bodies"));
        Partials agg = new Partials(500.0);
        SegmentDecoder dec = new SegmentDecoder(path, segno, 0, -1, agg);
        ThreadMXBean tm = ManagementFactory.getThreadMXBean();
        long c0 = tm.getCurrentThreadCpuTime();
        try {
            while (dec.fill(1 << 20) > 0) { }
        } finally {
            dec.close();
        }
        decodeCpu(tm.getCurrentThreadCpuTime() - c0);
        StructField[] f = Partials.SCHEMA.fields();
        WritableColumnVector[] v = new WritableColumnVector[f.length];
        for (int i = 0; i < f.length; i++) v[i] = new OnHeapColumnVector(32768, f[i].dataType());
        CRC32 c = new CRC32();
        long d = 0;
        for (;;) {
            for (int i = 0; i < v.length; i++) v[i].reset();
            int n = agg.emit(v, 32768);
            if (n == 0) break;
            for (int r = 0; r < n; r++) {
                c.reset();
                for (int i = 0; i < v.length; i++) {
                    if (v[i].isNullAt(r)) { c.update(0); continue; }
                    c.update(1);
                    String t = f[i].dataType().typeName();
                    String s;
                    if (t.equals("integer")) s = "" + v[i].getInt(r);
                    else if (t.equals("long")) s = "" + v[i].getLong(r);
                    else if (t.equals("double")) s = "" + Double.doubleToRawLongBits(v[i].getDouble(r));
                    else if (t.equals("string")) s = v[i].getUTF8String(r).toString();
                    else {
                        org.apache.spark.sql.vectorized.ColumnarArray a = v[i].getArray(r);
                        StringBuilder sb = new StringBuilder();
                        for (int k = 0; k < a.numElements(); k++)
                            sb.append(Double.doubleToRawLongBits(a.getDouble(k))).append(',');
                        s = sb.toString();
                    }
                    c.update(s.getBytes(java.nio.charset.StandardCharsets.UTF_8));
                    c.update(0);
                }
                d += c.getValue() * 0x9E3779B97F4A7C15L + 1;
            }
        }
        done(agg.rows, d);
        return agg.rows;
    }

    static final class Worker extends Thread {
        long cpu;

        public void run() {
            ThreadMXBean tm = ManagementFactory.getThreadMXBean();
            long c0 = tm.getCurrentThreadCpuTime();
            for (;;) {
                Object[] s = take();
                if (s == null) break;
                segment((String) s[1], ((Long) s[0]).longValue());
            }
            cpu = tm.getCurrentThreadCpuTime() - c0;
        }
    }

    static long gcMs() {
        long t = 0;
        List l = ManagementFactory.getGarbageCollectorMXBeans();
        for (int i = 0; i < l.size(); i++) t += ((GarbageCollectorMXBean) l.get(i)).getCollectionTime();
        return t;
    }

    public static void main(String[] args) throws Exception {
        String dir = args[0];
        int passes = Integer.parseInt(args[1]);
        int threads = Integer.parseInt(args[2]);
        if (args.length > 3) mode = args[3];
        com.sun.management.OperatingSystemMXBean os =
            (com.sun.management.OperatingSystemMXBean) ManagementFactory.getOperatingSystemMXBean();
        for (int p = 0; p < passes; p++) {
            segs = Segments.list(dir);
            next = 0;
            records = 0;
            digest = 0;
            decodeNs = 0;
            long w0 = System.nanoTime(), pc0 = os.getProcessCpuTime(), g0 = gcMs();
            Worker[] ws = new Worker[threads];
            for (int i = 0; i < threads; i++) { ws[i] = new Worker(); ws[i].start(); }
            long cpu = 0;
            for (int i = 0; i < threads; i++) { ws[i].join(); cpu += ws[i].cpu; }
            long wall = System.nanoTime() - w0, pcpu = os.getProcessCpuTime() - pc0;
            System.out.println("pass " + (p + 1) + " (" + mode + "): records " + records
                + "  decode " + String.format("%.2f", decodeNs / 1e9) + " CPU-s ("
                + String.format("%.3f", decodeNs / 1e3 / records) + " us/record)  workers "
                + String.format("%.2f", cpu / 1e9) + " CPU-s  process "
                + String.format("%.2f", pcpu / 1e9) + " CPU-s  wall "
                + String.format("%.2f", wall / 1e9) + " s  GC " + (gcMs() - g0) + " ms  JIT total "
                + ManagementFactory.getCompilationMXBean().getTotalCompilationTime()
                + " ms  digest " + Long.toHexString(digest));
        }
        System.out.println("process CPU total " + String.format("%.2f", os.getProcessCpuTime() / 1e9) + " s");
        // (by reflection: --rev of a revision before the native path has no such class)
        try {
            Class<?> ni = Class.forName("logjamrelay.spark.NativeInflate");
            System.out.println("zlib bodies inflated by the native path: "
                + ni.getMethod("answered").invoke(null) + " ("
                + ni.getMethod("status").invoke(null) + ")");
        } catch (ReflectiveOperationException e) {
            System.out.println("zlib bodies inflated by the native path: none (no such path)");
        }
    }
}
