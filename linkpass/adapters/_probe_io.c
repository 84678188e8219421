/* linkpass.adapters._probe_io: the probe datagram path in C (read, authenticate, parse, reply).
 *
 * Why: at 8 rails x 4 peers every 10 ms a host reads and writes about 3,200 probe datagrams a
 * second; in Python one request cost 37-40 us inside the daemon (decode 6-7, reply 12-14 of it),
 * one reply 22-24 us (bench/README.md).  This module does the per-datagram work that needs no
 * decision: recvmmsg(2) with the kernel receive time, the HMAC-SHA256 check (OpenSSL's EVP_MAC),
 * the parse of a well-formed probe addressed to this host, and building, signing and sending a
 * reply; and on the responder socket (Responder) the request replay guard too, so a request is
 * answered without Python.  Every other decision stays in Python (linkpass.adapters.prober): the
 * reply guard, the proofs, the verdicts.  Anything this module does not accept in full (bad size, magic, MAC,
 * lengths, UTF-8, another target) is handed back as raw bytes, and Python's decoder rejects it
 * with the same kind and message as without this module.
 *
 * Wire format: linkpass/core/probe.py (LPP2).  Only AF_INET sockets (the prober's).
 *
 * recv_batch(fd, key, host, limit) -> (items, rxq_ovfl, errno)
 *     Reads up to `limit` datagrams queued on non-blocking socket `fd` (MSG_DONTWAIT).
 *     items: in arrival order, each either
 *         (type, sender, rail, seq, ts_ns, ack, (ip, port), arrival_rt_ns)   type 1 or 2
 *         (0, data, (ip, port), arrival_rt_ns)                               raw: Python decides
 *     arrival_rt_ns: SO_TIMESTAMPNS (CLOCK_REALTIME ns) or 0 when the kernel gave none.
 *     rxq_ovfl: the last SO_RXQ_OVFL count seen (u32), or -1 when none came.
 *     errno: 0, or the error that ended the read (EAGAIN/EINTR are not errors: 0).
 *
 * send_probe(fd, ip, port, key, type, sender, target, rail, seq, ts_ns, ack) -> errno (0: sent)
 *     Builds the datagram (type 1 request or 2 reply; names as UTF-8 bytes), signs it and sends
 *     it to (ip, port) from non-blocking `fd`.  ValueError for a type other than 1 or 2, a name
 *     outside 1..64 bytes, a rail or port outside 16 bits or an ip that is not IPv4.
 *
 * Responder(fd, key, host): the responder socket read, guarded and answered on a thread of its
 *     own, which never takes the GIL; see the comment above its code.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>

#define MAGIC "LPP2"
#define MAX_NAME 64
#define TAIL_LEN 26 /* rail u16, seq u64, ts u64, ack u64 */
#define MAC_LEN 32
#define MAX_LEN (4 + 1 + 1 + MAX_NAME + 1 + MAX_NAME + TAIL_LEN + MAC_LEN)
#define MIN_LEN (4 + 1 + 1 + 1 + 1 + 1 + TAIL_LEN + MAC_LEN)
#define RECV_BUF 512 /* as the Python reader: longer is rejected as oversized anyway */
#define BATCH 64

#ifndef SO_RXQ_OVFL
#define SO_RXQ_OVFL 40
#endif

static EVP_MAC *mac_alg;
static EVP_MAC_CTX *keyed; /* keyed once per key; each datagram uses a copy */
static unsigned char *cur_key;
static size_t cur_key_len;

static int set_key(const unsigned char *key, size_t n)
{
    if (keyed != NULL && n == cur_key_len && (n == 0 || memcmp(key, cur_key, n) == 0))
        return 0;
    EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(mac_alg);
    if (ctx == NULL)
        return -1;
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, "SHA256", 0),
        OSSL_PARAM_construct_end(),
    };
    if (!EVP_MAC_init(ctx, key, n, params)) {
        EVP_MAC_CTX_free(ctx);
        return -1;
    }
    unsigned char *copy = PyMem_Malloc(n ? n : 1);
    if (copy == NULL) {
        EVP_MAC_CTX_free(ctx);
        return -1;
    }
    memcpy(copy, key, n);
    EVP_MAC_CTX_free(keyed);
    PyMem_Free(cur_key);
    keyed = ctx;
    cur_key = copy;
    cur_key_len = n;
    return 0;
}

static int compute_mac_with(EVP_MAC_CTX *base, const unsigned char *data, size_t n, unsigned char out[MAC_LEN])
{
    EVP_MAC_CTX *c = EVP_MAC_CTX_dup(base);
    size_t outl = 0;
    int ok = c != NULL && EVP_MAC_update(c, data, n) && EVP_MAC_final(c, out, &outl, MAC_LEN) && outl == MAC_LEN;
    EVP_MAC_CTX_free(c);
    return ok ? 0 : -1;
}

static int key_arg(Py_buffer *key)
{
    if (set_key(key->buf, (size_t)key->len) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC-SHA256 could not be keyed");
        return -1;
    }
    return 0;
}

