package logjamrelay.spark;

/** started_at in the ISO-8601 forms logjam agents write, in epoch ms: the JVM twin of
 *  iso_ms in pipeline/_extract.c (YYYY-MM-DD[T ]HH:MM:SS[.f{1,3}][Z|+HH:MM|-HH:MM], naive =
 *  UTC); any other form is {@link #NONE} and left to datetime.fromisoformat in Python. */
final class IsoTime {
    private IsoTime() {}

    static final long NONE = Long.MIN_VALUE;
    private static final int[] DAYS = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};

    private static int daysInMonth(int y, int m) {
        if (m == 2 && ((y % 4 == 0 && y % 100 != 0) || y % 400 == 0)) return 29;
        return DAYS[m - 1];
    }

    static long daysFromCivil(long y, int m, int d) {
        y -= m <= 2 ? 1 : 0;
        long era = (y >= 0 ? y : y - 399) / 400;
        long yoe = y - era * 400;
        long doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
        long doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        return era * 146097 + doe - 719468;
    }

    /** digits b[p, p+n) as a number, or -1 */
    private static int dig(byte[] b, int p, int n) {
        int v = 0;
        for (int i = 0; i < n; i++) {
            if (b[p + i] < '0' || b[p + i] > '9') return -1;
            v = v * 10 + (b[p + i] - '0');
        }
        return v;
    }

    /** b[off, off+n) as epoch ms, or NONE */
    static long parse(byte[] b, int off, int n) {
        if (n < 19 || b[off + 4] != '-' || b[off + 7] != '-'
                || (b[off + 10] != 'T' && b[off + 10] != ' ') || b[off + 13] != ':'
                || b[off + 16] != ':')
            return NONE;
        int y = dig(b, off, 4), mo = dig(b, off + 5, 2), d = dig(b, off + 8, 2),
            h = dig(b, off + 11, 2), mi = dig(b, off + 14, 2), se = dig(b, off + 17, 2);
        if (y < 0 || mo < 0 || d < 0 || h < 0 || mi < 0 || se < 0) return NONE;
        if (y < 1 || mo < 1 || mo > 12 || d < 1 || d > daysInMonth(y, mo) || h > 23 || mi > 59
                || se > 59)
            return NONE;
        int i = 19, frac = 0, sign = 0, oh = 0, om = 0;
        if (i < n && b[off + i] == '.') {
            int k = 0;
            i++;
            while (i < n && b[off + i] >= '0' && b[off + i] <= '9' && k < 4) {
                frac = frac * 10 + (b[off + i] - '0');
                i++;
                k++;
            }
            if (k == 0 || k > 3) return NONE;
            while (k < 3) { frac *= 10; k++; }
        }
        if (i < n) {
            byte c = b[off + i];
            if (c == 'Z' && i + 1 == n) {
                i++;
            } else if ((c == '+' || c == '-') && i + 6 == n && b[off + i + 3] == ':') {
                sign = c == '-' ? -1 : 1;
                oh = dig(b, off + i + 1, 2);
                om = dig(b, off + i + 4, 2);
                if (oh < 0 || om < 0 || oh > 23 || om > 59) return NONE;
                i = n;
            } else {
                return NONE;
            }
        }
        long secs = daysFromCivil(y, mo, d) * 86400 + h * 3600L + mi * 60L + se
            - sign * (oh * 3600L + om * 60L);
        return secs * 1000 + frac;
    }
}
