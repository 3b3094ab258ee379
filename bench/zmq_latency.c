/* Fixed-rate latency tool for bench_latency.py: sends logjam messages on a fixed schedule
 * and measures, without coordinated omission, how long after its *scheduled* send time
 * each message was answered (DEALER: the "202 Accepted" reply) and published (a SUB on
 * the device's PUB socket).
 *
 * Built by bench_latency.py with gcc against the libzmq that pyzmq bundles; no zmq.h is
 * needed, the few prototypes used are declared in zmq_api.h (ABI of libzmq 4.x).
 *
 *   zmq_latency ENDPOINT push|dealer|dealer-noreply RATE SECONDS SUB_ENDPOINT|-
 *               [TICK_US [WAIT_S]]
 *
 * dealer-noreply: a DEALER towards a device that does not answer (zmq.proxy's ROUTER).
 *
 * Message i (i = 0 .. RATE*SECONDS-1) is due at t0 + i/RATE.  Every TICK_US microseconds
 * (default 200) the sender sends everything that is due, without blocking: when the
 * socket's queue is full (the device pushes back) the rest waits for the next tick, and
 * its latency keeps counting from the schedule, so a stall shows in the figures instead
 * of slowing the load down.  TICK_US 0: per message, no ticks -- the sender sleeps until
 * the next message is due and sends it alone (as real agents do: each request on its
 * own, when it ends); only a sender that fell behind sends what is overdue together.
 * RATE 0: as fast as the socket takes them (an ingest rate; latencies are then measured
 * from the actual send time and mean little).
 *
 * Each body carries the message's index (a fixed-width hex "request_id"), so the SUB side
 * matches published messages to their schedule; replies come back in order on the DEALER
 * (the device answers in arrival order), so the k-th reply answers the k-th request.
 * Before the timed phase, warm-up messages (topic logs.warmup) are sent every 10 ms until
 * the SUB saw one and (DEALER) one was answered (slow joiner).  After the last send, the
 * tool waits up to WAIT_S seconds (default 10) for the missing replies and publications.
 *
 * Prints one line:
 *   result sent=N send_s=S late_max_ms=L replies=K r_p50=.. r_p99=.. r_p999=.. r_max=..
 *          r_rate=.. pubs=M p_p50=.. p_p99=.. p_p999=.. p_max=.. p_rate=..
 * latencies in milliseconds; r_rate / p_rate: messages answered / published per second,
 * from the first scheduled send to the last one received.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "zmq_api.h"  /* libzmq's API (pyzmq's wheel has no zmq.h) */

#define BODY_LEN 300
#define MARK "\"request_id\":\""

static const char APP[] = "bench-test";
static const char TOPIC[] = "logs.bench";
static const char WARM_TOPIC[] = "logs.warmup";

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static unsigned char body[BODY_LEN], warm_body[BODY_LEN], meta[24];
static size_t id_off;                 /* where the 16 hex digits of the index start */

static void make_bodies(void) {
    char head[BODY_LEN + 1];
    int n = snprintf(head, sizeof head,
                     "{\"action\":\"Bench#index\",\"code\":200,\"total_time\":12.5,"
                     "\"severity\":1,\"started_ms\":1700000000123,%s", MARK);
    id_off = (size_t)n;
    memcpy(body, head, n);
    memset(body + n, '0', 16);
    const char *rest = "\",\"message\":\"";
    memcpy(body + n + 16, rest, strlen(rest));
    size_t k = n + 16 + strlen(rest);
    memset(body + k, 'x', BODY_LEN - k - 2);
    body[BODY_LEN - 2] = '"';
    body[BODY_LEN - 1] = '}';
    memcpy(warm_body, body, BODY_LEN);
    memcpy(warm_body + id_off, "warmupwarmupwarm", 16);
    /* meta: tag CABD, no compression, version 1, device 0, created_ms, sequence 1 */
    uint64_t created = 1700000000123ULL, seq = 1;
    meta[0] = 0xCA; meta[1] = 0xBD; meta[2] = 0; meta[3] = 1;
    memset(meta + 4, 0, 4);
    for (int i = 0; i < 8; i++) {
        meta[8 + i] = (unsigned char)(created >> (56 - 8 * i));
        meta[16 + i] = (unsigned char)(seq >> (56 - 8 * i));
    }
}