static uint64_t be64(const unsigned char *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | p[i];
    return v;
}

static void put_be64(unsigned char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
}

static PyObject *addr_tuple(const struct sockaddr_in *sa)
{
    char ip[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &sa->sin_addr, ip, sizeof ip) == NULL)
        ip[0] = '\0';
    return Py_BuildValue("(si)", ip, (int)ntohs(sa->sin_port));
}

/* A probe as the wire carries it, parsed (names point into the datagram, not terminated). */
struct wire_probe {
    unsigned type;
    const unsigned char *sender;
    unsigned slen;
    unsigned rail;
    uint64_t seq, ts, ack;
};

/* 0 when `d` (n bytes) is an authentic (MAC under `mac`), well-formed probe addressed to
 * `host`; -1 otherwise (Python must decide: the raw path). */
static int parse_wire(EVP_MAC_CTX *mac, const unsigned char *d, size_t n, const unsigned char *host, size_t host_len,
                      struct wire_probe *out)
{
    if (n > MAX_LEN || n < MIN_LEN || memcmp(d, MAGIC, 4) != 0)
        return -1;
    size_t body = n - MAC_LEN;
    unsigned char tag[MAC_LEN];
    if (compute_mac_with(mac, d, body, tag) < 0 || CRYPTO_memcmp(tag, d + body, MAC_LEN) != 0)
        return -1;
    unsigned type = d[4], slen = d[5];
    if ((type != 1 && type != 2) || slen < 1 || slen > MAX_NAME)
        return -1;
    size_t off = 6 + slen;
    if (body < off + 1)
        return -1;
    unsigned tlen = d[off];
    if (tlen < 1 || tlen > MAX_NAME || body != off + 1 + tlen + TAIL_LEN)
        return -1;
    if ((size_t)tlen != host_len || memcmp(d + off + 1, host, tlen) != 0)
        return -1;
    const unsigned char *t = d + off + 1 + tlen;
    out->type = type;
    out->sender = d + 6;
    out->slen = slen;
    out->rail = ((unsigned)t[0] << 8) | t[1];
    out->seq = be64(t + 2);
    out->ts = be64(t + 10);
    out->ack = be64(t + 18);
    return 0;
}

/* The parsed item for an authentic, well-formed probe addressed to `host`; NULL with no
 * exception set when Python must decide (the raw path, a sender name that is not UTF-8); NULL
 * with an exception on failure. */
static PyObject *parse(const unsigned char *d, size_t n, const Py_buffer *host, PyObject *addr, long long arrival)
{
    struct wire_probe w;
    if (parse_wire(keyed, d, n, host->buf, (size_t)host->len, &w) < 0)
        return NULL;
    PyObject *sender = PyUnicode_DecodeUTF8((const char *)w.sender, w.slen, "strict");
    if (sender == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        return NULL;
    }
    return Py_BuildValue("(INIKKKOL)", w.type, sender, w.rail, (unsigned long long)w.seq, (unsigned long long)w.ts,
                         (unsigned long long)w.ack, addr, arrival);
}

/* Writes the signed datagram into `d` (MAX_LEN bytes); returns its length, 0 when the MAC
 * failed.  Names are 1..MAX_NAME bytes (checked by the callers). */
static size_t build_probe(EVP_MAC_CTX *mac, unsigned char *d, unsigned type, const void *host, size_t hlen,
                          const void *target, size_t tlen, unsigned rail, uint64_t seq, uint64_t ts, uint64_t ack)
{
    size_t n = 0;
    memcpy(d, MAGIC, 4);
    n = 4;
    d[n++] = (unsigned char)type;
    d[n++] = (unsigned char)hlen;
    memcpy(d + n, host, hlen);
    n += hlen;
    d[n++] = (unsigned char)tlen;
    memcpy(d + n, target, tlen);
    n += tlen;
    d[n++] = (unsigned char)(rail >> 8);
    d[n++] = (unsigned char)(rail & 0xff);
    put_be64(d + n, seq);
    put_be64(d + n + 8, ts);
    put_be64(d + n + 16, ack);
    n += 24;
    if (compute_mac_with(mac, d, n, d + n) < 0)
        return 0;
    return n + MAC_LEN;
}

/* The kernel receive time (CLOCK_REALTIME ns, 0: none) and SO_RXQ_OVFL count (-1: none) of a
 * datagram read by recvmmsg. */
static void read_cmsgs(struct msghdr *h, long long *arrival, long long *ovfl)
{
    *arrival = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
        if (c->cmsg_level != SOL_SOCKET)
            continue;
        if (c->cmsg_type == SO_TIMESTAMPNS && c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
            struct timespec ts;
            memcpy(&ts, CMSG_DATA(c), sizeof ts);
            *arrival = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
        } else if (c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
            uint32_t v;
            memcpy(&v, CMSG_DATA(c), sizeof v);
            *ovfl = v;
        }
    }
}

