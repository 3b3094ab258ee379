package logjamrelay.spark;

import org.apache.spark.sql.connector.read.InputPartition;

/** Records [start, stop) of one segment file (stop -1: to the end). */
final class LogjamPartition implements InputPartition {
    private static final long serialVersionUID = 1L;
    final String path;
    final long segno;
    final long start;
    final long stop;

    LogjamPartition(String path, long segno, long start, long stop) {
        this.path = path;
        this.segno = segno;
        this.start = start;
        this.stop = stop;
    }
}
