/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <endian.h>
#include <errno.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "macro.h"
#include "peer/peer-proto.h"
#include "unaligned.h"

/* Big-endian cursors over unaligned.h. */
static void put8(uint8_t **p, uint8_t v) {
        *(*p)++ = v;
}
static void put16(uint8_t **p, uint16_t v) {
        unaligned_write_be16(*p, v);
        *p += 2;
}
static void put32(uint8_t **p, uint32_t v) {
        unaligned_write_be32(*p, v);
        *p += 4;
}
static void put64(uint8_t **p, uint64_t v) {
        unaligned_write_be64(*p, v);
        *p += 8;
}
static void putbytes(uint8_t **p, const void *b, size_t n) {
        memcpy(*p, b, n);
        *p += n;
}
static uint8_t get8(const uint8_t **p) {
        return *(*p)++;
}
static uint16_t get16(const uint8_t **p) {
        *p += 2;
        return unaligned_read_be16(*p - 2);
}
static uint32_t get32(const uint8_t **p) {
        *p += 4;
        return unaligned_read_be32(*p - 4);
}
static uint64_t get64(const uint8_t **p) {
        *p += 8;
        return unaligned_read_be64(*p - 8);
}
static void getbytes(const uint8_t **p, void *b, size_t n) {
        memcpy(b, *p, n);
        *p += n;
}

uint32_t peer_frame_max_payload(uint16_t type) {
        if (type == PEER_MSG_DATA)
                return PEER_DATA_HEADER_SIZE + PEER_SLICE_MAX;
        return PEER_FRAME_MAX_PAYLOAD;
}

void peer_frame_header_encode(void *buf, uint16_t type, uint32_t length) {
        uint8_t *p = buf;
        put32(&p, PEER_FRAME_MAGIC);
        put8(&p, PEER_PROTOCOL_VERSION);
        put8(&p, 0);
        put16(&p, type);
        put32(&p, length);
        put32(&p, 0);
}

int peer_frame_header_decode(const void *buf, size_t len, PeerFrameHeader *ret) {
        const uint8_t *p = buf;
        PeerFrameHeader h;
        uint32_t magic, reserved;

        if (!buf || len < PEER_FRAME_HEADER_SIZE)
                return -EBADMSG;
        magic = get32(&p);
        h.version = get8(&p);
        h.flags = get8(&p);
        h.type = get16(&p);
        h.length = get32(&p);
        reserved = get32(&p);
        if (magic != PEER_FRAME_MAGIC)
                return -EBADMSG;
        if (h.version != PEER_PROTOCOL_VERSION)
                return -EPROTONOSUPPORT;
        if (h.flags != 0 || reserved != 0)
                return -EBADMSG;
        if (h.length > peer_frame_max_payload(h.type))
                return -EMSGSIZE;
        if (h.type == PEER_MSG_DATA && h.length <= PEER_DATA_HEADER_SIZE)
                return -EBADMSG;
        if (ret)
                *ret = h;
        return 0;
}

bool peer_host_id_is_valid(const char *s) {
        size_t n;

        if (!s)
                return false;
        n = strnlen(s, PEER_HOST_ID_MAX + 1);
        if (n == 0 || n > PEER_HOST_ID_MAX)
                return false;
        for (size_t i = 0; i < n; i++) {
                char c = s[i];
                if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-' || c == ':'))
                        return false;
        }
        return true;
}

static int put_host_id(uint8_t **p, const uint8_t *end, const char *id) {
        size_t n;

        if (!peer_host_id_is_valid(id))
                return -EINVAL;
        n = strlen(id);
        if ((size_t)(end - *p) < 1 + n)
                return -ENOBUFS;
        put8(p, (uint8_t)n);
        putbytes(p, id, n);
        return 0;
}

static int get_host_id(const uint8_t **p, const uint8_t *end, char out[static PEER_HOST_ID_MAX + 1]) {
        size_t n;

        if (end - *p < 1)
                return -EBADMSG;
        n = get8(p);
        if (n == 0 || n > PEER_HOST_ID_MAX || (size_t)(end - *p) < n)
                return -EBADMSG;
        getbytes(p, out, n);
        out[n] = 0;
        if (!peer_host_id_is_valid(out) || strlen(out) != n)
                return -EBADMSG;
        return 0;
}