#define CTRL_LEN (CMSG_SPACE(sizeof(struct timespec)) + CMSG_SPACE(sizeof(uint32_t)))

static void prepare_msgs(struct mmsghdr *msgs, struct iovec *iov, struct sockaddr_in *names, unsigned char (*bufs)[RECV_BUF],
                         unsigned char (*ctrl)[CTRL_LEN], unsigned want)
{
    memset(msgs, 0, sizeof(msgs[0]) * want);
    for (unsigned i = 0; i < want; i++) {
        iov[i].iov_base = bufs[i];
        iov[i].iov_len = RECV_BUF;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &names[i];
        msgs[i].msg_hdr.msg_namelen = sizeof names[i];
        msgs[i].msg_hdr.msg_control = ctrl[i];
        msgs[i].msg_hdr.msg_controllen = sizeof ctrl[i];
    }
}

static PyObject *recv_batch(PyObject *self, PyObject *args)
{
    int fd;
    Py_buffer key, host;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "iy*y*n", &fd, &key, &host, &limit))
        return NULL;
    PyObject *items = NULL;
    long long ovfl = -1;
    int err = 0;
    if (key_arg(&key) < 0)
        goto done;
    items = PyList_New(0);
    if (items == NULL)
        goto done;

    static unsigned char bufs[BATCH][RECV_BUF];
    static unsigned char ctrl[BATCH][CTRL_LEN];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in names[BATCH];

    while (limit > 0) {
        unsigned want = limit < BATCH ? (unsigned)limit : BATCH;
        prepare_msgs(msgs, iov, names, bufs, ctrl, want);
        int got = recvmmsg(fd, msgs, want, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                err = errno;
            break;
        }
        for (int i = 0; i < got; i++) {
            long long arrival;
            read_cmsgs(&msgs[i].msg_hdr, &arrival, &ovfl);
            PyObject *addr = addr_tuple(&names[i]);
            if (addr == NULL)
                goto fail;
            size_t n = msgs[i].msg_len;
            PyObject *item = parse(bufs[i], n, &host, addr, arrival);
            if (item == NULL) {
                if (PyErr_Occurred()) {
                    Py_DECREF(addr);
                    goto fail;
                }
                item = Py_BuildValue("(iy#OL)", 0, (const char *)bufs[i], (Py_ssize_t)n, addr, arrival);
            }
            Py_DECREF(addr);
            if (item == NULL || PyList_Append(items, item) < 0) {
                Py_XDECREF(item);
                goto fail;
            }
            Py_DECREF(item);
        }
        limit -= got;
        if ((unsigned)got < want)
            break; /* the queue is empty: save the syscall that would say so */
    }
    goto done;
fail:
    Py_CLEAR(items);
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&host);
    if (items == NULL)
        return NULL;
    return Py_BuildValue("(NLi)", items, ovfl, err);
}

static PyObject *send_probe(PyObject *self, PyObject *args)
{
    int fd, port;
    const char *ip;
    Py_buffer key, host, target;
    unsigned int type, rail;
    unsigned long long seq, ts, ack;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "isiy*Iy*y*IKKK", &fd, &ip, &port, &key, &type, &host, &target, &rail, &seq, &ts, &ack))
        return NULL;
    if (type != 1 && type != 2) {
        PyErr_SetString(PyExc_ValueError, "probe type must be 1 or 2");
        goto done;
    }
    if (host.len < 1 || host.len > MAX_NAME || target.len < 1 || target.len > MAX_NAME) {
        PyErr_SetString(PyExc_ValueError, "host names must be 1..64 bytes");
        goto done;
    }
    if (rail > 0xffff || port < 0 || port > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "rail id or port out of range");
        goto done;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, ip, &sa.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", ip);
        goto done;
    }
    if (key_arg(&key) < 0)
        goto done;
    unsigned char d[MAX_LEN];
    size_t n = build_probe(keyed, d, type, host.buf, (size_t)host.len, target.buf, (size_t)target.len, rail, seq, ts, ack);
    if (n == 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC-SHA256 failed");
        goto done;
    }
    int e = 0;
    if (sendto(fd, d, n, MSG_DONTWAIT, (struct sockaddr *)&sa, sizeof sa) < 0)
        e = errno;
    result = PyLong_FromLong(e);
done:
    PyBuffer_Release(&key);
    PyBuffer_Release(&host);
    PyBuffer_Release(&target);
    return result;
}

