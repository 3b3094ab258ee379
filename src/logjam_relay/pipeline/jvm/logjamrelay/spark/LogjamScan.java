package logjamrelay.spark;

import java.util.ArrayList;
import java.util.List;

import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.streaming.MicroBatchStream;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** A batch scan: one partition per segment, or slices of recordsPerPartition records;
 *  options as the Python source has them (logjam_relay.pipeline.datasource). */
final class LogjamScan implements Scan, Batch {
    private final LogjamTable table;
    private final CaseInsensitiveStringMap options;
    private final StructType required;

    LogjamScan(LogjamTable table, CaseInsensitiveStringMap options, StructType required) {
        this.table = table;
        this.options = options;
        this.required = required;
    }

    public StructType readSchema() {
        return required;
    }

    public String description() {
        return "logjam archive " + options.get("path") + " (JVM reader)";
    }

    public Batch toBatch() {
        return this;
    }

    public MicroBatchStream toMicroBatchStream(String checkpointLocation) {
        return table.pythonScan(options).toMicroBatchStream(checkpointLocation);
    }

    static long intOption(CaseInsensitiveStringMap o, String name, long dflt) {
        String v = o.get(name);
        if (v == null || v.isEmpty()) return dflt;
        // what Python's int() takes: sign, digits with single underscores between, any size
        String t = v.trim();
        if (!t.matches("[+-]?[0-9]+(_[0-9]+)*"))
            throw new IllegalArgumentException("logjam data source: option " + name
                + " must be an integer, got " + PyText.pyStrRepr(v));
        java.math.BigInteger n = new java.math.BigInteger(t.replace("_", "").replace("+", ""));
        if (n.signum() < 0)
            throw new IllegalArgumentException("logjam data source: option " + name
                + " must be >= 0, got " + n);
        return n.bitLength() < 63 ? n.longValue() : Long.MAX_VALUE;
    }

    /** The archive directory of option path: a local path, or a URI read through Hadoop
     *  (Store); checked to be a directory. */
    static String path(CaseInsensitiveStringMap o) {
        String p = o.get("path");
        if (p == null || p.isEmpty())
            throw new IllegalArgumentException("logjam data source: give the archive directory, "
                + "e.g. spark.read.format('logjam').load('/path/to/archive')");
        boolean dir;
        try {
            dir = Store.isDirectory(p, Store.isUri(p) ? Store.driverConf() : null);
        } catch (java.io.IOException e) {
            // a scheme the cluster's Hadoop has no file system for, a store that refuses
            throw new IllegalArgumentException("logjam data source: " + p + " cannot be read "
                + "through Hadoop: " + e.getClass().getSimpleName() + ": " + e.getMessage());
        }
        if (!dir)
            throw new IllegalArgumentException("logjam data source: " + p + " is not a directory");
        return p;
    }

    /** option exclude ("SEGNO:A-B,C;SEGNO:..."; logjam_relay.pipeline.origin): segment
     *  number -> the record indices left out, ascending */
    static java.util.Map exclusions(CaseInsensitiveStringMap o) {
        java.util.Map out = new java.util.HashMap();
        String v = o.get("exclude");
        if (v == null || v.isEmpty()) return out;
        try {
            for (String part : v.split(";")) {
                if (part.isEmpty()) continue;
                int colon = part.indexOf(':');
                long seg = Long.parseLong(part.substring(0, colon));
                java.util.TreeSet recs = new java.util.TreeSet();
                for (String r : part.substring(colon + 1).split(",")) {
                    if (r.isEmpty()) continue;
                    int dash = r.indexOf('-');
                    long a = Long.parseLong(dash < 0 ? r : r.substring(0, dash));
                    long z = dash < 0 ? a : Long.parseLong(r.substring(dash + 1));
                    if (a < 0 || z < a) throw new IllegalArgumentException(r);
                    for (long x = a; x <= z; x++) recs.add(Long.valueOf(x));
                }
                long[] arr = new long[recs.size()];
                int i = 0;
                for (Object x : recs) arr[i++] = ((Long) x).longValue();
                out.put(Long.valueOf(seg), arr);
            }
        } catch (RuntimeException e) {
            throw new IllegalArgumentException("logjam data source: option exclude is malformed: "
                + PyText.pyStrRepr(v.length() > 80 ? v.substring(0, 80) : v));
        }
        return out;
    }

    /** the records of skip in [start, stop) (stop -1: to the end), or null if none */
    static long[] within(long[] skip, long start, long stop) {
        if (skip == null) return null;
        long end = stop < 0 ? Long.MAX_VALUE : stop;
        int a = 0;
        while (a < skip.length && skip[a] < start) a++;
        int z = a;
        while (z < skip.length && skip[z] < end) z++;
        return z > a ? java.util.Arrays.copyOfRange(skip, a, z) : null;
    }

    public InputPartition[] planInputPartitions() {
        String dir = path(options);
        long per = intOption(options, "recordsPerPartition", 0);
        java.util.Map excl = exclusions(options);
        org.apache.spark.util.SerializableConfiguration hadoop = Store.ship(dir);
        org.apache.hadoop.conf.Configuration conf = Store.conf(hadoop);
        List segs = Segments.list(dir, conf);
        List parts = new ArrayList();
        for (int i = 0; i < segs.size(); i++) {
            Object[] s = (Object[]) segs.get(i);
            long segno = ((Long) s[0]).longValue();
            String p = (String) s[1];
            long[] skip = (long[]) excl.get(Long.valueOf(segno));
            if (per > 0) {
                long count = Segments.recordCount(p, conf);
                if (count <= per) parts.add(new LogjamPartition(p, segno, 0, count,
                                                                within(skip, 0, count), hadoop));
                else for (long a = 0; a < count; a += per) {
                    long z = Math.min(a + per, count);
                    parts.add(new LogjamPartition(p, segno, a, z, within(skip, a, z), hadoop));
                }
            } else {
                parts.add(new LogjamPartition(p, segno, 0, -1, within(skip, 0, -1), hadoop));
            }
        }
        InputPartition[] out = new InputPartition[parts.size()];
        for (int i = 0; i < out.length; i++) out[i] = (InputPartition) parts.get(i);
        return out;
    }

    public PartitionReaderFactory createReaderFactory() {
        long rows = intOption(options, "batchRows", Constants.DEFAULT_BATCH_ROWS);
        if (rows == 0 || rows > (1 << 24)) rows = Constants.DEFAULT_BATCH_ROWS;
        return new LogjamReaderFactory(required, LogjamTable.codes(required), (int) rows);
    }
}
