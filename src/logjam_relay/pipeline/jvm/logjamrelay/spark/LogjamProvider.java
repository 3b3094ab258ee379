package logjamrelay.spark;

import java.util.Map;

import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableProvider;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.sources.DataSourceRegister;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/**
 * {@code spark.read.format("logjam")} on the JVM: batch reads of the default columns (and
 * any subset of them) decode archived segments straight into columnar batches (no Python
 * worker, no Arrow hand-over, no per-row conversion).  Everything else -- streaming
 * ({@code readStream}), the request fields extracted from bodies, a schema this reader
 * does not produce -- goes to the Python data source (logjam_relay.pipeline.datasource),
 * registered under {@link Constants#PYTHON_NAME}.  See docs/pipeline.md.
 */
public final class LogjamProvider implements TableProvider, DataSourceRegister {
    public String shortName() {
        return "logjam";
    }

    public StructType inferSchema(CaseInsensitiveStringMap options) {
        if (PartialScan.asked(options)) return Partials.SCHEMA;
        return LogjamTable.SCHEMA;
    }

    public boolean supportsExternalMetadata() {
        return true;
    }

    public Table getTable(StructType schema, Transform[] partitioning, Map properties) {
        return new LogjamTable(schema == null ? LogjamTable.SCHEMA : schema, properties);
    }
}
