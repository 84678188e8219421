/* linkpass.adapters._probe_io: the probe datagram path in C (read, authenticate, parse, reply).
 *
 * Why: at 8 rails x 4 peers every 10 ms a host reads and writes about 3,200 probe datagrams a
 * second; in Python one request cost 37-40 us inside the daemon (decode 6-7, reply 12-14 of it),
 * one reply 22-24 us (bench/README.md).  This module does the per-datagram work that needs no
 * decision: recvmmsg(2) with the kernel receive time, the HMAC-SHA256 check (OpenSSL's EVP_MAC),
 * the parse of a well-formed probe addressed to this host, and building, signing and sending a
 * reply.  Every decision stays in Python (linkpass.adapters.prober): the replay guards, the
 * proofs, the verdicts.  Anything this module does not accept in full (bad size, magic, MAC,
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

static int compute_mac(const unsigned char *data, size_t n, unsigned char out[MAC_LEN])
{
    EVP_MAC_CTX *c = EVP_MAC_CTX_dup(keyed);
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

/* The parsed item for an authentic, well-formed probe addressed to `host`; NULL with no
 * exception set when Python must decide (the raw path); NULL with an exception on failure. */
static PyObject *parse(const unsigned char *d, size_t n, const Py_buffer *host, PyObject *addr, long long arrival)
{
    if (n > MAX_LEN || n < MIN_LEN || memcmp(d, MAGIC, 4) != 0)
        return NULL;
    size_t body = n - MAC_LEN;
    unsigned char tag[MAC_LEN];
    if (compute_mac(d, body, tag) < 0 || CRYPTO_memcmp(tag, d + body, MAC_LEN) != 0)
        return NULL;
    unsigned type = d[4], slen = d[5];
    if ((type != 1 && type != 2) || slen < 1 || slen > MAX_NAME)
        return NULL;
    size_t off = 6 + slen;
    if (body < off + 1)
        return NULL;
    unsigned tlen = d[off];
    if (tlen < 1 || tlen > MAX_NAME || body != off + 1 + tlen + TAIL_LEN)
        return NULL;
    if ((Py_ssize_t)tlen != host->len || memcmp(d + off + 1, host->buf, tlen) != 0)
        return NULL;
    PyObject *sender = PyUnicode_DecodeUTF8((const char *)d + 6, slen, "strict");
    if (sender == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            return NULL;
        }
        return NULL;
    }
    const unsigned char *t = d + off + 1 + tlen;
    unsigned rail = ((unsigned)t[0] << 8) | t[1];
    return Py_BuildValue("(INIKKKOL)", type, sender, rail, (unsigned long long)be64(t + 2),
                         (unsigned long long)be64(t + 10), (unsigned long long)be64(t + 18), addr, arrival);
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
    static unsigned char ctrl[BATCH][CMSG_SPACE(sizeof(struct timespec)) + CMSG_SPACE(sizeof(uint32_t))];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    struct sockaddr_in names[BATCH];

    while (limit > 0) {
        unsigned want = limit < BATCH ? (unsigned)limit : BATCH;
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
        int got = recvmmsg(fd, msgs, want, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
                err = errno;
            break;
        }
        for (int i = 0; i < got; i++) {
            struct msghdr *h = &msgs[i].msg_hdr;
            long long arrival = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(h); c != NULL; c = CMSG_NXTHDR(h, c)) {
                if (c->cmsg_level != SOL_SOCKET)
                    continue;
                if (c->cmsg_type == SO_TIMESTAMPNS && c->cmsg_len >= CMSG_LEN(sizeof(struct timespec))) {
                    struct timespec ts;
                    memcpy(&ts, CMSG_DATA(c), sizeof ts);
                    arrival = (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
                } else if (c->cmsg_type == SO_RXQ_OVFL && c->cmsg_len >= CMSG_LEN(sizeof(uint32_t))) {
                    uint32_t v;
                    memcpy(&v, CMSG_DATA(c), sizeof v);
                    ovfl = v;
                }
            }
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
    size_t n = 0;
    memcpy(d, MAGIC, 4);
    n = 4;
    d[n++] = (unsigned char)type;
    d[n++] = (unsigned char)host.len;
    memcpy(d + n, host.buf, host.len);
    n += host.len;
    d[n++] = (unsigned char)target.len;
    memcpy(d + n, target.buf, target.len);
    n += target.len;
    d[n++] = (unsigned char)(rail >> 8);
    d[n++] = (unsigned char)(rail & 0xff);
    put_be64(d + n, seq);
    put_be64(d + n + 8, ts);
    put_be64(d + n + 16, ack);
    n += 24;
    if (compute_mac(d, n, d + n) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "OpenSSL HMAC-SHA256 failed");
        goto done;
    }
    n += MAC_LEN;
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
    PyObject *m = PyModule_Create(&module);
    if (m != NULL) {
        PyModule_AddIntConstant(m, "MAX_LEN", MAX_LEN);
        PyModule_AddIntConstant(m, "MIN_LEN", MIN_LEN);
    }
    return m;
}
