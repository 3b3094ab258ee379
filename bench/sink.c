/* Benchmark receivers that are not the bottleneck: Lumberjack v1 and Courier, in C.
 *
 * Built by bench_durable.py with `cc -O2 sink.c -lz`.  Plain TCP (no TLS), one thread,
 * poll() over every connection; each connection is parsed incrementally.
 *
 *   sink lumberjack PORT      go-lumber behaviour: W starts a window; D (and v2 J) frames
 *                             are counted, C frames (zlib) are inflated and their inner
 *                             frames counted; once the window's count is reached
 *                             `1A <count>` is written (the writer numbers each window
 *                             1..count, so count == last sequence too).
 *   sink courier PORT [jdat]  HELO -> VERS (EVNT flag advertised unless "jdat"), PING ->
 *                             PONG, JDAT (nonce + zlib) and streamed EVNT (nonce + zlib
 *                             stream up to its end) are inflated, their [len][json] events
 *                             counted and acknowledged with ACKN <nonce> <count>;
 *                             unknown types -> "????".
 *
 * PORT 0 picks a free port.  Prints "port N" once listening.  Every line read on stdin is
 * answered with "count <events> <payloads> <bytes_in> <errors>"; EOF on stdin ends it.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zlib.h>

#define MAXCONN 64

typedef struct {
    int fd;
    unsigned char *buf;          /* unparsed input */
    size_t len, cap;
    /* lumberjack */
    uint32_t window, in_window;
    /* courier EVNT streaming */
    int streaming;
    z_stream zs;
    unsigned char nonce[16];
    uint32_t ev_count;
    unsigned char lenbuf[4];
    int lenhave;
    uint64_t skip;               /* bytes of the current event still to skip */
} conn;

static conn conns[MAXCONN];
static int nconns;
static int proto_lj;             /* 1 lumberjack, 0 courier */
static int advertise_evnt = 1;
static unsigned long long events, payloads, bytes_in, errors;
static unsigned char *inflate_buf;
static size_t inflate_cap;

static uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static int write_all(int fd, const unsigned char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pf = { .fd = fd, .events = POLLOUT };
                poll(&pf, 1, 1000);
                continue;
            }
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* whole-buffer inflate into inflate_buf; returns length or -1 */
static long inflate_all(const unsigned char *src, size_t n) {
    z_stream zs;
    memset(&zs, 0, sizeof zs);
    if (inflateInit(&zs) != Z_OK) return -1;
    zs.next_in = (unsigned char *)src;
    zs.avail_in = (uInt)n;
    size_t out = 0;
    int rc;
    for (;;) {
        if (inflate_cap - out < 65536) {
            inflate_cap = inflate_cap ? inflate_cap * 2 : 1 << 20;
            inflate_buf = realloc(inflate_buf, inflate_cap);
        }
        zs.next_out = inflate_buf + out;
        zs.avail_out = (uInt)(inflate_cap - out);
        rc = inflate(&zs, Z_NO_FLUSH);
        out = inflate_cap - zs.avail_out;
        if (rc == Z_STREAM_END) break;
        if (rc != Z_OK && rc != Z_BUF_ERROR) break;
        if (zs.avail_in == 0 && zs.avail_out > 0) { rc = Z_OK; break; }  /* no final block */
    }
    inflateEnd(&zs);
    if (rc != Z_STREAM_END && rc != Z_OK) return -1;
    return (long)out;
}

/* ------------------------------------------------------------------ lumberjack */

static int lj_event(conn *c) {
    events++;
    c->in_window++;
    if (c->window && c->in_window == c->window) {
        unsigned char ack[6] = { '1', 'A' };
        put32(ack + 2, c->window);
        c->in_window = 0;
        payloads++;
        return write_all(c->fd, ack, 6);
    }
    return 0;
}