/* ------------------------------------------------------------------------------------------
 * Responder: the responder socket read and answered on a thread of its own.
 *
 * Why: a peer's request must be answered at once (the peer's deadline runs), so the responder
 * socket was watched by the event loop: at 8 rails x 4 peers several hundred loop wake-ups a
 * second (about 46 us of CPU each in asyncio on a 2-core VM, bench/README.md) plus the Python
 * reply path, and every turn the loop spent elsewhere (the engine, a route apply) delayed the
 * answers.  Here a thread blocked in poll(2) reads each burst with recvmmsg(2), authenticates
 * and parses it, applies the request replay guard, signs and sends the reply (out of the socket
 * of the rail the request names, else the responder socket) and queues what Python decides on:
 * it never takes the GIL.  Python takes the queue at its timer turns (the proofs of passive
 * paths are judged there, by kernel arrival time, as replies are).
 *
 * Replay guard: RFC 4303 section 3.4.3's anti-replay window, as linkpass.core.probe.RequestGuard
 * (window 1024 seqs, at most 4096 sender names remembered, the oldest forgotten first): a
 * request is answered only when its seq is above the highest seen from its sender, or inside
 * the window below it and not seen before.
 *
 * Responder(fd, key, host, max_queue=8192)
 *     Starts the thread on non-blocking AF_INET UDP socket `fd` (the caller keeps it open until
 *     stop() returned).  RuntimeError when the thread or the pipe cannot be made.
 * configure(key, host)        the key and this host's name (UTF-8 bytes, 1..64) from now on
 * set_rail(rail, fd)          replies to requests naming `rail` leave from `fd` (-1: forget it);
 *                             once this returns the thread no longer uses the old fd
 * take() -> (items, answered, answer_errors, queue_dropped, rxq_ovfl, errno)
 *     What the thread queued since the last take, in arrival order:
 *         (5, sender, rail, seq, ts_ns, ack, (ip, port), arrival_rt_ns)  a request, answered
 *         (2, sender, rail, seq, ts_ns, ack, (ip, port), arrival_rt_ns)  a reply (to Python)
 *         (3, sender, rail, seq, hi, below, (ip, port), arrival_rt_ns)   a replayed request, not
 *             answered: `below` 1 when seq is a window or more below `hi`, 0 when seen before
 *         (4, rail, errno, 0)                                            a reply out of the rail's
 *             socket failed with ENODEV/ENXIO (the netdev is gone)
 *         (0, data, (ip, port), arrival_rt_ns)                           not accepted in full:
 *             Python decides (as recv_batch's raw items)
 *     answered, answer_errors, queue_dropped: counts since the last take; queue_dropped counts
 *     items that found the queue full (their requests were still answered or refused);
 *     rxq_ovfl: the last SO_RXQ_OVFL count seen (-1: none); errno: the last read error (0).
 * stop()                      ends the thread and waits for it (idempotent)
 * ------------------------------------------------------------------------------------------ */
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#define WINDOW 1024
#define WINDOW_WORDS (WINDOW / 64)
#define MAX_SENDERS 4096
#define BUCKETS 8192 /* power of two, >= 2 x MAX_SENDERS */
#define MAX_RAW 256  /* raw datagrams queued for Python at most (each carries its bytes) */

struct sender_ent {
    unsigned char name[MAX_NAME];
    unsigned len;
    int next; /* the next entry in this bucket, -1 */
    uint64_t hi;
    uint64_t seen[WINDOW_WORDS]; /* bit i: seq hi - i was answered */
};

struct qitem {
    unsigned char kind;
    unsigned char slen;
    unsigned char sender[MAX_NAME];
    unsigned rail;
    uint64_t seq, ts, ack;
    struct sockaddr_in addr;
    long long arrival;
    int raw; /* index into raw[] for kind 0, else -1 */
};

struct raw_dgram {
    size_t n;
    unsigned char d[RECV_BUF];
};

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    int mu_ok; /* the mutex and the tables exist: the methods may run */
    pthread_t thread;
    int running;
    int stopping; /* set (atomically) by stop(): the thread leaves after its current batch */
    int stop_pipe[2];
    int fd;
    EVP_MAC_CTX *mac;
    unsigned char host[MAX_NAME];
    size_t host_len;
    int *rail_fd; /* 65536 entries, -1 when unknown */
    struct sender_ent *senders;
    int count, oldest;
    int buckets[BUCKETS];
    struct qitem *q;
    size_t qcap, qlen;
    struct raw_dgram *raw;
    size_t nraw;
    unsigned long long answered, answer_errors, dropped;
    long long ovfl;
    int err;
    /* the thread's own receive buffers */
    unsigned char bufs[BATCH][RECV_BUF];
    unsigned char ctrl[BATCH][CTRL_LEN];
} Responder;

/* Whether s (n bytes) is strict UTF-8 as Python's decoder takes it (no overlong forms, no
 * surrogates, nothing above U+10FFFF). */
static int utf8_ok(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t k;
        unsigned cp;
        if (c < 0x80) {
            i++;
            continue;
        } else if (c >= 0xc2 && c <= 0xdf) {
            k = 1, cp = c & 0x1f;
        } else if (c >= 0xe0 && c <= 0xef) {
            k = 2, cp = c & 0x0f;
        } else if (c >= 0xf0 && c <= 0xf4) {
            k = 3, cp = c & 0x07;
        } else {
            return 0;
        }
        if (i + k >= n) /* the sequence runs past the end */
            return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xc0) != 0x80)
                return 0;
            cp = (cp << 6) | (s[i + j] & 0x3f);
        }
        if ((k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return 0;
        i += k + 1;
    }
    return 1;
}