/* HELLO: role u8, min u8, max u8, pad u8, stream_index u16, n_streams u16, session u64,
 * nonce[32], host_id (u8 length + bytes). */
#define HELLO_FIXED (1 + 1 + 1 + 1 + 2 + 2 + 8 + PEER_NONCE_SIZE)

int peer_hello_encode(const PeerHello *h, void *buf, size_t n) {
        uint8_t *p = buf, *end = p + n;
        int r;

        if (n < HELLO_FIXED)
                return -ENOBUFS;
        put8(&p, h->role);
        put8(&p, h->min_version);
        put8(&p, h->max_version);
        put8(&p, 0);
        put16(&p, h->stream_index);
        put16(&p, h->n_streams);
        put64(&p, h->session_id);
        putbytes(&p, h->nonce, PEER_NONCE_SIZE);
        r = put_host_id(&p, end, h->host_id);
        if (r < 0)
                return r;
        return (int)(p - (uint8_t *)buf);
}

int peer_hello_decode(const void *buf, size_t n, PeerHello *ret) {
        const uint8_t *p = buf, *end = p + n;
        PeerHello h = {};

        if (!buf || n < HELLO_FIXED)
                return -EBADMSG;
        h.role = get8(&p);
        h.min_version = get8(&p);
        h.max_version = get8(&p);
        if (get8(&p) != 0)
                return -EBADMSG;
        h.stream_index = get16(&p);
        h.n_streams = get16(&p);
        h.session_id = get64(&p);
        getbytes(&p, h.nonce, PEER_NONCE_SIZE);
        if (get_host_id(&p, end, h.host_id) < 0)
                return -EBADMSG;
        if (p != end)
                return -EBADMSG;
        if (h.min_version == 0 || h.min_version > h.max_version)
                return -EBADMSG;
        switch (h.role) {
        case PEER_ROLE_CONTROL:
                if (h.stream_index != 0 || h.session_id != 0 || h.n_streams > PEER_MAX_STREAMS)
                        return -EBADMSG;
                break;
        case PEER_ROLE_DATA:
                if (h.session_id == 0 || h.stream_index >= PEER_MAX_STREAMS || h.n_streams != 0)
                        return -EBADMSG;
                break;
        default:
                return -EBADMSG;
        }
        *ret = h;
        return 0;
}

int peer_challenge_encode(const PeerChallenge *c, void *buf, size_t n) {
        uint8_t *p = buf, *end = p + n;
        int r;

        if (n < PEER_NONCE_SIZE + PEER_MAC_SIZE)
                return -ENOBUFS;
        putbytes(&p, c->nonce, PEER_NONCE_SIZE);
        putbytes(&p, c->mac, PEER_MAC_SIZE);
        r = put_host_id(&p, end, c->host_id);
        if (r < 0)
                return r;
        return (int)(p - (uint8_t *)buf);
}

int peer_challenge_decode(const void *buf, size_t n, PeerChallenge *ret) {
        const uint8_t *p = buf, *end = p + n;
        PeerChallenge c = {};

        if (!buf || n < PEER_NONCE_SIZE + PEER_MAC_SIZE)
                return -EBADMSG;
        getbytes(&p, c.nonce, PEER_NONCE_SIZE);
        getbytes(&p, c.mac, PEER_MAC_SIZE);
        if (get_host_id(&p, end, c.host_id) < 0 || p != end)
                return -EBADMSG;
        *ret = c;
        return 0;
}

int peer_auth_msg_encode(const PeerAuth *a, void *buf, size_t n) {
        if (n < PEER_MAC_SIZE)
                return -ENOBUFS;
        memcpy(buf, a->mac, PEER_MAC_SIZE);
        return PEER_MAC_SIZE;
}

int peer_auth_msg_decode(const void *buf, size_t n, PeerAuth *ret) {
        if (!buf || n != PEER_MAC_SIZE)
                return -EBADMSG;
        memcpy(ret->mac, buf, PEER_MAC_SIZE);
        return 0;
}

#define AUTH_OK_SIZE (8 + 4 + 2 + 2)

