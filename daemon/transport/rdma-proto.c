/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <string.h>

#include "transport/rdma-proto.h"
#include "unaligned.h"

/* A write id in range and a non-empty byte range that does not wrap. */
static bool write_range_ok(uint64_t write_id, uint64_t start, uint64_t length) {
        return write_id != 0 && write_id <= RDMA_WRITE_ID_MAX && length != 0 && start + length >= start;
}

static bool printable(const uint8_t *s, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (s[i] < 0x20 || s[i] > 0x7e)
                        return false;
        return true;
}

static bool all_zero(const uint8_t *s, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (s[i])
                        return false;
        return true;
}

#define CONNECT_FIXED 29U /* flags port mtu gid_index qpn psn gid[16] name_len */
#define GRANT_SIZE 32U
#define DOWN_FIXED 5U
_Static_assert(RDMA_PROTO_MAX_PAYLOAD >= CONNECT_FIXED + RDMA_PROTO_NAME_MAX &&
                       RDMA_PROTO_MAX_PAYLOAD >= DOWN_FIXED + RDMA_PROTO_REASON_MAX,
               "RDMA_PROTO_MAX_PAYLOAD holds every message");
#define REQUEST_SIZE 44U
#define ACK_SIZE 12U

int rdma_message_decode(uint16_t type, const void *payload, size_t len, RdmaMessage *ret) {
        const uint8_t *p = payload;
        RdmaMessage m = { .type = type };

        if (!ret || (len > 0 && !p))
                return -EINVAL;
        switch (type) {
        case RDMA_MSG_CONNECT: {
                size_t nl;
                if (len < CONNECT_FIXED)
                        return -EBADMSG;
                nl = p[28];
                if (len != CONNECT_FIXED + nl || (p[0] & ~RDMA_CONNECT_HAVE_RDMA))
                        return -EBADMSG;
                if (p[0] & RDMA_CONNECT_HAVE_RDMA) {
                        m.connect.have_rdma = true;
                        m.connect.port = p[1];
                        m.connect.mtu = p[2];
                        m.connect.gid_index = p[3];
                        m.connect.qpn = unaligned_read_be32(p + 4);
                        m.connect.psn = unaligned_read_be32(p + 8);
                        memcpy(m.connect.gid, p + 12, 16);
                        if (m.connect.port == 0 || m.connect.mtu < 1 || m.connect.mtu > 5 ||
                            m.connect.qpn == 0 || m.connect.qpn > 0xffffff || m.connect.psn > 0xffffff ||
                            nl == 0 || nl > RDMA_PROTO_NAME_MAX || !printable(p + CONNECT_FIXED, nl))
                                return -EBADMSG;
                        memcpy(m.connect.device, p + CONNECT_FIXED, nl);
                } else if (!all_zero(p + 1, CONNECT_FIXED - 1 + nl))
                        return -EBADMSG; /* "none" carries nothing else */
                break;
        }
        case RDMA_MSG_GRANT:
                if (len != GRANT_SIZE)
                        return -EBADMSG;
                m.grant.write_id = unaligned_read_be64(p);
                m.grant.region = unaligned_read_be32(p + 8);
                m.grant.rkey = unaligned_read_be32(p + 12);
                m.grant.addr = unaligned_read_be64(p + 16);
                m.grant.length = unaligned_read_be64(p + 24);
                if (!write_range_ok(m.grant.write_id, m.grant.addr, m.grant.length))
                        return -EBADMSG;
                break;
        case RDMA_MSG_REQUEST:
                if (len != REQUEST_SIZE)
                        return -EBADMSG;
                m.request.write_id = unaligned_read_be64(p);
                m.request.cookie = unaligned_read_be64(p + 8);
                m.request.region = unaligned_read_be32(p + 16);
                m.request.offset = unaligned_read_be64(p + 20);
                m.request.length = unaligned_read_be64(p + 28);
                m.request.attempt = unaligned_read_be64(p + 36);
                if (!write_range_ok(m.request.write_id, m.request.offset, m.request.length))
                        return -EBADMSG;
                break;
        case RDMA_MSG_ACK:
                if (len != ACK_SIZE)
                        return -EBADMSG;
                m.ack.write_id = unaligned_read_be64(p);
                m.ack.error = unaligned_read_be32(p + 8);
                if (m.ack.write_id == 0 || m.ack.write_id > RDMA_WRITE_ID_MAX || m.ack.error > 4095)
                        return -EBADMSG;
                break;
        case RDMA_MSG_DOWN: {
                size_t rl;
                if (len < DOWN_FIXED)
                        return -EBADMSG;
                rl = p[4];
                m.down.error = unaligned_read_be32(p);
                if (len != DOWN_FIXED + rl || rl > RDMA_PROTO_REASON_MAX || m.down.error == 0 ||
                    m.down.error > 4095 || !printable(p + DOWN_FIXED, rl))
                        return -EBADMSG;
                memcpy(m.down.reason, p + DOWN_FIXED, rl);
                break;
        }
        default:
                return type >= RDMA_MSG_FIRST && type <= RDMA_MSG_LAST ? -EOPNOTSUPP : -EBADMSG;
        }
        *ret = m;
        return 0;
}