static uint32_t name_hash(const unsigned char *s, size_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 16777619u;
    return h;
}

/* The replay guard (see above): 0 to answer, 1 when seq is seen before, 2 when a window or more
 * below the highest; *hi_out gets the highest seq seen from this sender. */
static int guard_check(Responder *r, const unsigned char *name, unsigned len, uint64_t seq, uint64_t *hi_out)
{
    uint32_t b = name_hash(name, len) & (BUCKETS - 1);
    int i = r->buckets[b];
    while (i >= 0 && !(r->senders[i].len == len && memcmp(r->senders[i].name, name, len) == 0))
        i = r->senders[i].next;
    if (i < 0) {
        if (r->count < MAX_SENDERS) {
            i = r->count++;
        } else { /* forget the oldest name (slots fill and refill in insertion order) */
            i = r->oldest;
            r->oldest = (r->oldest + 1) % MAX_SENDERS;
            struct sender_ent *old = &r->senders[i];
            int *link = &r->buckets[name_hash(old->name, old->len) & (BUCKETS - 1)];
            while (*link != i)
                link = &r->senders[*link].next;
            *link = old->next;
        }
        struct sender_ent *e = &r->senders[i];
        memcpy(e->name, name, len);
        e->len = len;
        e->next = r->buckets[b];
        r->buckets[b] = i;
        e->hi = seq;
        memset(e->seen, 0, sizeof e->seen);
        e->seen[0] = 1;
        *hi_out = seq;
        return 0;
    }
    struct sender_ent *e = &r->senders[i];
    *hi_out = e->hi;
    if (seq > e->hi) {
        uint64_t d = seq - e->hi;
        if (d >= WINDOW) {
            memset(e->seen, 0, sizeof e->seen);
        } else { /* bit k moves to k + d */
            unsigned ws = (unsigned)(d / 64), bs = (unsigned)(d % 64);
            for (int k = WINDOW_WORDS - 1; k >= 0; k--) {
                int src = k - (int)ws;
                uint64_t v = src >= 0 ? e->seen[src] << bs : 0;
                if (bs && src - 1 >= 0)
                    v |= e->seen[src - 1] >> (64 - bs);
                e->seen[k] = v;
            }
        }
        e->seen[0] |= 1;
        e->hi = seq;
        return 0;
    }
    uint64_t d = e->hi - seq;
    if (d >= WINDOW)
        return 2;
    uint64_t bit = (uint64_t)1 << (d % 64);
    if (e->seen[d / 64] & bit)
        return 1;
    e->seen[d / 64] |= bit;
    return 0;
}

static struct qitem *enqueue(Responder *r)
{
    if (r->qlen >= r->qcap) {
        r->dropped++;
        return NULL;
    }
    struct qitem *it = &r->q[r->qlen++];
    it->raw = -1;
    return it;
}

/* One datagram read by the thread (the mutex held). */
static void handle_dgram(Responder *r, const unsigned char *d, size_t n, const struct sockaddr_in *from, long long arrival)
{
    struct wire_probe w;
    if (parse_wire(r->mac, d, n, r->host, r->host_len, &w) < 0 || !utf8_ok(w.sender, w.slen)) {
        if (r->nraw >= MAX_RAW) {
            r->dropped++;
            return;
        }
        struct qitem *it = enqueue(r);
        if (it == NULL)
            return;
        it->kind = 0;
        it->raw = (int)r->nraw;
        r->raw[r->nraw].n = n;
        memcpy(r->raw[r->nraw].d, d, n);
        r->nraw++;
        it->addr = *from;
        it->arrival = arrival;
        return;
    }
    unsigned char kind = (unsigned char)w.type;
    uint64_t hi = 0;
    if (w.type == 1) {
        int verdict = guard_check(r, w.sender, w.slen, w.seq, &hi);
        if (verdict) {
            kind = 3;
            w.ts = hi;
            w.ack = verdict == 2;
        } else {
            int out = r->rail_fd[w.rail];
            unsigned char reply[MAX_LEN];
            size_t len = build_probe(r->mac, reply, 2, r->host, r->host_len, w.sender, w.slen, w.rail, w.seq, w.ts, 0);
            int e = 0;
            if (len == 0)
                e = EIO;
            else if (sendto(out >= 0 ? out : r->fd, reply, len, MSG_DONTWAIT, (const struct sockaddr *)from, sizeof *from) < 0)
                e = errno;
            if (e) {
                r->answer_errors++;
                if (out >= 0 && (e == ENODEV || e == ENXIO)) {
                    struct qitem *g = enqueue(r);
                    if (g != NULL) {
                        g->kind = 4;
                        g->rail = w.rail;
                        g->seq = (uint64_t)e;
                    }
                }
            } else {
                r->answered++;
            }
            /* the request proves the path whether or not our reply left (as the Python
             * datapath: _answer counts its error, then _proof) */
            kind = 5;
        }
    }
    struct qitem *it = enqueue(r);
    if (it == NULL)
        return;
    it->kind = kind;
    it->slen = (unsigned char)w.slen;
    memcpy(it->sender, w.sender, w.slen);
    it->rail = w.rail;
    it->seq = w.seq;
    it->ts = w.ts;
    it->ack = w.ack;
    it->addr = *from;
    it->arrival = arrival;
}

