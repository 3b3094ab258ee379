/* The part of libzmq's API the bench's C tools use (zmq_latency.c, zmq_load.c,
 * samwise_req.c, durable_ack.c), declared here because pyzmq's wheel ships libzmq without
 * zmq.h.  The tools are built against that libzmq (bench_relay.py, bench_latency.py,
 * bench_samwise.py).  Values as in libzmq 4.3's zmq.h. */
#ifndef BENCH_ZMQ_API_H
#define BENCH_ZMQ_API_H

#include <stddef.h>

typedef struct zmq_msg_t { _Alignas(8) unsigned char _[64]; } zmq_msg_t;
typedef struct { void *socket; int fd; short events; short revents; } zmq_pollitem_t;

void *zmq_ctx_new(void);
int zmq_ctx_term(void *ctx);
void *zmq_socket(void *ctx, int type);
int zmq_close(void *s);
int zmq_setsockopt(void *s, int option, const void *val, size_t len);
int zmq_getsockopt(void *s, int option, void *val, size_t *len);
int zmq_bind(void *s, const char *addr);
int zmq_connect(void *s, const char *addr);
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

enum {
    /* socket types */
    ZMQ_PUB = 1, ZMQ_SUB = 2, ZMQ_REQ = 3, ZMQ_DEALER = 5, ZMQ_ROUTER = 6, ZMQ_PUSH = 8,
    /* socket options */
    ZMQ_SUBSCRIBE = 6, ZMQ_FD = 14, ZMQ_EVENTS = 15, ZMQ_LINGER = 17, ZMQ_SNDHWM = 23,
    ZMQ_RCVHWM = 24, ZMQ_RCVTIMEO = 27,
    /* send/recv flags, poll events */
    ZMQ_DONTWAIT = 1, ZMQ_SNDMORE = 2, ZMQ_POLLIN = 1
};

#endif
