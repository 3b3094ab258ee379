package logjamrelay.spark;

import java.util.EnumSet;
import java.util.HashMap;
import java.util.Map;
import java.util.Set;

import org.apache.spark.sql.connector.catalog.SupportsRead;
import org.apache.spark.sql.connector.catalog.Table;
import org.apache.spark.sql.connector.catalog.TableCapability;
import org.apache.spark.sql.connector.expressions.Transform;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.execution.datasources.v2.python.PythonDataSourceV2;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.DataTypes;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.CaseInsensitiveStringMap;

/** The archive directory as a table; see {@link LogjamProvider}. */
final class LogjamTable implements SupportsRead {
    /** the default schema: the first 11 of SegmentDecoder.COLUMNS */
    static final StructType SCHEMA;
    /** the type of every column this reader produces (SegmentDecoder.COLUMNS) */
    static final DataType[] TYPES = {DataTypes.StringType, DataTypes.StringType,
        DataTypes.StringType, DataTypes.LongType, DataTypes.LongType, DataTypes.LongType,
        DataTypes.StringType, DataTypes.StringType, DataTypes.StringType, DataTypes.LongType,
        DataTypes.IntegerType,
        // the request fields (extract.EXTRACT_DDL) and "undecided"
        DataTypes.StringType, DataTypes.LongType, DataTypes.DoubleType, DataTypes.IntegerType,
        DataTypes.IntegerType, DataTypes.createArrayType(DataTypes.StringType, true),
        DataTypes.BooleanType, DataTypes.BooleanType};
    static {
        StructField[] f = new StructField[11];
        for (int i = 0; i < f.length; i++)
            f[i] = DataTypes.createStructField(SegmentDecoder.COLUMNS[i], TYPES[i], true);
        SCHEMA = DataTypes.createStructType(f);
    }

    private final StructType schema;
    private final Map properties;
    private Table python;                        // the Python data source's table, on demand

    LogjamTable(StructType schema, Map properties) {
        this.schema = schema;
        this.properties = properties;
    }

    public String name() {
        return "logjam";
    }

    public StructType schema() {
        return schema;
    }

    public Set capabilities() {
        return EnumSet.of(TableCapability.BATCH_READ, TableCapability.MICRO_BATCH_READ);
    }

    public ScanBuilder newScanBuilder(CaseInsensitiveStringMap options) {
        return new LogjamScanBuilder(this, options);
    }

    /** Column codes of a schema this reader produces (SegmentDecoder.COLUMNS, the default
     *  types), or null when it names anything else (the Python source's business). */
    static int[] codes(StructType s) {
        StructField[] f = s.fields();
        int[] out = new int[f.length];
        for (int i = 0; i < f.length; i++) {
            int c = -1;
            for (int k = 0; k < SegmentDecoder.COLUMNS.length; k++)
                if (SegmentDecoder.COLUMNS[k].equals(f[i].name())) c = k;
            if (c < 0 || !TYPES[c].equals(f[i].dataType())) return null;
            out[i] = c;
        }
        return out;
    }

    /** A scan by the Python data source over the same options and schema. */
    Scan pythonScan(CaseInsensitiveStringMap options) {
        if (python == null) {
            PythonDataSourceV2 p = new PythonDataSourceV2();
            p.setShortName(Constants.PYTHON_NAME);
            python = p.getTable(schema, new Transform[0], new HashMap(properties));
        }
        return ((SupportsRead) python).newScanBuilder(options).build();
    }
}