static void *responder_main(void *arg)
{
    Responder *r = arg;
    /* named for `top -H`, ps -L and bench/thread_cpu.py (at most 15 bytes) */
    pthread_setname_np(pthread_self(), "lp-responder");
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in names[BATCH];
    for (;;) {
        struct pollfd p[2] = {{.fd = r->fd, .events = POLLIN}, {.fd = r->stop_pipe[0], .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            pthread_mutex_lock(&r->mu);
            r->err = errno;
            pthread_mutex_unlock(&r->mu);
            return NULL;
        }
        if (p[1].revents)
            return NULL;
        for (;;) { /* the whole queue, a recvmmsg per BATCH */
            prepare_msgs(msgs, iov, names, r->bufs, r->ctrl, BATCH);
            int got = recvmmsg(r->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
            if (got < 0) {
                int e = errno;
                if (e != EAGAIN && e != EWOULDBLOCK && e != EINTR) {
                    pthread_mutex_lock(&r->mu);
                    r->err = e;
                    pthread_mutex_unlock(&r->mu);
                    if (e == EBADF)
                        return NULL;
                }
                break;
            }
            pthread_mutex_lock(&r->mu);
            for (int i = 0; i < got; i++) {
                long long arrival;
                read_cmsgs(&msgs[i].msg_hdr, &arrival, &r->ovfl);
                handle_dgram(r, r->bufs[i], msgs[i].msg_len, &names[i], arrival);
            }
            pthread_mutex_unlock(&r->mu);
            /* a flood that keeps the queue full must not keep stop() waiting */
            if (__atomic_load_n(&r->stopping, __ATOMIC_ACQUIRE))
                return NULL;
            if (got < BATCH)
                break;
        }
    }
}

/* A MAC context keyed with `key` for this host name (checked: 1..MAX_NAME bytes); NULL with
 * an exception set. */
static EVP_MAC_CTX *keyed_for(Py_buffer *key, Py_buffer *host)
{
    if (host->len < 1 || host->len > MAX_NAME) {
        PyErr_SetString(PyExc_ValueError, "host names must be 1..64 bytes");
        return NULL;
    }
    EVP_MAC_CTX *ctx = EVP_MAC_CTX_new(mac_alg);
    OSSL_PARAM params[] = {
        OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, "SHA256", 0),
        OSSL_PARAM_construct_end(),
    };
    if (ctx == NULL || !EVP_MAC_init(ctx, key->buf, (size_t)key->len, params)) {
        EVP_MAC_CTX_free(ctx);
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC-SHA256 could not be keyed");
        return NULL;
    }
    return ctx;
}

/* Swaps in `ctx` and the host name (the mutex held, or the thread not running); returns the
 * context it replaced, for the caller to free outside the lock. */
static EVP_MAC_CTX *swap_key_locked(Responder *r, EVP_MAC_CTX *ctx, Py_buffer *host)
{
    EVP_MAC_CTX *old = r->mac;
    r->mac = ctx;
    memcpy(r->host, host->buf, (size_t)host->len);
    r->host_len = (size_t)host->len;
    return old;
}

static void responder_stop(Responder *r)
{
    if (!r->running)
        return;
    r->running = 0; /* before the GIL is let go: a second stop() returns at once */
    pthread_t t = r->thread;
    __atomic_store_n(&r->stopping, 1, __ATOMIC_RELEASE);
    ssize_t w = write(r->stop_pipe[1], "x", 1);
    (void)w;
    Py_BEGIN_ALLOW_THREADS
    pthread_join(t, NULL);
    Py_END_ALLOW_THREADS
}

/* Zero-filled, but with no descriptor: a failed or missing __init__ must not make dealloc
 * close fd 0. */
static PyObject *Responder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Responder *r = (Responder *)PyType_GenericNew(type, args, kwds);
    if (r != NULL) {
        r->fd = -1;
        r->stop_pipe[0] = r->stop_pipe[1] = -1;
        r->ovfl = -1;
    }
    return (PyObject *)r;
}

