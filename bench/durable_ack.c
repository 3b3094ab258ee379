/* durable_ack.c: the floor of a durable "202 Accepted" on this machine, for
 * bench_latency.py's `c-ack` and `c-durable` targets.
 *
 *     durable_ack ROUTER_ENDPOINT PUB_ENDPOINT FILE|-
 *
 * One thread and nothing else: wait for the ROUTER, take every request that is there
 * (a logjam request from a DEALER: "", app-env, topic, body, meta), publish it on PUB as
 * it came (zero-copy), append the bodies to FILE with one write(), fdatasync(FILE), then
 * send every request's reply ("", "202 Accepted") in the order they came.  FILE "-": no
 * write and no fdatasync (the same loop answering at once: `c-ack`).
 *
 * This is a group commit with no hand-off at all: no other thread to wake, nothing to
 * validate, stamp or number.  What `c-durable` adds to `c-ack` in the same run is what a
 * durable 202 costs on this disk and these cores at the least; the relay's `batch` against
 * its own no-spool run is to be read beside it.  Not a product: no spool format, no
 * recovery, no error replies (a malformed request is answered 202 too).
 *
 * Built by bench_latency.py with gcc against pyzmq's bundled libzmq, as zmq_latency.c.
 * Stops on SIGTERM or SIGINT.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <unistd.h>

/* libzmq's API, declared here as in zmq_latency.c (pyzmq's wheel has no zmq.h) */
typedef struct zmq_msg_t { _Alignas(8) unsigned char _[64]; } zmq_msg_t;
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;
void *zmq_ctx_new(void);
int zmq_ctx_term(void *ctx);
void *zmq_socket(void *ctx, int type);
int zmq_close(void *s);
int zmq_setsockopt(void *s, int option, const void *val, size_t len);
int zmq_bind(void *s, const char *addr);
int zmq_send(void *s, const void *buf, size_t len, int flags);
int zmq_poll(zmq_pollitem_t *items, int n, long timeout);
int zmq_msg_init(zmq_msg_t *msg);
int zmq_msg_move(zmq_msg_t *dest, zmq_msg_t *src);
int zmq_msg_recv(zmq_msg_t *msg, void *s, int flags);
int zmq_msg_send(zmq_msg_t *msg, void *s, int flags);
int zmq_msg_close(zmq_msg_t *msg);
void *zmq_msg_data(zmq_msg_t *msg);
size_t zmq_msg_size(const zmq_msg_t *msg);
int zmq_msg_more(const zmq_msg_t *msg);
int zmq_errno(void);
const char *zmq_strerror(int errnum);

enum { ZMQ_PUB = 1, ZMQ_ROUTER = 6, ZMQ_LINGER = 17, ZMQ_SNDHWM = 23, ZMQ_RCVHWM = 24,
       ZMQ_DONTWAIT = 1, ZMQ_SNDMORE = 2, ZMQ_POLLIN = 1 };

#define MAX_BATCH 4096          /* requests per round at most */
#define MAX_FRAMES 8            /* identity + "", app-env, topic, body, meta (+ spare) */

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: durable_ack ROUTER_ENDPOINT PUB_ENDPOINT FILE|-\n");
        return 2;
    }
    prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0);       /* ends with the bench */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;          /* no SA_RESTART: zmq_poll returns EINTR */
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    int fd = -1;
    if (strcmp(argv[3], "-") != 0) {
        fd = open(argv[3], O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0644);
        if (fd < 0) {
            perror(argv[3]);
            return 1;
        }
    }
    void *ctx = zmq_ctx_new();
    void *router = zmq_socket(ctx, ZMQ_ROUTER);
    void *pub = zmq_socket(ctx, ZMQ_PUB);
    int hwm = 100000, zero = 0;
    zmq_setsockopt(router, ZMQ_RCVHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(pub, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(router, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(pub, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(router, argv[1]) != 0 || zmq_bind(pub, argv[2]) != 0) {
        fprintf(stderr, "durable_ack: bind: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    static zmq_msg_t ids[MAX_BATCH];
    size_t cap = 1 << 20, len;
    char *buf = malloc(cap);
    if (buf == NULL)
        return 1;
    zmq_msg_t frame[MAX_FRAMES];
    for (int k = 0; k < MAX_FRAMES; k++)
        zmq_msg_init(&frame[k]);
    unsigned long long rounds = 0, requests = 0;
    while (!stop) {
        zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0)
            continue;
        int n = 0;
        len = 0;
        while (n < MAX_BATCH) {
            int nf = 0;
            for (;;) {
                zmq_msg_t *m = &frame[nf < MAX_FRAMES ? nf : MAX_FRAMES - 1];
                if (zmq_msg_recv(m, router, nf ? 0 : ZMQ_DONTWAIT) < 0)
                    break;
                nf++;
                if (!zmq_msg_more(m))
                    break;
            }
            if (nf == 0)
                break;
            zmq_msg_init(&ids[n]);
            zmq_msg_move(&ids[n], &frame[0]);
            /* frames 2.. (after the "" delimiter): app-env, topic, body, meta */
            int first = nf > 2 ? 2 : nf;
            for (int k = first; k < nf && k < MAX_FRAMES; k++) {
                size_t sz = zmq_msg_size(&frame[k]);
                if (k == 4 && fd >= 0) {              /* the body goes to the file */
                    while (len + sz > cap) {
                        cap *= 2;
                        buf = realloc(buf, cap);
                        if (buf == NULL)
                            return 1;
                    }
                    memcpy(buf + len, zmq_msg_data(&frame[k]), sz);
                    len += sz;
                }
                zmq_msg_send(&frame[k], pub,
                             k + 1 < nf && k + 1 < MAX_FRAMES ? ZMQ_SNDMORE | ZMQ_DONTWAIT
                                                              : ZMQ_DONTWAIT);
            }
            n++;
        }
        if (fd >= 0 && len) {
            size_t done = 0;
            while (done < len) {
                ssize_t w = write(fd, buf + done, len - done);
                if (w < 0 && errno == EINTR)
                    continue;
                if (w <= 0) {
                    perror("durable_ack: write");
                    return 1;
                }
                done += (size_t)w;
            }
            if (fdatasync(fd) != 0) {
                perror("durable_ack: fdatasync");
                return 1;
            }
        }
        for (int i = 0; i < n; i++) {
            zmq_msg_send(&ids[i], router, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
            zmq_send(router, "202 Accepted", 12, ZMQ_DONTWAIT);
            zmq_msg_close(&ids[i]);
        }
        rounds++;
        requests += (unsigned long long)n;
    }
    fprintf(stderr, "durable_ack: %llu requests in %llu rounds\n", requests, rounds);
    if (fd >= 0)
        close(fd);
    zmq_close(router);
    zmq_close(pub);
    zmq_ctx_term(ctx);
    free(buf);
    return 0;
}
