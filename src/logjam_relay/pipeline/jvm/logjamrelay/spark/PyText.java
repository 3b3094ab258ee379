package logjamrelay.spark;

import java.nio.charset.StandardCharsets;

/** Python's text conventions the rows must match: json.dumps (ensure_ascii), bytes and str
 *  repr, bytes.decode("utf-8", "replace"), str(OSError). */
final class PyText {
    private PyText() {}

    /** json.dumps(s) */
    static String str(String s) {
        StringBuilder o = new StringBuilder(s.length() + 2);
        o.append('"');
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == '"') o.append("\\\"");
            else if (c == '\\') o.append("\\\\");
            else if (c == '\n') o.append("\\n");
            else if (c == '\r') o.append("\\r");
            else if (c == '\t') o.append("\\t");
            else if (c == '\b') o.append("\\b");
            else if (c == '\f') o.append("\\f");
            else if (c < 0x20 || c > 0x7E) {
                String h = Integer.toHexString(c);
                o.append("\\u");
                for (int k = h.length(); k < 4; k++) o.append('0');
                o.append(h);
            } else o.append(c);
        }
        return o.append('"').toString();
    }

    /** repr(b) of a Python bytes object */
    static String pyBytesRepr(byte[] b) {
        boolean sq = false, dq = false;
        for (int i = 0; i < b.length; i++) {
            if (b[i] == '\'') sq = true;
            if (b[i] == '"') dq = true;
        }
        char q = sq && !dq ? '"' : '\'';
        StringBuilder o = new StringBuilder("b").append(q);
        for (int i = 0; i < b.length; i++) {
            int c = b[i] & 0xFF;
            if (c == q || c == '\\') o.append('\\').append((char) c);
            else if (c == '\t') o.append("\\t");
            else if (c == '\n') o.append("\\n");
            else if (c == '\r') o.append("\\r");
            else if (c < 0x20 || c >= 0x7F) {
                o.append("\\x");
                if (c < 16) o.append('0');
                o.append(Integer.toHexString(c));
            } else o.append((char) c);
        }
        return o.append(q).toString();
    }

    /** repr(s) of a Python str (ASCII text; what the option errors quote) */
    static String pyStrRepr(String s) {
        char q = s.indexOf('\'') >= 0 && s.indexOf('"') < 0 ? '"' : '\'';
        StringBuilder o = new StringBuilder().append(q);
        for (int i = 0; i < s.length(); i++) {
            char c = s.charAt(i);
            if (c == q || c == '\\') o.append('\\').append(c);
            else if (c == '\n') o.append("\\n");
            else if (c == '\t') o.append("\\t");
            else if (c == '\r') o.append("\\r");
            else o.append(c);
        }
        return o.append(q).toString();
    }

    /** bytes.decode("utf-8", "replace"): one U+FFFD per maximal invalid subpart (an
     *  encoded surrogate ED A0..BF is three, where Java's decoder gives one). */
    static String pyDecode(byte[] b, int off, int len) {
        if (Bodies.utf8(b, off, len)) return new String(b, off, len, StandardCharsets.UTF_8);
        StringBuilder o = new StringBuilder(len);
        int i = off;
        int end = off + len;
        while (i < end) {
            int c = b[i] & 0xFF;
            if (c < 0x80) { o.append((char) c); i++; continue; }
            int need;
            int lo = 0x80, hi = 0xBF;                   // the second byte's range
            if (c >= 0xC2 && c <= 0xDF) need = 1;
            else if (c >= 0xE0 && c <= 0xEF) {
                need = 2;
                if (c == 0xE0) lo = 0xA0;
                if (c == 0xED) hi = 0x9F;
            } else if (c >= 0xF0 && c <= 0xF4) {
                need = 3;
                if (c == 0xF0) lo = 0x90;
                if (c == 0xF4) hi = 0x8F;
            } else { o.append('\uFFFD'); i++; continue; }
            int cp = c & (0x3F >> need);
            int k = 1;
            for (; k <= need && i + k < end; k++) {
                int x = b[i + k] & 0xFF;
                if (k == 1 ? (x < lo || x > hi) : (x & 0xC0) != 0x80) break;
                cp = (cp << 6) | (x & 0x3F);
            }
            if (k <= need) { o.append('\uFFFD'); i += k; continue; }   // maximal subpart
            o.appendCodePoint(cp);
            i += need + 1;
        }
        return o.toString();
    }

    /** str(OSError) as Python words it for the usual causes (else Java's message). */
    static String osError(Throwable e, String path) {
        String m = String.valueOf(e.getMessage());
        if (e instanceof java.nio.file.NoSuchFileException)
            return "[Errno 2] No such file or directory: " + pyStrRepr(path);
        if (e instanceof java.nio.file.AccessDeniedException)
            return "[Errno 13] Permission denied: " + pyStrRepr(path);
        if (m.endsWith("Is a directory"))
            return "[Errno 21] Is a directory: " + pyStrRepr(path);
        return e.toString();
    }
}