static int Responder_init(Responder *r, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"fd", "key", "host", "max_queue", NULL};
    int fd;
    Py_buffer key, host;
    Py_ssize_t max_queue = 8192;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iy*y*|n", kw, &fd, &key, &host, &max_queue))
        return -1;
    int rc = -1;
    if (r->running || r->q != NULL) { /* not through `out`: that would undo the running one */
        PyErr_SetString(PyExc_RuntimeError, "Responder already started");
        PyBuffer_Release(&key);
        PyBuffer_Release(&host);
        return -1;
    }
    if (max_queue < 1) {
        PyErr_SetString(PyExc_ValueError, "max_queue must be positive");
        goto out;
    }
    r->fd = fd;
    r->qcap = (size_t)max_queue;
    r->ovfl = -1;
    r->stop_pipe[0] = r->stop_pipe[1] = -1;
    for (int i = 0; i < BUCKETS; i++)
        r->buckets[i] = -1;
    r->rail_fd = PyMem_Malloc(sizeof(int) * 65536);
    r->senders = PyMem_Calloc(MAX_SENDERS, sizeof(struct sender_ent));
    r->q = PyMem_Calloc(r->qcap, sizeof(struct qitem));
    r->raw = PyMem_Calloc(MAX_RAW, sizeof(struct raw_dgram));
    if (r->rail_fd == NULL || r->senders == NULL || r->q == NULL || r->raw == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (int i = 0; i < 65536; i++)
        r->rail_fd[i] = -1;
    if (pthread_mutex_init(&r->mu, NULL) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "pthread_mutex_init failed");
        goto out;
    }
    r->mu_ok = 1;
    EVP_MAC_CTX *ctx = keyed_for(&key, &host);
    if (ctx == NULL)
        goto out;
    EVP_MAC_CTX_free(swap_key_locked(r, ctx, &host)); /* no thread yet */
    if (pipe2(r->stop_pipe, O_CLOEXEC) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    /* the thread takes no signals: Python's handlers run on the main thread */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int e = pthread_create(&r->thread, NULL, responder_main, r);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (e != 0) {
        errno = e;
        PyErr_SetFromErrno(PyExc_RuntimeError);
        goto out;
    }
    r->running = 1;
    rc = 0;
out:
    if (rc < 0) { /* back to the state of a new object: nothing leaks, __init__ may be retried */
        if (r->mu_ok)
            pthread_mutex_destroy(&r->mu);
        r->mu_ok = 0;
        for (int i = 0; i < 2; i++) {
            if (r->stop_pipe[i] >= 0)
                close(r->stop_pipe[i]);
            r->stop_pipe[i] = -1;
        }
        EVP_MAC_CTX_free(r->mac);
        r->mac = NULL;
        PyMem_Free(r->rail_fd);
        PyMem_Free(r->senders);
        PyMem_Free(r->q);
        PyMem_Free(r->raw);
        r->rail_fd = NULL;
        r->senders = NULL;
        r->q = NULL;
        r->raw = NULL;
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&host);
    return rc;
}