int rdma_message_encode(const RdmaMessage *m, uint8_t *buf, size_t size) {
        uint8_t tmp[RDMA_PROTO_MAX_PAYLOAD];
        RdmaMessage check;
        size_t n, l;

        if (!m || !buf || size < RDMA_PROTO_MAX_PAYLOAD)
                return -EINVAL;
        memset(tmp, 0, sizeof tmp);
        switch (m->type) {
        case RDMA_MSG_CONNECT:
                if (m->connect.have_rdma) {
                        l = strnlen(m->connect.device, sizeof m->connect.device);
                        if (l > RDMA_PROTO_NAME_MAX)
                                return -EINVAL;
                        tmp[0] = RDMA_CONNECT_HAVE_RDMA;
                        tmp[1] = m->connect.port;
                        tmp[2] = m->connect.mtu;
                        tmp[3] = m->connect.gid_index;
                        unaligned_write_be32(tmp + 4, m->connect.qpn);
                        unaligned_write_be32(tmp + 8, m->connect.psn);
                        memcpy(tmp + 12, m->connect.gid, 16);
                        tmp[28] = (uint8_t)l;
                        memcpy(tmp + CONNECT_FIXED, m->connect.device, l);
                        n = CONNECT_FIXED + l;
                } else
                        n = CONNECT_FIXED;
                break;
        case RDMA_MSG_GRANT:
                unaligned_write_be64(tmp, m->grant.write_id);
                unaligned_write_be32(tmp + 8, m->grant.region);
                unaligned_write_be32(tmp + 12, m->grant.rkey);
                unaligned_write_be64(tmp + 16, m->grant.addr);
                unaligned_write_be64(tmp + 24, m->grant.length);
                n = GRANT_SIZE;
                break;
        case RDMA_MSG_REQUEST:
                unaligned_write_be64(tmp, m->request.write_id);
                unaligned_write_be64(tmp + 8, m->request.cookie);
                unaligned_write_be32(tmp + 16, m->request.region);
                unaligned_write_be64(tmp + 20, m->request.offset);
                unaligned_write_be64(tmp + 28, m->request.length);
                unaligned_write_be64(tmp + 36, m->request.attempt);
                n = REQUEST_SIZE;
                break;
        case RDMA_MSG_ACK:
                unaligned_write_be64(tmp, m->ack.write_id);
                unaligned_write_be32(tmp + 8, m->ack.error);
                n = ACK_SIZE;
                break;
        case RDMA_MSG_DOWN:
                l = strnlen(m->down.reason, sizeof m->down.reason);
                if (l > RDMA_PROTO_REASON_MAX)
                        return -EINVAL;
                unaligned_write_be32(tmp, m->down.error);
                tmp[4] = (uint8_t)l;
                memcpy(tmp + DOWN_FIXED, m->down.reason, l);
                n = DOWN_FIXED + l;
                break;
        default:
                return -EINVAL;
        }
        /* Only what the decoder accepts goes on the wire. */
        if (rdma_message_decode(m->type, tmp, n, &check) < 0)
                return -EINVAL;
        memcpy(buf, tmp, n);
        return (int)n;
}