static void put_index(unsigned char *b, uint64_t i) {
    static const char hex[] = "0123456789abcdef";
    for (int k = 15; k >= 0; k--, i >>= 4) b[id_off + k] = hex[i & 15];
}

/* index from a published body; -1: not a timed message, -2: a warm-up one */
static int64_t get_index(const unsigned char *d, size_t len) {
    if (len != BODY_LEN || memcmp(d + id_off - strlen(MARK), MARK, strlen(MARK)) != 0)
        return -1;
    if (memcmp(d + id_off, "warmupwarmupwarm", 16) == 0) return -2;
    uint64_t v = 0;
    for (int k = 0; k < 16; k++) {
        unsigned c = d[id_off + k];
        v = v * 16 + (c <= '9' ? c - '0' : c - 'a' + 10);
    }
    return (int64_t)v;
}

/* ---------------------------------------------------------------- shared state */
static long n_msgs;
static int64_t t0, period_ns;          /* schedule: t0 + i * period_ns */
static int64_t *sched;                 /* actual schedule reference (RATE 0: send time) */
static int64_t *pub_at, *reply_at;     /* receive times, 0 = not received */
static volatile int sub_seen_warm, stop_sub, timed_started;
static volatile long pubs_got;
static volatile int64_t pub_last;

static void *sub_thread(void *arg) {
    void *s = arg;
    zmq_msg_t msg;
    zmq_msg_init(&msg);
    while (!stop_sub) {
        int64_t idx = -1;
        int got_frame = 0;
        for (;;) {
            if (zmq_msg_recv(&msg, s, 0) < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                perror("zmq_latency: sub recv");
                return NULL;
            }
            got_frame = 1;
            int64_t k = get_index(zmq_msg_data(&msg), zmq_msg_size(&msg));
            if (k != -1) idx = k;
            if (!zmq_msg_more(&msg)) break;
        }
        if (!got_frame) continue;
        int64_t t = now_ns();
        if (idx == -2) sub_seen_warm = 1;
        else if (idx >= 0 && idx < n_msgs && !pub_at[idx]) {
            pub_at[idx] = t;
            pubs_got++;
            pub_last = t;
        }
    }
    zmq_msg_close(&msg);
    return NULL;
}

