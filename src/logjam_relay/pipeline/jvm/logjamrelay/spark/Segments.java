package logjamrelay.spark;

import java.io.IOException;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.zip.CRC32;

import org.apache.hadoop.conf.Configuration;

/** Segment files: the listing (segment.sealed_segments), the seal record (read_seal) and
 *  record counts (decode.record_count), as the Python side has them; read through
 *  {@link Store} ({@code conf} null: a plain local path). */
final class Segments {
    private Segments() {}

    /** {segno, path} of every NNNNNNNNNNNNNNNNNNNN.seg in dir, ascending (a list of Object[]). */
    static List list(String dir, Configuration conf) {
        String[] names = Store.names(dir, conf);
        List out = new ArrayList();
        if (names == null) return out;
        Arrays.sort(names);
        for (int i = 0; i < names.length; i++) {
            String n = names[i];
            if (n.length() != 24 || !n.endsWith(".seg")) continue;
            boolean digits = true;
            for (int k = 0; k < 20; k++) {
                char c = n.charAt(k);
                if (c < '0' || c > '9') { digits = false; break; }
            }
            if (!digits) continue;
            out.add(new Object[] {Long.valueOf(Long.parseLong(n.substring(0, 20))),
                Store.child(dir, n)});
        }
        return out;
    }

    /** The size of the largest segment file in dir (0 when there is none). */
    static long largest(String dir, Configuration conf) {
        List segs = list(dir, conf);
        long max = 0;
        for (int i = 0; i < segs.size(); i++)
            max = Math.max(max, Store.length((String) ((Object[]) segs.get(i))[1], conf));
        return max;
    }

    private static long u32(byte[] b, int p) {
        return (b[p] & 0xFFL) | ((b[p + 1] & 0xFFL) << 8) | ((b[p + 2] & 0xFFL) << 16)
            | ((b[p + 3] & 0xFFL) << 24);
    }

    /** {record_count, data_end, sealed_ms} from a valid seal record at the end, or null. */
    static long[] readSeal(String path, Configuration conf) {
        long size = Store.length(path, conf);
        if (size < Constants.HEADER_LEN + Constants.SEAL_RECORD_LEN) return null;
        long start = size - Constants.SEAL_RECORD_LEN;
        byte[] b = Store.read(path, conf, start, Constants.SEAL_RECORD_LEN);
        return b == null ? null : parseSeal(b, start);
    }

    private static long[] parseSeal(byte[] b, long start) {
        long bodyLen = u32(b, 0);
        int n = (b[10] & 0xFF) | ((b[11] & 0xFF) << 8);
        if (bodyLen < 12 + 4L * n || bodyLen > Constants.MAX_BODY) return null;
        long rend = 8 + bodyLen;
        if (rend > b.length) return null;
        CRC32 c = new CRC32();
        c.update(b, 8, (int) bodyLen);
        if (c.getValue() != u32(b, 4)) return null;
        long sum = 0;
        for (int k = 0; k < n; k++) sum += u32(b, 20 + 4 * k);
        if (20 + 4L * n + sum != rend) return null;
        if ((b[8] & 0xFF) != Constants.KIND_SEAL || n != 1) return null;
        long count = u32(b, 24) | (u32(b, 28) << 32);
        long dataEnd = u32(b, 32) | (u32(b, 36) << 32);
        long sealed = u32(b, 40) | (u32(b, 44) << 32);
        if (dataEnd != start) return null;
        return new long[] {count, dataEnd, sealed};
    }

    /** Data records of a segment: the seal's count, else the valid records + 1 (a slot
     *  for the reader's error row), as decode.record_count. */
    static long recordCount(String path, Configuration conf) {
        long[] seal = readSeal(path, conf);
        if (seal != null) return seal[0];
        byte[] b;
        try {
            b = SegmentDecoder.readFile(path, conf);
        } catch (IOException e) {
            return 0;
        } catch (OutOfMemoryError e) {
            return 0;
        }
        if (SegmentDecoder.headerProblem(b) != null) return 1;
        long records = 0;
        int pos = Constants.HEADER_LEN;
        CRC32 c = new CRC32();
        while (b.length - pos >= Constants.MIN_RECORD) {
            long bodyLen = u32(b, pos);
            int n = (b[pos + 10] & 0xFF) | ((b[pos + 11] & 0xFF) << 8);
            long rend = pos + 8 + bodyLen;
            if (bodyLen < 12 + 4L * n || bodyLen > Constants.MAX_BODY || rend > b.length) break;
            c.reset();
            c.update(b, pos + 8, (int) bodyLen);
            if (c.getValue() != u32(b, pos + 4)) break;
            long sum = 0;
            for (int k = 0; k < n; k++) sum += u32(b, pos + 20 + 4 * k);
            if (pos + 20 + 4L * n + sum != rend) break;
            if ((b[pos + 8] & 0xFF) == Constants.KIND_SEAL) break;
            records++;
            pos = (int) rend;
        }
        return records + 1;
    }
}
