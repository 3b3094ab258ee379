package logjamrelay.spark;

import java.io.File;
import java.io.IOException;
import java.io.InputStream;
import java.util.ArrayList;
import java.util.List;

import org.apache.hadoop.conf.Configuration;
import org.apache.hadoop.fs.FSDataInputStream;
import org.apache.hadoop.fs.FileStatus;
import org.apache.hadoop.fs.FileSystem;
import org.apache.hadoop.fs.Path;
import org.apache.spark.util.SerializableConfiguration;

/**
 * Where archive files are read from.  A plain path is a directory of the local file
 * system, read with java.nio (every executor must see it at the same path).  A URI with a
 * scheme -- {@code file://}, {@code hdfs://}, {@code s3a://}, whatever the cluster's Hadoop
 * has -- is read through Hadoop's FileSystem with Spark's Hadoop configuration: the
 * driver's ({@code SparkContext.hadoopConfiguration()}, the {@code spark.hadoop.*}
 * settings included), shipped to the executors inside each partition.
 */
final class Store {
    private Store() {}

    /** whether p names a file system by a scheme (RFC 3986: ALPHA *( ALPHA / DIGIT / + - . ) "://") */
    static boolean isUri(String p) {
        int colon = p.indexOf("://");
        if (colon < 1) return false;
        for (int i = 0; i < colon; i++) {
            char c = p.charAt(i);
            boolean ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')
                || (i > 0 && ((c >= '0' && c <= '9') || c == '+' || c == '-' || c == '.'));
            if (!ok) return false;
        }
        return true;
    }

    /** On the driver: the configuration to ship with the partitions of dir (null: a plain
     *  path, read without Hadoop). */
    static SerializableConfiguration ship(String dir) {
        if (!isUri(dir)) return null;
        return new SerializableConfiguration(driverConf());
    }

    static Configuration driverConf() {
        return org.apache.spark.SparkContext.getOrCreate().hadoopConfiguration();
    }

    static Configuration conf(SerializableConfiguration shipped) {
        return shipped == null ? null : shipped.value();
    }

    private static FileSystem fs(Path p, Configuration conf) throws IOException {
        return p.getFileSystem(conf);
    }

    /** The file names in dir (null when it cannot be listed). */
    static String[] names(String dir, Configuration conf) {
        if (conf == null) return new File(dir).list();
        try {
            Path p = new Path(dir);
            FileStatus[] st = fs(p, conf).listStatus(p);
            String[] out = new String[st.length];
            for (int i = 0; i < st.length; i++) out[i] = st[i].getPath().getName();
            return out;
        } catch (IOException e) {
            return null;
        }
    }

    /** The path of a file in dir. */
    static String child(String dir, String name) {
        if (!isUri(dir)) return new File(dir, name).getPath();
        return dir.endsWith("/") ? dir + name : dir + "/" + name;
    }

    /** Whether dir is a directory ({@code conf} null: on the local file system).  Throws
     *  what Hadoop throws for a scheme it has no file system for. */
    static boolean isDirectory(String dir, Configuration conf) throws IOException {
        if (conf == null) return new File(dir).isDirectory();
        Path p = new Path(dir);
        try {
            return fs(p, conf).getFileStatus(p).isDirectory();
        } catch (java.io.FileNotFoundException e) {
            return false;
        }
    }

    /** The length of a file (-1 when it cannot be read). */
    static long length(String path, Configuration conf) {
        if (conf == null) {
            File f = new File(path);
            return f.isFile() ? f.length() : -1;
        }
        try {
            Path p = new Path(path);
            return fs(p, conf).getFileStatus(p).getLen();
        } catch (IOException e) {
            return -1;
        }
    }

    /** len bytes of a file at off (null when it cannot be read, or is shorter). */
    static byte[] read(String path, Configuration conf, long off, int len) {
        byte[] b = new byte[len];
        if (conf == null) {
            java.io.RandomAccessFile f;
            try {
                f = new java.io.RandomAccessFile(path, "r");
            } catch (IOException e) {
                return null;
            }
            boolean ok = true;
            try {
                f.seek(off);
                f.readFully(b);
            } catch (IOException e) {
                ok = false;
            }
            try {
                f.close();
            } catch (IOException e) {
                // read-only: nothing lost
            }
            return ok ? b : null;
        }
        FSDataInputStream in;
        try {
            Path p = new Path(path);
            in = fs(p, conf).open(p);
        } catch (IOException e) {
            return null;
        }
        boolean ok = true;
        try {
            in.readFully(off, b);
        } catch (IOException e) {
            ok = false;
        }
        try {
            in.close();
        } catch (IOException e) {
            // read-only
        }
        return ok ? b : null;
    }

    /** A whole file through Hadoop, read 1 MiB at a time (the local path: SegmentDecoder.readFile). */
    static byte[] readAll(String path, Configuration conf) throws IOException {
        Path p = new Path(path);
        FileSystem fs = fs(p, conf);
        long sz = fs.getFileStatus(p).getLen();
        if (sz > Integer.MAX_VALUE - 16)
            throw new OutOfMemoryError("Required array size too large");
        byte[] b = new byte[(int) sz];
        InputStream in = fs.open(p);
        int at = 0;
        try {
            while (at < b.length) {
                int n = in.read(b, at, Math.min(1 << 20, b.length - at));
                if (n < 0) break;                  // shorter than it was: the walk sees it torn
                at += n;
            }
        } finally {
            in.close();
        }
        return at < b.length ? java.util.Arrays.copyOf(b, at) : b;
    }
}
