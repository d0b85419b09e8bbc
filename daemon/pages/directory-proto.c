/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "pages/directory-proto.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "unaligned.h"

#define HEADER_SIZE 8 /* version flags reserved count */

bool directory_name_is_valid(const char *s, bool host) {
        size_t n = strnlen(s, DIRECTORY_NAME_MAX + 1);
        if (n > DIRECTORY_NAME_MAX || (host && n == 0))
                return false;
        for (size_t i = 0; i < n; i++) {
                unsigned char c = (unsigned char)s[i];
                if (host ? !(isalnum(c) || strchr("-_.", c)) : !isprint(c))
                        return false;
        }
        return true;
}

typedef struct Reader {
        const uint8_t *p;
        size_t left;
} Reader;

static int rd(Reader *r, void *dst, size_t n) {
        if (r->left < n)
                return -EBADMSG;
        memcpy(dst, r->p, n);
        r->p += n;
        r->left -= n;
        return 0;
}

static int rd_name(Reader *r, char *dst, bool host) {
        uint8_t n;
        if (rd(r, &n, 1) < 0 || n > DIRECTORY_NAME_MAX || rd(r, dst, n) < 0)
                return -EBADMSG;
        dst[n] = 0;
        if (memchr(dst, 0, n) || !directory_name_is_valid(dst, host))
                return -EBADMSG;
        return 0;
}

static int rd_u64(Reader *r, uint64_t *v) {
        if (r->left < 8)
                return -EBADMSG;
        *v = unaligned_read_le64(r->p);
        r->p += 8;
        r->left -= 8;
        return 0;
}

static int rd_header(Reader *r, uint32_t *count) {
        uint8_t h[HEADER_SIZE];
        if (rd(r, h, sizeof h) < 0)
                return -EBADMSG;
        if (h[0] != DIRECTORY_PROTO_VERSION)
                return h[0] > DIRECTORY_PROTO_VERSION ? -EPROTONOSUPPORT : -EBADMSG;
        if (h[1] != 0 || h[2] != 0 || h[3] != 0)
                return -EBADMSG;
        *count = unaligned_read_le32(h + 4);
        if (*count == 0 || *count > DIRECTORY_BATCH_MAX)
                return -EBADMSG;
        return 0;
}

static int rd_hashes(Reader *r, uint32_t count, uint64_t **ret) {
        uint64_t *h;
        if (r->left != (size_t)count * 8)
                return -EBADMSG;
        h = malloc((size_t)count * sizeof *h);
        if (!h)
                return -ENOMEM;
        for (uint32_t i = 0; i < count; i++)
                (void)rd_u64(r, h + i);
        *ret = h;
        return 0;
}

void directory_message_done(DirectoryMessage *m) {
        if (!m)
                return;
        free(m->hashes);
        free(m->entries);
        m->hashes = NULL;
        m->entries = NULL;
}

int directory_message_parse(uint16_t type, const void *payload, size_t len, DirectoryMessage *ret) {
        Reader r = { payload, len };
        DirectoryMessage m = { .type = type };
        int k;

        if (!payload && len > 0)
                return -EINVAL;
        k = rd_header(&r, &m.count);
        if (k < 0)
                return k;
        switch (type) {
        case DIRECTORY_MSG_PUBLISH:
        case DIRECTORY_MSG_UNPUBLISH:
                if (rd_name(&r, m.arena, false) < 0 || rd_name(&r, m.worker, false) < 0)
                        return -EBADMSG;
                k = rd_hashes(&r, m.count, &m.hashes);
                break;
        case DIRECTORY_MSG_LOOKUP:
                if (m.count > DIRECTORY_LOOKUP_MAX || rd_u64(&r, &m.request) < 0)
                        return -EBADMSG;
                k = rd_hashes(&r, m.count, &m.hashes);
                break;
        case DIRECTORY_MSG_ANSWER:
                if (m.count > DIRECTORY_LOOKUP_MAX || rd_u64(&r, &m.request) < 0)
                        return -EBADMSG;
                /* Each entry is at least 9 bytes: no allocation larger than the payload allows. */
                if (r.left < (size_t)m.count * 9)
                        return -EBADMSG;
                m.entries = calloc(m.count, sizeof *m.entries);
                if (!m.entries)
                        return -ENOMEM;
                k = 0;
                for (uint32_t i = 0; k >= 0 && i < m.count; i++) {
                        DirectoryAnswerEntry *e = m.entries + i;
                        k = rd_u64(&r, &e->hash);
                        if (k >= 0)
                                k = rd(&r, &e->n_holders, 1);
                        if (k >= 0 && e->n_holders > DIRECTORY_HOLDERS_MAX)
                                k = -EBADMSG;
                        for (unsigned j = 0; k >= 0 && j < e->n_holders; j++) {
                                DirectoryHolder *h = e->holders + j;
                                if (rd_name(&r, h->host, true) < 0 || rd_name(&r, h->arena, false) < 0 ||
                                    rd_name(&r, h->worker, false) < 0)
                                        k = -EBADMSG;
                        }
                }
                if (k >= 0 && r.left != 0)
                        k = -EBADMSG;
                break;
        default:
                return -EBADMSG;
        }
        if (k < 0) {
                directory_message_done(&m);
                return k;
        }
        *ret = m;
        return 0;
}