int peer_auth_ok_encode(const PeerAuthOk *o, void *buf, size_t n) {
        uint8_t *p = buf;

        if (n < AUTH_OK_SIZE)
                return -ENOBUFS;
        put64(&p, o->session_id);
        put32(&p, o->heartbeat_ms);
        put16(&p, o->n_streams);
        put16(&p, 0);
        return AUTH_OK_SIZE;
}

int peer_auth_ok_decode(const void *buf, size_t n, PeerAuthOk *ret) {
        const uint8_t *p = buf;
        PeerAuthOk o;

        if (!buf || n != AUTH_OK_SIZE)
                return -EBADMSG;
        o.session_id = get64(&p);
        o.heartbeat_ms = get32(&p);
        o.n_streams = get16(&p);
        if (get16(&p) != 0)
                return -EBADMSG;
        if (o.session_id == 0 || o.n_streams > PEER_MAX_STREAMS || o.heartbeat_ms < PEER_HEARTBEAT_MS_MIN ||
            o.heartbeat_ms > PEER_HEARTBEAT_MS_MAX)
                return -EBADMSG;
        *ret = o;
        return 0;
}

int peer_reason_encode(const PeerReason *r, void *buf, size_t n) {
        uint8_t *p = buf;

        if (n < 4)
                return -ENOBUFS;
        put32(&p, r->reason);
        return 4;
}

int peer_reason_decode(const void *buf, size_t n, PeerReason *ret) {
        const uint8_t *p = buf;

        if (!buf || n != 4)
                return -EBADMSG;
        ret->reason = get32(&p);
        return 0;
}

int peer_heartbeat_encode(const PeerHeartbeat *h, void *buf, size_t n) {
        uint8_t *p = buf;

        if (n < 16)
                return -ENOBUFS;
        put64(&p, h->seq);
        put64(&p, h->time_usec);
        return 16;
}

int peer_heartbeat_decode(const void *buf, size_t n, PeerHeartbeat *ret) {
        const uint8_t *p = buf;

        if (!buf || n != 16)
                return -EBADMSG;
        ret->seq = get64(&p);
        ret->time_usec = get64(&p);
        return 0;
}

int peer_write_ack_encode(const PeerWriteAck *a, void *buf, size_t n) {
        uint8_t *p = buf;

        if (n < PEER_WRITE_ACK_SIZE)
                return -ENOBUFS;
        if (a->error > 0 || a->error < -4095)
                return -EINVAL;
        put64(&p, a->write_id);
        put32(&p, (uint32_t)a->error);
        return PEER_WRITE_ACK_SIZE;
}

int peer_write_ack_decode(const void *buf, size_t n, PeerWriteAck *ret) {
        const uint8_t *p = buf;
        PeerWriteAck a;

        if (!buf || n != PEER_WRITE_ACK_SIZE)
                return -EBADMSG;
        a.write_id = get64(&p);
        a.error = (int32_t)get32(&p);
        if (a.error > 0 || a.error < -4095)
                return -EBADMSG;
        *ret = a;
        return 0;
}

uint64_t peer_slice_count(uint64_t total, uint32_t slice_size) {
        if (slice_size == 0)
                return 0;
        return total / slice_size + (total % slice_size != 0);
}

uint64_t peer_slice_length(uint64_t total, uint32_t slice_size, uint64_t index) {
        uint64_t off;

        if (slice_size == 0 || MUL_OVERFLOW(index, (uint64_t)slice_size, &off) || off >= total)
                return 0;
        return MIN((uint64_t)slice_size, total - off);
}

int peer_data_header_encode(const PeerDataHeader *d, void *buf, size_t n) {
        uint8_t *p = buf;

        if (n < PEER_DATA_HEADER_SIZE)
                return -ENOBUFS;
        put64(&p, d->write_id);
        put64(&p, d->cookie);
        put64(&p, d->dst_offset);
        put64(&p, d->total_length);
        put64(&p, d->slice_offset);
        put32(&p, d->region);
        put32(&p, d->slice_size);
        put64(&p, d->target);
        put64(&p, d->imm);
        put32(&p, d->flags);
        put32(&p, 0);
        return PEER_DATA_HEADER_SIZE;
}

