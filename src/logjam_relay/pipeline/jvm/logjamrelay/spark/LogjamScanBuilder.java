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
            if (Segments.largest(dir) > Constants.MAX_ARRAY)
                throw new IllegalArgumentException("logjam data source: option aggregate: a "
                    + "segment of " + dir + " is too big for the JVM reader");
            return new PartialScan(new LogjamScan(table, options, table.schema()), options);
        }
        // a schema naming columns this reader does not produce (the request fields
        // extracted from bodies): the Python source reads it all
        int[] codes = LogjamTable.codes(table.schema());
        if (codes == null) return table.pythonScan(options);
        // the request fields: here only for a caller that takes the "undecided" column too
        // (the rows whose fields Extract leaves to the Python definitions); without it the
        // Python source extracts every row itself
        boolean fields = false, undecided = false;
        for (int i = 0; i < codes.length; i++) {
            fields |= codes[i] >= SegmentDecoder.ACTION;
            undecided |= codes[i] == SegmentDecoder.UNDECIDED;
        }
        if (fields && !undecided) return table.pythonScan(options);
        // a segment too big for one Java array (over 2 GiB: spool_segment_bytes has no
        // upper bound): the Python source reads the whole scan
        long limit = LogjamScan.intOption(options, "jvmMaxSegmentBytes", Constants.MAX_ARRAY);
        if (Segments.largest(LogjamScan.path(options)) > Math.min(limit, Constants.MAX_ARRAY))
            return table.pythonScan(options);
        return new LogjamScan(table, options, required);
    }
}
