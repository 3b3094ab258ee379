/* durable_ack.c: the floor of a durable "202 Accepted" on this machine, for
 * bench_latency.py's `c-ack` and `c-durable` targets.
 *
 *     durable_ack ROUTER_ENDPOINT PUB_ENDPOINT FILE|- [thread]
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
 * its own no-spool run is to be read beside it.
 *
 * "thread" (`c-durable-thread`): the relay's shape in C -- the loop writes a group and hands
 * its fdatasync to a second thread (a condition variable), goes on draining, publishing and
 * gathering the next group meanwhile, and sends the group's replies when the thread says
 * so (an eventfd in the loop's poll); the next group's write and sync start then.  What it
 * adds to `c-durable` is what the hand-off between two threads costs here, without Python.  Not a product: no spool format, no
 * recovery, no error replies (a malformed request is answered 202 too).
 *
 * Built by bench_latency.py with gcc against pyzmq's bundled libzmq, as zmq_latency.c.
 * Stops on SIGTERM or SIGINT.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <unistd.h>

#include "zmq_api.h"  /* libzmq's API (pyzmq's wheel has no zmq.h) */

#define MAX_BATCH 4096          /* requests per group at most */
#define MAX_FRAMES 8            /* identity + "", app-env, topic, body, meta (+ spare) */

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

typedef struct {
    zmq_msg_t ids[MAX_BATCH];   /* the requests' routing ids, in order */
    int n;
    char *buf;                  /* their bodies, for the file */
    size_t len, cap;
} group_t;

static zmq_msg_t frame[MAX_FRAMES];

/* take what the ROUTER has (up to the group's room): publish each request, keep its id
 * and (keep_body) its body */
static void drain(void *router, void *pub, group_t *g, int keep_body) {
    while (g->n < MAX_BATCH) {
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
            return;
        zmq_msg_init(&g->ids[g->n]);
        zmq_msg_move(&g->ids[g->n], &frame[0]);
        /* frames 2.. (after the "" delimiter): app-env, topic, body, meta */
        for (int k = nf > 2 ? 2 : nf; k < nf && k < MAX_FRAMES; k++) {
            size_t sz = zmq_msg_size(&frame[k]);
            if (k == 4 && keep_body) {
                while (g->len + sz > g->cap) {
                    g->cap = g->cap ? 2 * g->cap : 1 << 20;
                    g->buf = realloc(g->buf, g->cap);
                    if (g->buf == NULL)
                        exit(1);
                }
                memcpy(g->buf + g->len, zmq_msg_data(&frame[k]), sz);
                g->len += sz;
            }
            zmq_msg_send(&frame[k], pub, k + 1 < nf && k + 1 < MAX_FRAMES
                                             ? ZMQ_SNDMORE | ZMQ_DONTWAIT : ZMQ_DONTWAIT);
        }
        g->n++;
    }
}

static void write_group(int fd, group_t *g) {
    size_t done = 0;
    while (done < g->len) {
        ssize_t w = write(fd, g->buf + done, g->len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            perror("durable_ack: write");
            exit(1);
        }
        done += (size_t)w;
    }
}

static void sync_file(int fd) {
    if (fdatasync(fd) != 0) {
        perror("durable_ack: fdatasync");
        exit(1);
    }
}

static void reply(void *router, group_t *g) {
    for (int i = 0; i < g->n; i++) {
        zmq_msg_send(&g->ids[i], router, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(router, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT);
        zmq_send(router, "202 Accepted", 12, ZMQ_DONTWAIT);
        zmq_msg_close(&g->ids[i]);
    }
    g->n = 0;
    g->len = 0;
}

/* the "thread" mode's second thread: fdatasync when told, then write the eventfd */
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int job, quit, sync_fd, notify_fd;

static void *syncer(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!job && !quit)
            pthread_cond_wait(&cv, &mu);
        if (!job)
            break;
        job = 0;
        pthread_mutex_unlock(&mu);
        sync_file(sync_fd);
        uint64_t one = 1;
        while (write(notify_fd, &one, sizeof one) < 0 && errno == EINTR) {
        }
        pthread_mutex_lock(&mu);
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 4 && !(argc == 5 && strcmp(argv[4], "thread") == 0)) {
        fprintf(stderr, "usage: durable_ack ROUTER_ENDPOINT PUB_ENDPOINT FILE|- [thread]\n");
        return 2;
    }
    int threaded = argc == 5;
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
    } else if (threaded) {
        fprintf(stderr, "durable_ack: thread needs a FILE\n");
        return 2;
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
    for (int k = 0; k < MAX_FRAMES; k++)
        zmq_msg_init(&frame[k]);
    static group_t groups[2];
    group_t *next = &groups[0], *syncing = &groups[1];
    unsigned long long rounds = 0, requests = 0;
    if (!threaded) {
        /* drain, write, fdatasync, reply: one group at a time */
        while (!stop) {
            zmq_pollitem_t it = {router, 0, ZMQ_POLLIN, 0};
            if (zmq_poll(&it, 1, 100) <= 0)
                continue;
            drain(router, pub, next, fd >= 0);
            if (!next->n)
                continue;
            if (fd >= 0 && next->len) {
                write_group(fd, next);
                sync_file(fd);
            }
            requests += (unsigned long long)next->n;
            rounds++;
            reply(router, next);
        }
    } else {
        pthread_t th;
        sync_fd = fd;
        notify_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        pthread_create(&th, NULL, syncer, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        int busy = 0;
        while (!stop) {
            zmq_pollitem_t it[2] = {{router, 0, ZMQ_POLLIN, 0}, {NULL, notify_fd, ZMQ_POLLIN, 0}};
            if (zmq_poll(it, 2, 100) < 0)
                continue;
            if (it[1].revents & ZMQ_POLLIN) {
                uint64_t v;
                if (read(notify_fd, &v, sizeof v) == sizeof v && busy) {
                    requests += (unsigned long long)syncing->n;
                    rounds++;
                    reply(router, syncing);
                    busy = 0;
                }
            }
            drain(router, pub, next, 1);
            if (!busy && next->n) {
                /* the group's write on this thread (no write while a sync runs), its
                 * fdatasync on the other; the next group gathers meanwhile */
                write_group(fd, next);
                group_t *t = syncing;
                syncing = next;
                next = t;
                busy = 1;
                pthread_mutex_lock(&mu);
                job = 1;
                pthread_mutex_unlock(&mu);
                pthread_cond_signal(&cv);
            }
        }
        pthread_mutex_lock(&mu);
        quit = 1;
        pthread_mutex_unlock(&mu);
        pthread_cond_signal(&cv);
        pthread_join(th, NULL);
    }
    fprintf(stderr, "durable_ack: %llu requests in %llu rounds\n", requests, rounds);
    if (fd >= 0)
        close(fd);
    zmq_close(router);
    zmq_close(pub);
    zmq_ctx_term(ctx);
    return 0;
}