/* parse frames in p[0..n); returns bytes consumed, or -1 on a protocol error */
static long lj_parse(conn *c, const unsigned char *p, size_t n, int inner) {
    size_t pos = 0;
    while (n - pos >= 2) {
        unsigned char v = p[pos], t = p[pos + 1];
        if (v != '1' && v != '2') return -1;
        const unsigned char *q = p + pos + 2;
        size_t avail = n - pos - 2;
        if (t == 'W') {
            if (avail < 4) break;
            c->window = be32(q);
            c->in_window = 0;
            pos += 6;
        } else if (t == 'D') {
            if (avail < 8) break;
            uint32_t pairs = be32(q + 4);
            size_t off = 8;
            int incomplete = 0;
            for (uint32_t i = 0; i < 2 * pairs; i++) {
                if (avail - off < 4) { incomplete = 1; break; }
                uint32_t l = be32(q + off);
                if (avail - off - 4 < l) { incomplete = 1; break; }
                off += 4 + l;
            }
            if (incomplete) { if (inner) return -1; break; }
            pos += 2 + off;
            if (lj_event(c) < 0) return -1;
        } else if (t == 'J') {
            if (avail < 8) break;
            uint32_t l = be32(q + 4);
            if (avail - 8 < l) { if (inner) return -1; break; }
            pos += 10 + l;
            if (lj_event(c) < 0) return -1;
        } else if (t == 'C') {
            if (inner || avail < 4) { if (inner) return -1; break; }
            uint32_t l = be32(q);
            if (avail - 4 < l) break;
            long m = inflate_all(q + 4, l);
            if (m < 0) return -1;
            /* inflate_buf is reused by nested calls: copy out (C frames do not nest) */
            unsigned char *tmp = malloc(m ? (size_t)m : 1);
            memcpy(tmp, inflate_buf, (size_t)m);
            long used = lj_parse(c, tmp, (size_t)m, 1);
            free(tmp);
            if (used != m) return -1;
            pos += 6 + l;
        } else {
            return -1;
        }
    }
    if (inner && pos != n) return -1;
    return (long)pos;
}

/* --------------------------------------------------------------------- courier */

static int send_frame(int fd, const char *type, const unsigned char *body, uint32_t n) {
    unsigned char hdr[8];
    memcpy(hdr, type, 4);
    put32(hdr + 4, n);
    if (write_all(fd, hdr, 8) < 0) return -1;
    return n ? write_all(fd, body, n) : 0;
}

static int send_ackn(conn *c, const unsigned char *nonce, uint32_t count) {
    unsigned char body[20];
    memcpy(body, nonce, 16);
    put32(body + 16, count);
    payloads++;
    return send_frame(c->fd, "ACKN", body, 20);
}

/* feed inflated bytes of a streamed EVNT to the [len][json] splitter */
static void evnt_feed(conn *c, const unsigned char *p, size_t n) {
    while (n) {
        if (c->skip) {
            size_t k = c->skip < n ? (size_t)c->skip : n;
            c->skip -= k; p += k; n -= k;
            continue;
        }
        c->lenbuf[c->lenhave++] = *p++;
        n--;
        if (c->lenhave == 4) {
            c->skip = be32(c->lenbuf);
            c->lenhave = 0;
            c->ev_count++;
            events++;
        }
    }
}

/* consume streamed EVNT input; returns bytes used, -1 error; sets c->streaming = 0 at end */
static long evnt_input(conn *c, const unsigned char *p, size_t n) {
    unsigned char out[65536];
    c->zs.next_in = (unsigned char *)p;
    c->zs.avail_in = (uInt)n;
    for (;;) {
        c->zs.next_out = out;
        c->zs.avail_out = sizeof out;
        int rc = inflate(&c->zs, Z_NO_FLUSH);
        evnt_feed(c, out, sizeof out - c->zs.avail_out);
        if (rc == Z_STREAM_END) {
            inflateEnd(&c->zs);
            c->streaming = 0;
            if (c->lenhave || c->skip) errors++;
            if (send_ackn(c, c->nonce, c->ev_count) < 0) return -1;
            break;
        }
        if (rc == Z_BUF_ERROR || (rc == Z_OK && c->zs.avail_in == 0 && c->zs.avail_out))
            break;                                   /* needs more input */
        if (rc != Z_OK) return -1;
    }
    return (long)(n - c->zs.avail_in);
}

