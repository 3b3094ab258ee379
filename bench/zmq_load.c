/* Load generator and counter for bench_relay.py, in C, so that neither limits the
 * figures (a Python SUB tops out near 110-190k msg/s, a Python PUSH near 310k).
 *
 * Built by bench_relay.py against the libzmq that pyzmq bundles; no zmq.h is needed,
 * the few prototypes used are declared in zmq_api.h (ABI of libzmq 4.x).
 *
 *   zmq_load gen   ENDPOINT push|dealer N FRAMES_FILE
 *       FRAMES_FILE holds two messages (warm-up, timed), each as 4 frames of
 *       <u32 big-endian length><bytes>. Sends warm-up messages every 10 ms until a line
 *       arrives on stdin, then N timed messages; prints "gen <seconds>".
 *   zmq_load count ENDPOINT N TOPIC WARMUP_TOPIC
 *       SUB to everything. Prints "ready" once connected, "go" at the first warm-up
 *       message, then counts messages whose frame 1 or 2 equals TOPIC; prints
 *       "count <seconds from first to last> <received>" after N, or after 5 s of silence.
 */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "zmq_api.h"  /* libzmq's API (pyzmq's wheel has no zmq.h) */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct { unsigned char *data[4]; size_t len[4]; } message;

static int read_message(FILE *fh, message *m) {
    for (int i = 0; i < 4; i++) {
        unsigned char h[4];
        if (fread(h, 1, 4, fh) != 4) return -1;
        m->len[i] = ((size_t)h[0] << 24) | (h[1] << 16) | (h[2] << 8) | h[3];
        m->data[i] = malloc(m->len[i] ? m->len[i] : 1);
        if (fread(m->data[i], 1, m->len[i], fh) != m->len[i]) return -1;
    }
    return 0;
}

static void send_message(void *s, const message *m) {
    for (int i = 0; i < 4; i++)
        if (zmq_send(s, m->data[i], m->len[i], i < 3 ? ZMQ_SNDMORE : 0) < 0) {
            perror("zmq_send");
            exit(1);
        }
}

static int gen(const char *endpoint, const char *kind, long n, const char *path) {
    FILE *fh = fopen(path, "rb");
    message warm, timed;
    if (!fh || read_message(fh, &warm) || read_message(fh, &timed)) {
        fprintf(stderr, "zmq_load: cannot read %s\n", path);
        return 2;
    }
    fclose(fh);
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, strcmp(kind, "dealer") == 0 ? ZMQ_DEALER : ZMQ_PUSH);
    int hwm = 100000, linger = -1;
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(s, endpoint)) { perror("zmq_connect"); return 1; }
    struct pollfd pfd = { .fd = 0, .events = POLLIN };
    while (poll(&pfd, 1, 10) == 0) send_message(s, &warm);   /* until "go" on stdin */
    double t0 = now();
    for (long i = 0; i < n; i++) send_message(s, &timed);
    printf("gen %.6f\n", now() - t0);
    fflush(stdout);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}

static int count(const char *endpoint, long n, const char *topic, const char *warm) {
    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, ZMQ_SUB);
    int hwm = 0, timeo = 5000;
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_SUBSCRIBE, "", 0);
    zmq_setsockopt(s, ZMQ_RCVTIMEO, &timeo, sizeof timeo);
    if (zmq_connect(s, endpoint)) { perror("zmq_connect"); return 1; }
    printf("ready\n");
    fflush(stdout);
    size_t tlen = strlen(topic), wlen = strlen(warm);
    int said_go = 0;
    long got = 0;
    double t0 = 0, t_last = 0;
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    int waited_ms = 0;
    while (got < n) {
        int frame = 0, hit = 0, warmup = 0;
        for (;;) {
            if (zmq_msg_recv(&msg, s, 0) < 0) {
                if (errno == EAGAIN) {           /* 5 s of silence */
                    if (got > 0 || (waited_ms += 5000) >= 60000) goto out;
                    continue;
                }
                if (errno == EINTR) continue;
                perror("zmq_msg_recv");
                return 1;
            }
            if (frame == 1 || frame == 2) {
                size_t len = zmq_msg_size(&msg);
                const char *d = zmq_msg_data(&msg);
                if (len == tlen && memcmp(d, topic, tlen) == 0) hit = 1;
                if (len == wlen && memcmp(d, warm, wlen) == 0) warmup = 1;
            }
            frame++;
            if (!zmq_msg_more(&msg)) break;
        }
        if (warmup && !said_go) {
            said_go = 1;
            printf("go\n");
            fflush(stdout);
        }
        if (hit) {
            if (got == 0) t0 = now();
            got++;
            t_last = now();
        }
    }
out:
    printf("count %.6f %ld\n", t_last - t0, got);
    fflush(stdout);
    zmq_msg_close(&msg);
    zmq_close(s);
    zmq_ctx_term(ctx);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 6 && strcmp(argv[1], "gen") == 0)
        return gen(argv[2], argv[3], atol(argv[4]), argv[5]);
    if (argc == 6 && strcmp(argv[1], "count") == 0)
        return count(argv[2], atol(argv[3]), argv[4], argv[5]);
    fprintf(stderr, "usage: zmq_load gen ENDPOINT push|dealer N FRAMES_FILE\n"
                    "       zmq_load count ENDPOINT N TOPIC WARMUP_TOPIC\n");
    return 2;
}