int peer_data_header_decode(const void *buf, size_t n, uint32_t payload_length,
                            PeerDataHeader *ret) {
        const uint8_t *p = buf;
        PeerDataHeader d;
        uint64_t slice_len, end, index;

        if (!buf || n < PEER_DATA_HEADER_SIZE || payload_length <= PEER_DATA_HEADER_SIZE ||
            payload_length > PEER_DATA_HEADER_SIZE + PEER_SLICE_MAX)
                return -EBADMSG;
        d.write_id = get64(&p);
        d.cookie = get64(&p);
        d.dst_offset = get64(&p);
        d.total_length = get64(&p);
        d.slice_offset = get64(&p);
        d.region = get32(&p);
        d.slice_size = get32(&p);
        d.target = get64(&p);
        d.imm = get64(&p);
        d.flags = get32(&p);
        if (get32(&p) != 0 || (d.flags & ~PEER_DATA_F_ALL) || (!(d.flags & PEER_DATA_F_TARGET) && d.target != 0) ||
            (!(d.flags & PEER_DATA_F_IMM) && d.imm != 0) || ((d.flags & PEER_DATA_F_TARGET) && d.region != 0))
                return -EBADMSG;

        slice_len = payload_length - PEER_DATA_HEADER_SIZE;
        if (d.slice_size < PEER_SLICE_MIN || d.slice_size > PEER_SLICE_MAX)
                return -EBADMSG;
        if (d.total_length == 0 || ADD_OVERFLOW(d.dst_offset, d.total_length, &end))
                return -EBADMSG;
        if (peer_slice_count(d.total_length, d.slice_size) > PEER_MAX_SLICES_PER_WRITE)
                return -EBADMSG;
        if (d.slice_offset % d.slice_size != 0 || d.slice_offset >= d.total_length)
                return -EBADMSG;
        index = d.slice_offset / d.slice_size;
        if (slice_len != peer_slice_length(d.total_length, d.slice_size, index))
                return -EBADMSG;
        *ret = d;
        return 0;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

size_t peer_ack_runs_build(uint64_t *ids, size_t n, PeerAckRun *runs, size_t max, size_t *ret_used) {
        size_t k = 0, i;

        if (n > 1)
                qsort(ids, n, sizeof *ids, cmp_u64);
        for (i = 0; i < n; i++) {
                if (k > 0 && runs[k - 1].first + runs[k - 1].count == ids[i] && runs[k - 1].count < UINT32_MAX)
                        runs[k - 1].count++;
                else if (k < max)
                        runs[k++] = (PeerAckRun){ .first = ids[i], .count = 1 };
                else
                        break;
        }
        *ret_used = i;
        return k;
}

int peer_write_acks_encode(const PeerAckRun *runs, size_t n_runs, void *buf, size_t n) {
        uint8_t *p = buf;
        uint64_t end;

        if (n_runs == 0 || n_runs > PEER_WRITE_ACKS_RUNS_MAX || !runs)
                return -EINVAL;
        if (n < PEER_WRITE_ACKS_SIZE(n_runs))
                return -ENOBUFS;
        put32(&p, (uint32_t)n_runs);
        put32(&p, 0);
        for (size_t i = 0; i < n_runs; i++) {
                if (runs[i].count == 0 || ADD_OVERFLOW(runs[i].first, (uint64_t)runs[i].count, &end))
                        return -EINVAL;
                put64(&p, runs[i].first);
                put32(&p, runs[i].count);
                put32(&p, 0);
        }
        return (int)PEER_WRITE_ACKS_SIZE(n_runs);
}

int peer_write_acks_decode(const void *buf, size_t n, PeerAckRun *runs, size_t max, size_t *ret_n) {
        const uint8_t *p = buf;
        uint32_t k;
        uint64_t end;

        if (!buf || n < 8)
                return -EBADMSG;
        k = get32(&p);
        if (get32(&p) != 0 || k == 0 || k > PEER_WRITE_ACKS_RUNS_MAX || n != PEER_WRITE_ACKS_SIZE(k) || k > max)
                return -EBADMSG;
        for (uint32_t i = 0; i < k; i++) {
                runs[i].first = get64(&p);
                runs[i].count = get32(&p);
                if (get32(&p) != 0 || runs[i].count == 0 ||
                    ADD_OVERFLOW(runs[i].first, (uint64_t)runs[i].count, &end))
                        return -EBADMSG;
        }
        *ret_n = k;
        return 0;
}

int peer_frame_build(void *buf, size_t n, uint16_t type, const void *payload, size_t len) {
        if (len > peer_frame_max_payload(type))
                return -EMSGSIZE;
        if (n < PEER_FRAME_HEADER_SIZE + len || PEER_FRAME_HEADER_SIZE + len > INT32_MAX)
                return -ENOBUFS;
        peer_frame_header_encode(buf, type, (uint32_t)len);
        if (len > 0)
                memcpy((uint8_t *)buf + PEER_FRAME_HEADER_SIZE, payload, len);
        return (int)(PEER_FRAME_HEADER_SIZE + len);
}

const char *peer_msg_type_to_string(uint16_t type) {
        switch (type) {
        case PEER_MSG_HELLO: return "hello";
        case PEER_MSG_CHALLENGE: return "challenge";
        case PEER_MSG_AUTH: return "auth";
        case PEER_MSG_AUTH_OK: return "auth-ok";
        case PEER_MSG_AUTH_FAIL: return "auth-fail";
        case PEER_MSG_HEARTBEAT: return "heartbeat";
        case PEER_MSG_BYE: return "bye";
        case PEER_MSG_DATA: return "data";
        case PEER_MSG_WRITE_ACK: return "write-ack";
        case PEER_MSG_WRITE_ACKS: return "write-acks";
        }
        if (type >= PEER_MSG_HANDOFF_FIRST && type <= PEER_MSG_HANDOFF_LAST)
                return "handoff";
        if (type >= PEER_MSG_DIRECTORY_FIRST && type <= PEER_MSG_DIRECTORY_LAST)
                return "directory";
        if (type >= PEER_MSG_TELEMETRY_FIRST && type <= PEER_MSG_TELEMETRY_LAST)
                return "telemetry";
        return "unknown";
}

const char *peer_fail_reason_to_string(uint32_t reason) {
        switch (reason) {
        case PEER_FAIL_UNKNOWN_HOST: return "unknown-host";
        case PEER_FAIL_BAD_MAC: return "bad-mac";
        case PEER_FAIL_VERSION: return "version";
        case PEER_FAIL_SESSION: return "session";
        case PEER_FAIL_PROTOCOL: return "protocol";
        case PEER_FAIL_SHUTDOWN: return "shutdown";
        case PEER_FAIL_SUPERSEDED: return "superseded";
        }
        return "unknown";
}

int peer_address_parse(const char *s, struct sockaddr_storage *ret, unsigned *ret_len) {
        char host[INET6_ADDRSTRLEN + 1];
        const char *colon, *h;
        size_t hl;
        char *end;
        unsigned long port;

        if (!s || !ret)
                return -EINVAL;
        if (s[0] == '[') {
                const char *close = strchr(s, ']');
                if (!close || close[1] != ':')
                        return -EINVAL;
                h = s + 1;
                hl = (size_t)(close - h);
                colon = close + 1;
        } else {
                colon = strrchr(s, ':');
                if (!colon || memchr(s, ':', (size_t)(colon - s)))
                        return -EINVAL;
                h = s;
                hl = (size_t)(colon - s);
        }
        if (hl == 0 || hl >= sizeof host)
                return -EINVAL;
        memcpy(host, h, hl);
        host[hl] = 0;
        if (colon[1] < '0' || colon[1] > '9')
                return -EINVAL;
        errno = 0;
        port = strtoul(colon + 1, &end, 10);
        if (errno != 0 || *end != 0 || port == 0 || port > 65535)
                return -EINVAL;

        memset(ret, 0, sizeof *ret);
        if (s[0] == '[') {
                struct sockaddr_in6 *a = (struct sockaddr_in6 *)ret;
                a->sin6_family = AF_INET6;
                a->sin6_port = htons((uint16_t)port);
                if (inet_pton(AF_INET6, host, &a->sin6_addr) != 1)
                        return -EINVAL;
                if (ret_len)
                        *ret_len = sizeof *a;
        } else {
                struct sockaddr_in *a = (struct sockaddr_in *)ret;
                a->sin_family = AF_INET;
                a->sin_port = htons((uint16_t)port);
                if (inet_pton(AF_INET, host, &a->sin_addr) != 1)
                        return -EINVAL;
                if (ret_len)
                        *ret_len = sizeof *a;
        }
        return 0;
}
