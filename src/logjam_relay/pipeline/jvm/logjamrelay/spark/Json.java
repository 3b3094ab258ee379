package logjamrelay.spark;

/** The bits of Python's json.dumps (ensure_ascii) and bytes repr the error rows need. */
final class Json {
    private Json() {}

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
}
