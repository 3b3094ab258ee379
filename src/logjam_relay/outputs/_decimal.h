/* Decimal digits of an unsigned integer, for the C event mappings (_ljencode, _courierenc). */
#ifndef LJ_DECIMAL_H
#define LJ_DECIMAL_H

#include <stdint.h>

/* v in decimal at out (no terminator; out has room for 20 digits); returns the length */
static inline int u64dec(char *out, uint64_t v) {
    char tmp[20];
    int n = 0;
    do { tmp[n++] = (char)('0' + v % 10); v /= 10; } while (v);
    for (int i = 0; i < n; i++) out[i] = tmp[n - 1 - i];
    return n;
}

#endif