static void Responder_dealloc(Responder *r)
{
    responder_stop(r);
    if (r->stop_pipe[0] >= 0)
        close(r->stop_pipe[0]);
    if (r->stop_pipe[1] >= 0)
        close(r->stop_pipe[1]);
    if (r->mu_ok)
        pthread_mutex_destroy(&r->mu);
    EVP_MAC_CTX_free(r->mac);
    PyMem_Free(r->rail_fd);
    PyMem_Free(r->senders);
    PyMem_Free(r->q);
    PyMem_Free(r->raw);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static int not_started(Responder *r)
{
    if (r->mu_ok)
        return 0;
    PyErr_SetString(PyExc_RuntimeError, "Responder was not started (its __init__ failed or never ran)");
    return 1;
}

static PyObject *Responder_configure(Responder *r, PyObject *args)
{
    if (not_started(r))
        return NULL;
    Py_buffer key, host;
    if (!PyArg_ParseTuple(args, "y*y*", &key, &host))
        return NULL;
    /* keyed before the lock, swapped without the GIL: the thread never waits on the GIL */
    EVP_MAC_CTX *ctx = keyed_for(&key, &host), *old = NULL;
    if (ctx != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&r->mu);
        old = swap_key_locked(r, ctx, &host);
        pthread_mutex_unlock(&r->mu);
        Py_END_ALLOW_THREADS
        EVP_MAC_CTX_free(old);
    }
    PyBuffer_Release(&key);
    PyBuffer_Release(&host);
    if (ctx == NULL)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *Responder_set_rail(Responder *r, PyObject *args)
{
    unsigned int rail;
    int fd;
    if (not_started(r))
        return NULL;
    if (!PyArg_ParseTuple(args, "Ii", &rail, &fd))
        return NULL;
    if (rail > 0xffff) {
        PyErr_SetString(PyExc_ValueError, "rail id out of range");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&r->mu);
    r->rail_fd[rail] = fd < 0 ? -1 : fd;
    pthread_mutex_unlock(&r->mu);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *item_tuple(const struct qitem *it, const struct raw_dgram *raw)
{
    if (it->kind == 4)
        return Py_BuildValue("(iIKi)", 4, it->rail, (unsigned long long)it->seq, 0);
    PyObject *addr = addr_tuple(&it->addr);
    if (addr == NULL)
        return NULL;
    PyObject *t;
    if (it->kind == 0) {
        t = Py_BuildValue("(iy#OL)", 0, (const char *)raw[it->raw].d, (Py_ssize_t)raw[it->raw].n, addr, it->arrival);
    } else {
        /* the thread queued only senders that are strict UTF-8 */
        PyObject *sender = PyUnicode_DecodeUTF8((const char *)it->sender, it->slen, "strict");
        if (sender == NULL) {
            Py_DECREF(addr);
            return NULL;
        }
        t = Py_BuildValue("(iNIKKKOL)", (int)it->kind, sender, it->rail, (unsigned long long)it->seq,
                          (unsigned long long)it->ts, (unsigned long long)it->ack, addr, it->arrival);
    }
    Py_DECREF(addr);
    return t;
}

static PyObject *Responder_take(Responder *r, PyObject *noargs)
{
    struct qitem *q = NULL;
    struct raw_dgram *raw = NULL;
    size_t n = 0, nraw = 0;
    unsigned long long answered = 0, answer_errors = 0, dropped = 0;
    long long ovfl = -1;
    int err = 0;
    if (not_started(r))
        return NULL;
    /* copy the queue out under the lock, all without the GIL (the thread never waits on the
     * GIL through the mutex); build the tuples after */
    int nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&r->mu);
    n = r->qlen;
    nraw = r->nraw;
    if (n) {
        q = PyMem_RawMalloc(n * sizeof *q);
        raw = nraw ? PyMem_RawMalloc(nraw * sizeof *raw) : NULL;
        if (q == NULL || (nraw && raw == NULL)) {
            nomem = 1;
        } else {
            memcpy(q, r->q, n * sizeof *q);
            if (nraw)
                memcpy(raw, r->raw, nraw * sizeof *raw);
        }
    }
    if (!nomem) {
        r->qlen = r->nraw = 0;
        answered = r->answered;
        answer_errors = r->answer_errors;
        dropped = r->dropped;
        r->answered = r->answer_errors = r->dropped = 0;
        ovfl = r->ovfl;
        err = r->err;
        r->err = 0;
    }
    pthread_mutex_unlock(&r->mu);
    Py_END_ALLOW_THREADS
    if (nomem) {
        PyMem_RawFree(q);
        PyMem_RawFree(raw);
        return PyErr_NoMemory();
    }

    PyObject *items = PyList_New((Py_ssize_t)n);
    if (items != NULL) {
        for (size_t i = 0; i < n; i++) {
            PyObject *t = item_tuple(&q[i], raw);
            if (t == NULL) {
                Py_CLEAR(items);
                break;
            }
            PyList_SET_ITEM(items, (Py_ssize_t)i, t);
        }
    }
    PyMem_RawFree(q);
    PyMem_RawFree(raw);
    if (items == NULL)
        return NULL;
    return Py_BuildValue("(NKKKLi)", items, answered, answer_errors, dropped, ovfl, err);
}

static PyObject *Responder_stop(Responder *r, PyObject *noargs)
{
    responder_stop(r);
    Py_RETURN_NONE;
}

static PyMethodDef responder_methods[] = {
    {"configure", (PyCFunction)Responder_configure, METH_VARARGS, "configure(key, host): the key and host name from now on"},
    {"set_rail", (PyCFunction)Responder_set_rail, METH_VARARGS, "set_rail(rail, fd): replies for `rail` leave from fd (-1: none)"},
    {"take", (PyCFunction)Responder_take, METH_NOARGS,
     "take() -> (items, answered, answer_errors, queue_dropped, rxq_ovfl, errno)"},
    {"stop", (PyCFunction)Responder_stop, METH_NOARGS, "stop(): end the thread and wait for it"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ResponderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "linkpass.adapters._probe_io.Responder",
    .tp_doc = "The responder socket read and answered on a thread of its own (see the module source).",
    .tp_basicsize = sizeof(Responder),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Responder_new,
    .tp_init = (initproc)Responder_init,
    .tp_dealloc = (destructor)Responder_dealloc,
    .tp_methods = responder_methods,
};

static PyMethodDef methods[] = {
    {"recv_batch", recv_batch, METH_VARARGS, "recv_batch(fd, key, host, limit) -> (items, rxq_ovfl, errno)"},
    {"send_probe", send_probe, METH_VARARGS, "send_probe(fd, ip, port, key, type, sender, target, rail, seq, ts_ns, ack) -> errno"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_probe_io",
    .m_doc = "The probe datagram path in C.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__probe_io(void)
{
    mac_alg = EVP_MAC_fetch(NULL, "HMAC", NULL);
    if (mac_alg == NULL) {
        PyErr_SetString(PyExc_ImportError, "OpenSSL has no HMAC");
        return NULL;
    }
    if (PyType_Ready(&ResponderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) {
        Py_INCREF(&ResponderType);
        if (PyModule_AddObject(m, "Responder", (PyObject *)&ResponderType) < 0) {
            Py_DECREF(&ResponderType);
            Py_DECREF(m);
            return NULL;
        }
        PyModule_AddIntConstant(m, "MAX_LEN", MAX_LEN);
        PyModule_AddIntConstant(m, "MIN_LEN", MIN_LEN);
    }
    return m;
}