typedef struct Writer {
        uint8_t *p;
        size_t len;
} Writer;

static void wr(Writer *w, const void *src, size_t n) {
        memcpy(w->p + w->len, src, n);
        w->len += n;
}

static void wr_name(Writer *w, const char *s) {
        uint8_t n = (uint8_t)strlen(s);
        wr(w, &n, 1);
        wr(w, s, n);
}

static void wr_u64(Writer *w, uint64_t v) {
        unaligned_write_le64(w->p + w->len, v);
        w->len += 8;
}

static void wr_header(Writer *w, size_t count) {
        uint8_t h[HEADER_SIZE] = { DIRECTORY_PROTO_VERSION, 0, 0, 0 };
        unaligned_write_le32(h + 4, (uint32_t)count);
        wr(w, h, sizeof h);
}

int directory_publish_encode(uint16_t type, const char *arena, const char *worker, const uint64_t *hashes,
                             size_t n, uint8_t **ret, size_t *ret_len) {
        Writer w = {};

        if ((type != DIRECTORY_MSG_PUBLISH && type != DIRECTORY_MSG_UNPUBLISH) || n == 0 ||
            n > DIRECTORY_BATCH_MAX || !hashes || !arena || !worker || !directory_name_is_valid(arena, false) ||
            !directory_name_is_valid(worker, false))
                return -EINVAL;
        w.p = malloc(HEADER_SIZE + 2 + strlen(arena) + strlen(worker) + n * 8);
        if (!w.p)
                return -ENOMEM;
        wr_header(&w, n);
        wr_name(&w, arena);
        wr_name(&w, worker);
        for (size_t i = 0; i < n; i++)
                wr_u64(&w, hashes[i]);
        *ret = w.p;
        *ret_len = w.len;
        return 0;
}

int directory_lookup_encode(uint64_t request, const uint64_t *hashes, size_t n, uint8_t **ret, size_t *ret_len) {
        Writer w = {};

        if (n == 0 || n > DIRECTORY_LOOKUP_MAX || !hashes)
                return -EINVAL;
        w.p = malloc(HEADER_SIZE + 8 + n * 8);
        if (!w.p)
                return -ENOMEM;
        wr_header(&w, n);
        wr_u64(&w, request);
        for (size_t i = 0; i < n; i++)
                wr_u64(&w, hashes[i]);
        *ret = w.p;
        *ret_len = w.len;
        return 0;
}

int directory_answer_encode(uint64_t request, const DirectoryAnswerEntry *entries, size_t n, uint8_t **ret,
                            size_t *ret_len) {
        Writer w = {};
        size_t size = HEADER_SIZE + 8;

        if (n == 0 || n > DIRECTORY_LOOKUP_MAX || !entries)
                return -EINVAL;
        for (size_t i = 0; i < n; i++) {
                if (entries[i].n_holders > DIRECTORY_HOLDERS_MAX)
                        return -EINVAL;
                size += 9;
                for (unsigned j = 0; j < entries[i].n_holders; j++) {
                        const DirectoryHolder *h = entries[i].holders + j;
                        if (!directory_name_is_valid(h->host, true) || !directory_name_is_valid(h->arena, false) ||
                            !directory_name_is_valid(h->worker, false))
                                return -EINVAL;
                        size += 3 + strlen(h->host) + strlen(h->arena) + strlen(h->worker);
                }
        }
        w.p = malloc(size);
        if (!w.p)
                return -ENOMEM;
        wr_header(&w, n);
        wr_u64(&w, request);
        for (size_t i = 0; i < n; i++) {
                wr_u64(&w, entries[i].hash);
                wr(&w, &entries[i].n_holders, 1);
                for (unsigned j = 0; j < entries[i].n_holders; j++) {
                        wr_name(&w, entries[i].holders[j].host);
                        wr_name(&w, entries[i].holders[j].arena);
                        wr_name(&w, entries[i].holders[j].worker);
                }
        }
        *ret = w.p;
        *ret_len = w.len;
        return 0;
}
