package logjamrelay.spark;

import org.apache.hadoop.conf.Configuration;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.util.SerializableConfiguration;

/** Records [start, stop) of one segment file (stop -1: to the end), less those of skip. */
final class LogjamPartition implements InputPartition {
    private static final long serialVersionUID = 1L;
    final String path;
    final long segno;
    final long start;
    final long stop;
    /** records of this slice left out (option exclude: the copies of an event that
     *  arrived more than once), ascending; null: none */
    final long[] skip;
    /** Spark's Hadoop configuration when path is a URI (Store.ship), else null */
    final SerializableConfiguration hadoop;

    LogjamPartition(String path, long segno, long start, long stop, long[] skip,
                    SerializableConfiguration hadoop) {
        this.hadoop = hadoop;
        this.path = path;
        this.segno = segno;
        this.start = start;
        this.stop = stop;
        this.skip = skip;
    }

    /** what SegmentDecoder.conf takes (null: a local path) */
    Configuration conf() {
        return Store.conf(hadoop);
    }
}
