/* A samcli-like samwise client for bench_samwise.py, in C like samwise's own samcli, so
 * that the client is not what limits a single REQ client's rate (a Python REQ client
 * costs ~60 us of its own per round trip on these machines).
 *
 * Built by bench_samwise.py against the libzmq that pyzmq bundles; no zmq.h is needed.
 *
 *   samwise_req ENDPOINT N FRAMES_FILE
 *       FRAMES_FILE: <u32 BE frame count> then each frame as <u32 BE length><bytes>.
 *       REQ socket: sends the request, waits for the reply, N times (one outstanding
 *       request, as samcli does).  Prints "ready" after a first (untimed) request, waits
 *       for a line on stdin, then prints "done <seconds> <replies that were not [0,...]>".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "zmq_api.h"  /* libzmq's API (pyzmq's wheel has no zmq.h) */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static uint32_t be32(const unsigned char *h) {
    return ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) | ((uint32_t)h[2] << 8) | h[3];
}

/* one request/reply; returns 1 if the reply's first frame is "0", 0 if not, -1 on error */
static int roundtrip(void *s, unsigned n, unsigned char **data, size_t *len) {
    for (unsigned i = 0; i < n; i++)
        if (zmq_send(s, data[i], len[i], i + 1 < n ? ZMQ_SNDMORE : 0) < 0) {
            perror("zmq_send");
            return -1;
        }
    int ok = 0, first = 1, more = 1;
    while (more) {
        zmq_msg_t msg;
        zmq_msg_init(&msg);
        if (zmq_msg_recv(&msg, s, 0) < 0) {
            perror("zmq_msg_recv");
            return -1;
        }
        if (first)
            ok = zmq_msg_size(&msg) == 1 && *(char *)zmq_msg_data(&msg) == '0';
        first = 0;
        more = zmq_msg_more(&msg);
        zmq_msg_close(&msg);
    }
    return ok;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: samwise_req ENDPOINT N FRAMES_FILE\n");
        return 2;
    }
    long count = atol(argv[2]);
    FILE *fh = fopen(argv[3], "rb");
    unsigned char h[4];
    if (!fh || fread(h, 1, 4, fh) != 4) {
        perror(argv[3]);
        return 2;
    }
    unsigned n = be32(h);
    if (n == 0 || n > 1000) return 2;
    unsigned char **data = calloc(n, sizeof *data);
    size_t *len = calloc(n, sizeof *len);
    for (unsigned i = 0; i < n; i++) {
        if (fread(h, 1, 4, fh) != 4) return 2;
        len[i] = be32(h);
        data[i] = malloc(len[i] ? len[i] : 1);
        if (fread(data[i], 1, len[i], fh) != len[i]) return 2;
    }
    fclose(fh);
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_REQ);
    int zero = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_connect(s, argv[1]) < 0) {
        perror("zmq_connect");
        return 2;
    }
    if (roundtrip(s, n, data, len) < 0) return 1;
    printf("ready\n");
    fflush(stdout);
    char line[64];
    if (!fgets(line, sizeof line, stdin)) return 1;
    long bad = 0;
    double t0 = now();
    for (long k = 0; k < count; k++) {
        int r = roundtrip(s, n, data, len);
        if (r < 0) return 1;
        bad += !r;
    }
    double t1 = now();
    printf("done %.6f %ld\n", t1 - t0, bad);
    fflush(stdout);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}
