package logjamrelay.spark;

/** Limits shared with the Python side (tests compare them with logjam_relay's). */
public final class Constants {
    private Constants() {}

    /** protocols.logjam.MAX_DECOMPRESSED: the most a body may inflate to. */
    public static final int MAX_DECOMPRESSED = 64 * 1024 * 1024;
    /** spool.segment.MAX_BODY: sanity bound on a record's body_len. */
    public static final long MAX_BODY = 1L << 30;
    public static final int HEADER_LEN = 40;
    public static final int MIN_RECORD = 20;
    public static final int SEAL_RECORD_LEN = 48;
    public static final int KIND_SEAL = 255;
    /** The largest segment file the JVM reader reads (one byte array); bigger: Python. */
    public static final long MAX_ARRAY = Integer.MAX_VALUE - 64;
    /** decode.DEFAULT_BATCH_ROWS */
    public static final int DEFAULT_BATCH_ROWS = 32768;
    /** The name the Python data source is registered under when this one is "logjam". */
    public static final String PYTHON_NAME = "logjam_python";
    /** pipeline.minutes.MIN_MS / MAX_MS: the Unix epoch .. 9999-12-30T23:59:59.999Z. */
    public static final long MIN_MS = 0L, MAX_MS = 253_402_214_399_999L;

    public static boolean inRange(long ms) {
        return ms >= MIN_MS && ms <= MAX_MS;
    }

    /** pipeline.minutes.minute_of: the minute a time counts at (floored; out of range:
     *  minute 0, 1970-01-01 00:00 UTC). */
    public static long minute(long ms) {
        return inRange(ms) ? ms - ms % 60000L : 0L;
    }
}