static int send_msg(void *s, int dealer, const unsigned char *b, const char *topic) {
    if (dealer) {
        if (zmq_send(s, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) return -1;
        zmq_send(s, APP, strlen(APP), ZMQ_SNDMORE);
    } else if (zmq_send(s, APP, strlen(APP), ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) {
        return -1;
    }
    /* the first frame was taken: libzmq takes the rest of a multipart message */
    zmq_send(s, topic, strlen(topic), ZMQ_SNDMORE);
    zmq_send(s, b, BODY_LEN, ZMQ_SNDMORE);
    zmq_send(s, meta, sizeof meta, 0);
    return 0;
}

static long warm_sent, replies_seen;   /* replies_seen counts warm-up replies too */
static long replies_got;
static int64_t reply_last;

static void take_replies(void *s, zmq_msg_t *msg) {
    for (;;) {
        int frames = 0;
        for (;;) {
            if (zmq_msg_recv(msg, s, ZMQ_DONTWAIT) < 0) break;
            frames++;
            if (!zmq_msg_more(msg)) break;
        }
        if (!frames) return;
        int64_t t = now_ns();
        long k = replies_seen++ - warm_sent;
        if (timed_started && k >= 0 && k < n_msgs) {
            reply_at[k] = t;
            replies_got++;
            reply_last = t;
        }
    }
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void summary(const char *p, const int64_t *at, long got, int64_t last) {
    int64_t *lat = malloc(sizeof(int64_t) * (got ? got : 1));
    long k = 0;
    for (long i = 0; i < n_msgs; i++)
        if (at[i]) lat[k++] = at[i] - sched[i];
    qsort(lat, k, sizeof *lat, cmp64);
#define PCT(q) (k ? lat[(long)((q) * (k - 1) + 0.5)] / 1e6 : -1.0)
    printf(" %ss=%ld %s_p50=%.3f %s_p99=%.3f %s_p999=%.3f %s_max=%.3f %s_rate=%.0f",
           p[0] == 'r' ? "replie" : "pub", k, p, PCT(0.5), p, PCT(0.99), p, PCT(0.999), p,
           k ? lat[k - 1] / 1e6 : -1.0, p, k && last > t0 ? k / ((last - t0) / 1e9) : 0.0);
    free(lat);
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: zmq_latency ENDPOINT push|dealer|dealer-noreply RATE SECONDS SUB_ENDPOINT|- "
                        "[TICK_US [WAIT_S]]\n");
        return 2;
    }
    const char *ep = argv[1];
    /* dealer-noreply: a DEALER whose device does not answer (zmq.proxy): one-way only */
    int dealer = strncmp(argv[2], "dealer", 6) == 0;
    int want_replies = strcmp(argv[2], "dealer") == 0;
    double rate = atof(argv[3]), secs = atof(argv[4]);
    const char *sub_ep = strcmp(argv[5], "-") == 0 ? NULL : argv[5];
    long tick_us = argc > 6 ? atol(argv[6]) : 200;
    double wait_s = argc > 7 ? atof(argv[7]) : 10.0;
    if (!dealer && !sub_ep) {
        fprintf(stderr, "zmq_latency: push needs a SUB endpoint to measure anything\n");
        return 2;
    }
    prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);        /* wake-ups within ~1 us */
    make_bodies();
    n_msgs = rate > 0 ? (long)(rate * secs) : (long)secs;  /* RATE 0: SECONDS = count */
    period_ns = rate > 0 ? (int64_t)(1e9 / rate) : 0;
    sched = calloc(n_msgs, sizeof(int64_t));
    pub_at = calloc(n_msgs, sizeof(int64_t));
    reply_at = calloc(n_msgs, sizeof(int64_t));

    void *ctx = zmq_ctx_new();
    void *s = zmq_socket(ctx, dealer ? ZMQ_DEALER : ZMQ_PUSH);
    int hwm = 1000000, linger = 0, zero = 0, timeo = 100;
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_connect(s, ep)) { perror("zmq_latency: connect"); return 1; }
    void *sub = NULL;
    pthread_t th;
    if (sub_ep) {
        sub = zmq_socket(ctx, ZMQ_SUB);
        zmq_setsockopt(sub, ZMQ_RCVHWM, &zero, sizeof zero);
        zmq_setsockopt(sub, ZMQ_RCVTIMEO, &timeo, sizeof timeo);
        zmq_setsockopt(sub, ZMQ_LINGER, &linger, sizeof linger);
        zmq_setsockopt(sub, ZMQ_SUBSCRIBE, "", 0);
        if (zmq_connect(sub, sub_ep)) { perror("zmq_latency: connect sub"); return 1; }
        pthread_create(&th, NULL, sub_thread, sub);
    } else {
        sub_seen_warm = 1;
    }
    zmq_msg_t msg;
    zmq_msg_init(&msg);

    /* warm-up: until the SUB saw one and (DEALER) one was answered, at most 30 s */
    int64_t warm_end = now_ns() + 30 * 1000000000LL;
    while (!(sub_seen_warm && (!want_replies || replies_seen > 0))) {
        if (now_ns() > warm_end) {
            fprintf(stderr, "zmq_latency: no answer to the warm-up in 30 s\n");
            return 1;
        }
        if (send_msg(s, dealer, warm_body, WARM_TOPIC) == 0) warm_sent++;
        usleep(10000);
        if (dealer) take_replies(s, &msg);
    }
    /* the remaining warm-up replies, so they are not taken for timed ones */
    int64_t settle = now_ns() + 200000000LL;
    while (want_replies && replies_seen < warm_sent && now_ns() < settle) {
        take_replies(s, &msg);
        usleep(1000);
    }

    int fd = -1;
    size_t fdlen = sizeof fd;
    if (dealer) zmq_getsockopt(s, ZMQ_FD, &fd, &fdlen);
    int64_t tick_ns = tick_us * 1000, late_max = 0;
    long i = 0;
    t0 = now_ns() + 1000000;
    timed_started = 1;
    if (rate > 0)
        for (long k = 0; k < n_msgs; k++) sched[k] = t0 + k * period_ns;
    int64_t next_tick = t0;
    /* TICK_US 0: per message -- the next wake-up is the next message's due time */
    int per_msg = tick_ns == 0 && rate > 0;
    while (i < n_msgs) {
        int64_t t = now_ns();
        if (t >= next_tick) {
            /* everything due by now */
            int refused = 0;
            while (i < n_msgs && (rate <= 0 || sched[i] <= t)) {
                put_index(body, (uint64_t)i);
                if (send_msg(s, dealer, body, TOPIC) < 0) {   /* full: next tick */
                    refused = 1;
                    break;
                }
                int64_t ts = now_ns();
                if (rate <= 0) sched[i] = ts;
                else if (ts - sched[i] > late_max) late_max = ts - sched[i];
                i++;
                if (rate <= 0 && (i & 1023) == 0) break;          /* let replies in */
            }
            if (!per_msg) next_tick = t + tick_ns;
            else if (refused || i >= n_msgs) next_tick = t + 20000;  /* full: 20 us */
            else next_tick = sched[i];
        }
        if (dealer) {
            take_replies(s, &msg);
            /* sleep until the next tick or until the DEALER has something */
            int64_t left = next_tick - now_ns();
            if (left > 0) {
                int events = 0;
                size_t el = sizeof events;
                zmq_getsockopt(s, ZMQ_EVENTS, &events, &el);
                if (!(events & ZMQ_POLLIN)) {
                    struct pollfd p = { .fd = fd, .events = POLLIN };
                    struct timespec ts = { left / 1000000000, left % 1000000000 };
                    ppoll(&p, 1, &ts, NULL);
                }
            }
        } else {
            int64_t left = next_tick - now_ns();
            if (left > 0) {
                struct timespec ts = { left / 1000000000, left % 1000000000 };
                nanosleep(&ts, NULL);
            }
        }
    }
    int64_t send_end = now_ns();
    /* wait for the missing answers */
    int64_t deadline = send_end + (int64_t)(wait_s * 1e9);
    for (;;) {
        int done_r = !want_replies || replies_got >= n_msgs;
        int done_p = !sub_ep || pubs_got >= n_msgs;
        if ((done_r && done_p) || now_ns() > deadline) break;
        if (dealer) take_replies(s, &msg);
        /* no news for 3 s after everything was sent: they are lost, do not wait longer */
        int64_t last = reply_last > pub_last ? reply_last : pub_last;
        if (now_ns() - (last > send_end ? last : send_end) > 3000000000LL) break;
        usleep(200);
    }
    stop_sub = 1;
    if (sub_ep) pthread_join(th, NULL);
    printf("result sent=%ld send_s=%.3f late_max_ms=%.3f", i, (send_end - t0) / 1e9,
           late_max / 1e6);
    if (want_replies) summary("r", reply_at, replies_got, reply_last);
    if (sub_ep) summary("p", pub_at, pubs_got, pub_last);
    printf("\n");
    fflush(stdout);
    zmq_msg_close(&msg);
    zmq_close(s);
    if (sub) zmq_close(sub);
    zmq_ctx_term(ctx);
    return 0;
}
