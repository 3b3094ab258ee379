package logjamrelay.spark;

import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/**
 * {@code .option("aggregate", "requests")}: the partitions of {@link LogjamScan} (one per
 * segment, or slices of recordsPerPartition records), each decoded and aggregated whole by
 * {@link Partials} (decode, extract, one hash update per record: no row per record, no
 * Python worker) and read as its partial rows (schema {@link Partials#SCHEMA}, the rows of
 * logjam_relay.pipeline.partial).  Option apdexMs: the apdex threshold T (default 500).
 */
final class PartialScan implements Scan, Batch {
    static final String OPTION = "aggregate";
    static final String REQUESTS = "requests";
    /** option: gather the loss table's runs under this key ({@link LossRuns#take}) */
    static final String LOSS_KEY = "lossKey";

    private final LogjamScan segments;
    private final CaseInsensitiveStringMap options;

    PartialScan(LogjamScan segments, CaseInsensitiveStringMap options) {
        this.segments = segments;
        this.options = options;
    }

    /** whether the options ask for partial rows (and no other aggregation) */
    static boolean asked(CaseInsensitiveStringMap o) {
        String v = o.get(OPTION);
        if (v == null || v.isEmpty()) return false;
        if (!v.equals(REQUESTS))
            throw new IllegalArgumentException("logjam data source: option aggregate must be '"
                + REQUESTS + "', got " + PyText.pyStrRepr(v));
        return true;
    }

    public StructType readSchema() {
        return segments.readSchema();          // the table's: Partials.SCHEMA or SCHEMA_DDL
    }

    public String description() {
        return "logjam archive " + options.get("path") + " (JVM reader, partial aggregates)";
    }

    public Batch toBatch() {
        return this;
    }

    public InputPartition[] planInputPartitions() {
        return segments.planInputPartitions();
    }

    public PartitionReaderFactory createReaderFactory() {
        long rows = LogjamScan.intOption(options, "batchRows", Constants.DEFAULT_BATCH_ROWS);
        if (rows == 0 || rows > (1 << 24)) rows = Constants.DEFAULT_BATCH_ROWS;
        String key = options.get(LOSS_KEY);
        LossRuns.Acc loss = key == null || key.isEmpty() ? null : LossRuns.forKey(key);
        return new Factory(Partials.apdexOption(options.get("apdexMs")), (int) rows, loss);
    }

    static final class Factory implements PartitionReaderFactory {
        private static final long serialVersionUID = 1L;
        private final double apdexMs;
        private final int batchRows;
        private final LossRuns.Acc loss;

        Factory(double apdexMs, int batchRows, LossRuns.Acc loss) {
            this.apdexMs = apdexMs;
            this.batchRows = batchRows;
            this.loss = loss;
        }

        public boolean supportColumnarReads(InputPartition partition) {
            return true;
        }

        public PartitionReader createColumnarReader(InputPartition partition) {
            return new Reader((LogjamPartition) partition, apdexMs, batchRows, loss);
        }

        public PartitionReader createReader(InputPartition partition) {
            return new LogjamReaderFactory.Rows(createColumnarReader(partition));
        }
    }

    static final class Reader implements PartitionReader {
        private final LogjamPartition part;
        private final Partials agg;
        private final int batchRows;
        private final WritableColumnVector[] vectors;
        private final ColumnarBatch batch;
        private final LossRuns.Acc loss;
        private boolean aggregated;

        Reader(LogjamPartition part, double apdexMs, int batchRows, LossRuns.Acc loss) {
            this.part = part;
            this.loss = loss;
            this.agg = new Partials(apdexMs);
            this.batchRows = batchRows;
            StructField[] f = Partials.SCHEMA.fields();
            vectors = new WritableColumnVector[f.length];
            ColumnVector[] cols = new ColumnVector[f.length];
            for (int i = 0; i < f.length; i++) {
                vectors[i] = new OnHeapColumnVector(batchRows, f[i].dataType());
                cols[i] = vectors[i];
            }
            batch = new ColumnarBatch(cols);
        }

        public boolean next() {
            if (!aggregated) {
                SegmentDecoder d = new SegmentDecoder(part.path, part.segno, part.start,
                                                      part.stop, agg);
                d.skip = part.skip;
                d.conf = part.conf();
                if (loss != null) d.loss = new LossRuns.Slice(part.segno, part.start, part.stop);
                try {
                    while (d.fill(1 << 20) > 0) { }
                } finally {
                    d.close();
                }
                if (loss != null) {
                    d.loss.ended = d.ended;
                    loss.add(d.loss.encode());
                }
                aggregated = true;
            }
            for (int i = 0; i < vectors.length; i++) vectors[i].reset();
            int n = agg.emit(vectors, batchRows);
            batch.setNumRows(n);
            return n > 0;
        }

        public Object get() {
            return batch;
        }

        public void close() {
            batch.close();
        }
    }
}
