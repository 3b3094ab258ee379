package logjamrelay.spark;

import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** Column pruning: only the columns a query reads are decoded (no body: no decompression). */
final class LogjamScanBuilder implements SupportsPushDownRequiredColumns {
    private final LogjamTable table;
    private final CaseInsensitiveStringMap options;
    private StructType required;

    LogjamScanBuilder(LogjamTable table, CaseInsensitiveStringMap options) {
        this.table = table;
        this.options = options;
        this.required = table.schema();
    }

    public void pruneColumns(StructType requiredSchema) {
        required = requiredSchema;
    }

    public Scan build() {
        // the partial aggregates of the stats pipeline (PartialScan): always this reader
        if (PartialScan.asked(options)) {
            if (!table.schema().equals(Partials.SCHEMA) && !table.schema().equals(Partials.SCHEMA_DDL))
                throw new IllegalArgumentException("logjam data source: option aggregate: "
                    + "the schema is " + Partials.SCHEMA.toDDL() + ", not "
                    + table.schema().toDDL());
            String dir = LogjamScan.path(options);
            if (largest(dir) > Constants.MAX_ARRAY)
                throw new IllegalArgumentException("logjam data source: option aggregate: a "
                    + "segment of " + dir + " is too big for the JVM reader");
            return new PartialScan(new LogjamScan(table, options, table.schema()), options);
        }
        // a schema naming columns this reader does not produce (the request fields
        // extracted from bodies): the Python source reads it all
        int[] codes = LogjamTable.codes(table.schema());
        if (codes == null) return python("a column it does not produce");
        // the request fields: here only for a caller that takes the "undecided" column too
        // (the rows whose fields Extract leaves to the Python definitions); without it the
        // Python source extracts every row itself
        boolean fields = false, undecided = false;
        for (int i = 0; i < codes.length; i++) {
            fields |= codes[i] >= SegmentDecoder.ACTION;
            undecided |= codes[i] == SegmentDecoder.UNDECIDED;
        }
        if (fields && !undecided) return python("the request fields without 'undecided'");
        // a segment too big for one Java array (over 2 GiB: spool_segment_bytes has no
        // upper bound): the Python source reads the whole scan
        long limit = LogjamScan.intOption(options, "jvmMaxSegmentBytes", Constants.MAX_ARRAY);
        if (largest(LogjamScan.path(options)) > Math.min(limit, Constants.MAX_ARRAY))
            return python("a segment too big for one Java array");
        return new LogjamScan(table, options, required);
    }

    private long largest(String dir) {
        return Segments.largest(dir, Store.isUri(dir) ? Store.driverConf() : null);
    }

    /** The Python source's scan of the same options: it reads local paths (and file://)
     *  only, so another scheme is refused here with the reason. */
    private Scan python(String why) {
        String p = options.get("path");
        if (p != null && Store.isUri(p) && !p.regionMatches(true, 0, "file:", 0, 5))
            throw new IllegalArgumentException("logjam data source: " + p + ": this scan ("
                + why + ") is read by the Python source, which reads local paths and "
                + "file:// only");
        return table.pythonScan(options);
    }
}
