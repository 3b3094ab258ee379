/*
 * The JVM reader's fast zlib path (_fastinflate.h: libdeflate behind zlib's rules) as a
 * JNI library, and the same functions for Python's ctypes (the tests).
 *
 * JNI without jni.h: the entry points take only primitives (jlong = int64_t, jint =
 * int32_t; the JNIEnv and jclass arguments are not used), and the Java side passes the
 * addresses of native buffers it allocated (Spark's Platform.allocateMemory), so no array
 * is pinned and no JNI function is called.
 */
#include "_fastinflate.h"

/* for the tests (ctypes): the functions of _fastinflate.h */
int ljr_inflate_available(void) { return fi_available(); }
void *ljr_inflate_open(void) { return fi_open(); }
void ljr_inflate_close(void *d) { fi_close(d); }
int ljr_inflate_guard(const uint8_t *in, size_t n) { return fi_guard(in, n); }
int32_t ljr_inflate(void *d, const uint8_t *in, int32_t n, uint8_t *out, int32_t cap) {
    return fi_inflate(d, in, n, out, cap);
}

/* JNI entry points of logjamrelay.spark.NativeInflate (primitives only) */
int32_t Java_logjamrelay_spark_NativeInflate_available(void *env, void *cls) {
    (void)env; (void)cls;
    return fi_available();
}

int64_t Java_logjamrelay_spark_NativeInflate_open(void *env, void *cls) {
    (void)env; (void)cls;
    return (int64_t)(intptr_t)fi_open();
}

void Java_logjamrelay_spark_NativeInflate_close(void *env, void *cls, int64_t d) {
    (void)env; (void)cls;
    fi_close((void *)(intptr_t)d);
}

int32_t Java_logjamrelay_spark_NativeInflate_inflate(void *env, void *cls, int64_t d,
                                                     int64_t in, int32_t n, int64_t out,
                                                     int32_t cap) {
    (void)env; (void)cls;
    return fi_inflate((void *)(intptr_t)d, (const uint8_t *)(intptr_t)in, n,
                       (uint8_t *)(intptr_t)out, cap);
}
