package logjamrelay.spark;

import java.io.File;
import java.io.FileOutputStream;
import java.io.InputStream;
import java.io.OutputStream;
import org.apache.spark.unsafe.Platform;

/**
 * The fast zlib path of {@link Bodies}: pipeline/_jinflate.c, libdeflate behind a guard
 * that admits only the streams on which libdeflate and zlib agree (see there).  It
 * answers a length or "ask zlib" (-1), never a verdict of its own: {@link Bodies} then
 * runs {@link java.util.zip.Inflater} as before.
 *
 * The library travels inside the reader's jar ({@link #RESOURCE}, put there by
 * jvmreader.build when the extension was built), so a cluster's executors get it with
 * the jar; it is written to a temporary file and loaded once per JVM.  Without it (not
 * built, another platform, no libdeflate on the machine, a temporary directory that
 * cannot hold it or is mounted noexec -- {@link #TEMPDIR_PROPERTY} names another --,
 * {@link #setEnabled}(false), system property {@code logjamrelay.nativeInflate=false})
 * every body goes to Inflater; {@link #status} says which and why.  The entry
 * points take only primitives: the buffers are native memory of this object
 * (Platform.allocateMemory), the bodies are copied in and out.
 */
public final class NativeInflate {
    static final String RESOURCE = "logjamrelay/spark/native/libjinflate.so";
    /** where the library is written before it is loaded (default: java.io.tmpdir), for a
     *  temporary directory mounted noexec (as snappy-java's org.xerial.snappy.tempdir) */
    static final String TEMPDIR_PROPERTY = "logjamrelay.nativeInflate.tempdir";
    private static final int OUT_CAP = 1 << 16;

    private static int state;                  // 0 not tried, 1 loaded, -1 unavailable
    /** system property {@code logjamrelay.nativeInflate=false} (e.g. in
     *  spark.executor.extraJavaOptions) turns the path off for a JVM */
    private static volatile boolean enabled =
        !"false".equals(System.getProperty("logjamrelay.nativeInflate"));
    private static String why = "not tried";

    private static native int available();
    private static native long open();
    private static native void close(long d);
    private static native int inflate(long d, long in, int n, long out, int cap);

    /** Whether the native path is loaded (loading it on first call). */
    public static synchronized boolean loaded() {
        if (state == 0) {
            state = -1;
            try {
                ClassLoader cl = NativeInflate.class.getClassLoader();
                InputStream in = cl == null ? null : cl.getResourceAsStream(RESOURCE);
                if (in == null) {
                    why = "not in the jar";
                } else {
                    // owner-only (0600), a name of its own in TEMPDIR_PROPERTY's
                    // directory or java.io.tmpdir
                    String dir = System.getProperty(TEMPDIR_PROPERTY);
                    java.nio.file.attribute.FileAttribute[] none =
                        new java.nio.file.attribute.FileAttribute[0];
                    File f = null;
                    try {
                        f = (dir == null || dir.isEmpty()
                            ? java.nio.file.Files.createTempFile("logjam-jinflate-", ".so", none)
                            : java.nio.file.Files.createTempFile(java.nio.file.Paths.get(dir),
                                "logjam-jinflate-", ".so", none)).toFile();
                    } finally {
                        if (f == null) in.close();     // no file: the stream is not copied
                    }
                    try {
                        OutputStream o = new FileOutputStream(f);
                        try {
                            byte[] b = new byte[1 << 16];
                            for (int k = in.read(b); k > 0; k = in.read(b)) o.write(b, 0, k);
                        } finally {
                            o.close();
                            in.close();
                        }
                        System.load(f.getAbsolutePath());
                    } finally {
                        f.delete();            // the mapping stays
                    }
                    if (available() == 1) {
                        state = 1;
                        why = "libdeflate";
                    } else {
                        why = "no libdeflate on this machine";
                    }
                }
            } catch (Throwable t) {            // UnsatisfiedLinkError, IOException, ...
                why = t.toString();
                // a directory mounted noexec: the kernel refuses to map the library
                if (why.contains("failed to map segment"))
                    why = "the library cannot be loaded from " + tempDir()
                        + ", mounted noexec? (set -D" + TEMPDIR_PROPERTY
                        + "=DIR to another directory): " + why;
            }
        }
        return state == 1;
    }

    private static String tempDir() {
        String dir = System.getProperty(TEMPDIR_PROPERTY);
        return dir == null || dir.isEmpty() ? System.getProperty("java.io.tmpdir") : dir;
    }

    /** What the reader inflates zlib bodies with, in words (for logs and tests). */
    public static synchronized String status() {
        loaded();
        return state == 1 && enabled ? "libdeflate (zlib's rules)" : "java.util.zip.Inflater (" + (enabled ? why : "disabled") + ")";
    }

    private static final java.util.concurrent.atomic.AtomicLong ANSWERED =
        new java.util.concurrent.atomic.AtomicLong();

    /** How many bodies the native path has inflated in this JVM (readers add theirs when
     *  they close): tests see that it is used, not only loaded. */
    public static long answered() {
        return ANSWERED.get();
    }

    /** Tests and operators: off makes every new reader use Inflater alone. */
    public static void setEnabled(boolean on) {
        enabled = on;
    }

    /** A native inflater for one reader, or null when there is none. */
    static NativeInflate create() {
        return enabled && loaded() ? new NativeInflate() : null;
    }

    private long handle;
    private long count;                        // bodies answered, added to ANSWERED at free
    private long in;
    private int inCap;
    private long out;

    private NativeInflate() {
        handle = open();
        out = Platform.allocateMemory(OUT_CAP);
        inCap = 1 << 14;
        in = Platform.allocateMemory(inCap);
    }

    /** buf[off, off+n) inflated into dst (which holds at least 64 KiB): its length, or
     *  -1 when zlib must decide (also for every stream of more than 64 KiB). */
    int inflate(byte[] buf, int off, int n, byte[] dst) {
        // a stream of more than 64 KiB goes to Inflater (it nearly always inflates beyond
        // the output buffer): the native buffers stay at most 64 KiB each, whatever a
        // hostile body's size
        if (handle == 0 || n <= 0 || n > OUT_CAP) return -1;
        if (n > inCap) {
            Platform.freeMemory(in);
            inCap = Math.min(Math.max(n, inCap * 2), OUT_CAP);
            in = Platform.allocateMemory(inCap);
        }
        Platform.copyMemory(buf, Platform.BYTE_ARRAY_OFFSET + off, null, in, n);
        int cap = Math.min(Math.min(OUT_CAP, dst.length), Constants.MAX_DECOMPRESSED);
        int got = inflate(handle, in, n, out, cap);
        if (got > 0) Platform.copyMemory(null, out, dst, Platform.BYTE_ARRAY_OFFSET, got);
        if (got >= 0) count++;
        return got;
    }

    void free() {
        ANSWERED.addAndGet(count);
        count = 0;
        if (handle != 0) close(handle);
        handle = 0;
        if (in != 0) Platform.freeMemory(in);
        if (out != 0) Platform.freeMemory(out);
        in = out = 0;
    }
}
