package logjamrelay.spark;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.util.ArrayList;
import java.util.HashMap;
import java.util.Iterator;

import org.apache.spark.SparkContext;
import org.apache.spark.util.AccumulatorV2;

/**
 * The loss table's input, gathered by the scan of the {@code jvm} engine
 * ({@link PartialScan} with option {@code lossKey}), so that the driver does not read the
 * archive a second time (logjam_relay.pipeline.stats: the loss walk).
 *
 * <p>Each partition records, per device, its records' (sequence, minute of created_ms) in
 * arrival order as runs: a record whose sequence is the previous one's plus one, in the
 * same minute, lengthens the device's last run. These are exactly the records
 * logjam_relay.pipeline.decode.meta_arrays gives (the ones with a valid meta frame, up to
 * the end of the readable part of the segment). A partition whose records make too many
 * runs sends none and says so: the driver then walks that segment itself, as before.
 *
 * <p>The runs travel to the driver in an accumulator keyed by (segment, first record):
 * a task run twice (a retry, a recomputed stage) replaces its own entry with the same one.
 * {@link #take} hands the driver all entries as one byte array of little-endian longs:
 * {@code count, then per entry: its length, then the entry} where an entry is {@code
 * segment, start, stop, ended (1: the walk reached the end of the readable segment, 0: it
 * stopped at the slice's end), overflow (1: no runs, walk the segment), records, devices,
 * then per device: device, runs, (first sequence, count, minute) per run}.
 */
public final class LossRuns {
    private LossRuns() {}

    /** a partition's runs above this many, and more than a quarter of its records: none */
    static final int MAX_RUNS = 4096;
    /** never more than this many runs held by one partition (then: overflow) */
    static final int HARD_MAX_RUNS = 1 << 20;
    /** more devices than this in one partition: overflow */
    static final int MAX_DEVICES = 1024;

    private static final HashMap REGISTRY = new HashMap();     // under its own lock

    /** The accumulator of key (created and registered on the driver on first use). */
    static Acc forKey(String key) {
        synchronized (REGISTRY) {
            Acc a = (Acc) REGISTRY.get(key);
            if (a == null) {
                a = new Acc();
                SparkContext.getOrCreate().register(a);
                REGISTRY.put(key, a);
            }
            return a;
        }
    }

    /** The entries gathered under key (see the class comment), and forget the key; an
     *  empty array when nothing was gathered under it. */
    public static byte[] take(String key) {
        Acc a;
        synchronized (REGISTRY) {
            a = (Acc) REGISTRY.remove(key);
        }
        ArrayList entries = a == null ? new ArrayList() : (ArrayList) a.value();
        long n = 1;
        for (int i = 0; i < entries.size(); i++) n += 1 + ((long[]) entries.get(i)).length;
        if (n * 8 > Integer.MAX_VALUE - 64)
            throw new IllegalStateException("loss runs too large to hand over: " + n + " longs");
        ByteBuffer out = ByteBuffer.allocate((int) (n * 8)).order(ByteOrder.LITTLE_ENDIAN);
        out.putLong(entries.size());
        for (int i = 0; i < entries.size(); i++) {
            long[] e = (long[]) entries.get(i);
            out.putLong(e.length);
            for (int k = 0; k < e.length; k++) out.putLong(e[k]);
        }
        return out.array();
    }

    /** One partition's runs. */
    static final class Slice {
        final long segno, start, stop;
        boolean ended;                       // the walk reached the end of the segment
        private long records;
        private boolean overflow;
        private int ndev;
        private long[] devs = new long[4];
        private long[][] runs = new long[4][];   // per device: (lo, count, minute) triples
        private int[] used = new int[4];         // longs used in runs[d]
        private long[] lastSeq = new long[4];
        private int totalRuns;
        private int lastDev = -1;

        Slice(long segno, long start, long stop) {
            this.segno = segno;
            this.start = start;
            this.stop = stop;
        }