static long courier_parse(conn *c, const unsigned char *p, size_t n) {
    size_t pos = 0;
    while (pos < n) {
        if (c->streaming) {
            long used = evnt_input(c, p + pos, n - pos);
            if (used < 0) return -1;
            pos += (size_t)used;
            if (c->streaming) break;
            continue;
        }
        if (n - pos < 8) break;
        const unsigned char *h = p + pos;
        uint32_t len = be32(h + 4);
        if (memcmp(h, "EVNT", 4) == 0 && len == 0xFFFFFFFFu) {
            if (n - pos < 24) break;
            memcpy(c->nonce, h + 8, 16);
            memset(&c->zs, 0, sizeof c->zs);
            if (inflateInit(&c->zs) != Z_OK) return -1;
            c->streaming = 1;
            c->ev_count = 0;
            c->lenhave = 0;
            c->skip = 0;
            pos += 24;
            continue;
        }
        if (len > 10 * 1024 * 1024) return -1;
        if (n - pos - 8 < len) break;
        const unsigned char *b = h + 8;
        if (memcmp(h, "HELO", 4) == 0) {
            unsigned char v[32] = { 0 };
            put32(v, advertise_evnt ? 0x01000000u : 0);
            put32(v + 4, 2); put32(v + 8, 12); put32(v + 12, 0);
            memcpy(v + 16, "LCVR", 4);
            if (send_frame(c->fd, "VERS", v, 32) < 0) return -1;
        } else if (memcmp(h, "PING", 4) == 0) {
            if (send_frame(c->fd, "PONG", NULL, 0) < 0) return -1;
        } else if (memcmp(h, "JDAT", 4) == 0 || memcmp(h, "EVNT", 4) == 0) {
            if (len < 16) return -1;
            long m = inflate_all(b + 16, len - 16);
            if (m < 0) return -1;
            uint32_t count = 0;
            size_t q = 0;
            while (q + 4 <= (size_t)m) {
                uint32_t l = be32(inflate_buf + q);
                if ((size_t)m - q - 4 < l) return -1;
                q += 4 + l;
                count++;
            }
            if (q != (size_t)m) return -1;
            events += count;
            if (send_ackn(c, b, count) < 0) return -1;
        } else if (memcmp(h, "PONG", 4) != 0) {
            if (send_frame(c->fd, "????", NULL, 0) < 0) return -1;
        }
        pos += 8 + len;
    }
    return (long)pos;
}

/* ------------------------------------------------------------------------ loop */

static void drop(int i) {
    conn *c = &conns[i];
    close(c->fd);
    free(c->buf);
    if (c->streaming) inflateEnd(&c->zs);
    conns[i] = conns[--nconns];
}

static int on_readable(conn *c) {
    if (c->cap - c->len < 262144) {
        c->cap = c->cap ? c->cap * 2 : 1 << 20;
        c->buf = realloc(c->buf, c->cap);
    }
    ssize_t r = read(c->fd, c->buf + c->len, c->cap - c->len);
    if (r == 0) return -1;
    if (r < 0) return (errno == EINTR || errno == EAGAIN) ? 0 : -1;
    bytes_in += (size_t)r;
    c->len += (size_t)r;
    long used = proto_lj ? lj_parse(c, c->buf, c->len, 0) : courier_parse(c, c->buf, c->len);
    if (used < 0) {
        errors++;
        return -1;
    }
    memmove(c->buf, c->buf + used, c->len - (size_t)used);
    c->len -= (size_t)used;
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 3 || (strcmp(argv[1], "lumberjack") && strcmp(argv[1], "courier"))) {
        fprintf(stderr, "usage: sink lumberjack|courier PORT [jdat]\n");
        return 2;
    }
    proto_lj = strcmp(argv[1], "lumberjack") == 0;
    if (argc > 3 && strcmp(argv[3], "jdat") == 0) advertise_evnt = 0;
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(atoi(argv[2])) };
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 16)) {
        perror("sink: bind/listen");
        return 1;
    }
    socklen_t al = sizeof a;
    getsockname(ls, (struct sockaddr *)&a, &al);
    printf("port %d\n", ntohs(a.sin_port));
    fflush(stdout);
    for (;;) {
        struct pollfd pf[MAXCONN + 2];
        pf[0] = (struct pollfd){ .fd = 0, .events = POLLIN };
        pf[1] = (struct pollfd){ .fd = ls, .events = POLLIN };
        for (int i = 0; i < nconns; i++)
            pf[i + 2] = (struct pollfd){ .fd = conns[i].fd, .events = POLLIN };
        int n = nconns;
        if (poll(pf, (nfds_t)n + 2, -1) < 0) {
            if (errno == EINTR) continue;
            perror("poll");
            return 1;
        }
        if (pf[0].revents) {
            char line[256];
            ssize_t r = read(0, line, sizeof line);
            if (r <= 0) break;                     /* EOF on stdin: stop */
            printf("count %llu %llu %llu %llu\n", events, payloads, bytes_in, errors);
            fflush(stdout);
        }
        for (int i = n - 1; i >= 0; i--)
            if (pf[i + 2].revents && on_readable(&conns[i]) < 0) drop(i);
        if (pf[1].revents & POLLIN) {
            int fd = accept(ls, NULL, NULL);
            if (fd >= 0 && nconns < MAXCONN) {
                setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                memset(&conns[nconns], 0, sizeof conns[0]);
                conns[nconns++].fd = fd;
            } else if (fd >= 0) {
                close(fd);
            }
        }
    }
    return 0;
}
