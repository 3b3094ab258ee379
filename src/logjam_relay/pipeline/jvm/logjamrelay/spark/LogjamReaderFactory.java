package logjamrelay.spark;

import java.util.Iterator;

import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.execution.vectorized.OnHeapColumnVector;
import org.apache.spark.sql.execution.vectorized.WritableColumnVector;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/** Columnar readers over {@link SegmentDecoder} (rows, when asked, from the same batches). */
final class LogjamReaderFactory implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;
    private final StructType schema;
    private final int[] codes;
    private final int batchRows;

    LogjamReaderFactory(StructType schema, int[] codes, int batchRows) {
        this.schema = schema;
        this.codes = codes;
        this.batchRows = batchRows;
    }

    public boolean supportColumnarReads(InputPartition partition) {
        return true;
    }

    public PartitionReader createColumnarReader(InputPartition partition) {
        return new Columnar((LogjamPartition) partition);
    }

    public PartitionReader createReader(InputPartition partition) {
        return new Rows(new Columnar((LogjamPartition) partition));
    }

    final class Columnar implements PartitionReader {
        private final WritableColumnVector[] vectors;
        private final ColumnarBatch batch;
        private final SegmentDecoder decoder;

        Columnar(LogjamPartition part) {
            StructField[] f = schema.fields();
            vectors = new WritableColumnVector[f.length];
            WritableColumnVector[] byCode = new WritableColumnVector[SegmentDecoder.COLUMNS.length];
            ColumnVector[] cols = new ColumnVector[f.length];
            for (int i = 0; i < f.length; i++) {
                vectors[i] = new OnHeapColumnVector(batchRows, f[i].dataType());
                byCode[codes[i]] = vectors[i];
                cols[i] = vectors[i];
            }
            batch = new ColumnarBatch(cols);
            decoder = new SegmentDecoder(part.path, part.segno, part.start, part.stop, byCode);
            decoder.skip = part.skip;
            decoder.conf = part.conf();
        }

        public boolean next() {
            for (int i = 0; i < vectors.length; i++) vectors[i].reset();
            int n = decoder.fill(batchRows);
            batch.setNumRows(n);
            return n > 0;
        }

        public Object get() {
            return batch;
        }

        public void close() {
            decoder.close();
            batch.close();
        }
    }

    static final class Rows implements PartitionReader {
        private final PartitionReader columnar;
        private Iterator rows;
        private Object row;

        Rows(PartitionReader columnar) {
            this.columnar = columnar;
        }

        public boolean next() throws java.io.IOException {
            while (rows == null || !rows.hasNext()) {
                if (!columnar.next()) return false;
                rows = ((ColumnarBatch) columnar.get()).rowIterator();
            }
            row = rows.next();
            return true;
        }

        public Object get() {
            return (InternalRow) row;
        }

        public void close() throws java.io.IOException {
            columnar.close();
        }
    }
}