        /** a record with a valid meta frame, in arrival order */
        void add(long device, long seq, long created) {
            records++;
            if (overflow) return;
            int d = lastDev;
            if (d < 0 || devs[d] != device) {
                d = -1;
                for (int i = 0; i < ndev; i++) if (devs[i] == device) { d = i; break; }
                if (d < 0) d = newDevice(device);
                if (d < 0) return;
                lastDev = d;
            }
            long minute = Constants.minute(created);
            long[] r = runs[d];
            int u = used[d];
            if (u > 0 && seq != Long.MIN_VALUE && seq - 1 == lastSeq[d] && r[u - 1] == minute) {
                r[u - 2]++;
            } else {
                if (++totalRuns > HARD_MAX_RUNS) { drop(); return; }
                if (u + 3 > r.length) {
                    long[] bigger = new long[r.length * 2];
                    System.arraycopy(r, 0, bigger, 0, u);
                    runs[d] = r = bigger;
                }
                r[u] = seq;
                r[u + 1] = 1;
                r[u + 2] = minute;
                used[d] = u + 3;
            }
            lastSeq[d] = seq;
        }

        private int newDevice(long device) {
            if (ndev == MAX_DEVICES) { drop(); return -1; }
            if (ndev == devs.length) {
                int c = ndev * 2;
                long[] nd = new long[c];
                System.arraycopy(devs, 0, nd, 0, ndev);
                devs = nd;
                long[][] nr = new long[c][];
                System.arraycopy(runs, 0, nr, 0, ndev);
                runs = nr;
                int[] nu = new int[c];
                System.arraycopy(used, 0, nu, 0, ndev);
                used = nu;
                long[] nl = new long[c];
                System.arraycopy(lastSeq, 0, nl, 0, ndev);
                lastSeq = nl;
            }
            devs[ndev] = device;
            runs[ndev] = new long[48];
            used[ndev] = 0;
            return ndev++;
        }

        private void drop() {
            overflow = true;
            runs = new long[0][];
            ndev = 0;
        }

        long[] encode() {
            boolean over = overflow || (totalRuns > MAX_RUNS && (long) totalRuns * 4 > records);
            int n = 7;
            if (!over) for (int d = 0; d < ndev; d++) n += 2 + used[d];
            long[] e = new long[n];
            e[0] = segno;
            e[1] = start;
            e[2] = stop;
            e[3] = ended ? 1 : 0;
            e[4] = over ? 1 : 0;
            e[5] = records;
            e[6] = over ? 0 : ndev;
            if (over) return e;
            int k = 7;
            for (int d = 0; d < ndev; d++) {
                e[k++] = devs[d];
                e[k++] = used[d] / 3;
                System.arraycopy(runs[d], 0, e, k, used[d]);
                k += used[d];
            }
            return e;
        }
    }

    /** Entries by (segment, start); a later entry of the same slice replaces the earlier. */
    public static final class Acc extends AccumulatorV2 {
        private static final long serialVersionUID = 1L;
        private HashMap map = new HashMap();

        public synchronized boolean isZero() {
            return map.isEmpty();
        }

        public AccumulatorV2 copy() {
            Acc a = new Acc();
            synchronized (this) {
                a.map.putAll(map);
            }
            return a;
        }

        public synchronized void reset() {
            map = new HashMap();
        }

        public synchronized void add(Object v) {
            long[] e = (long[]) v;
            map.put(e[0] + ":" + e[1], e);
        }

        public void merge(AccumulatorV2 other) {
            HashMap theirs;
            Acc o = (Acc) other;
            synchronized (o) {
                theirs = new HashMap(o.map);
            }
            synchronized (this) {
                map.putAll(theirs);
            }
        }

        public synchronized Object value() {
            ArrayList out = new ArrayList();
            for (Iterator it = map.values().iterator(); it.hasNext(); ) out.add(it.next());
            return out;
        }
    }
}
