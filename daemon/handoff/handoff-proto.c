/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff-proto.h"
#include "macro.h"
#include "unaligned.h"

/* ---- bounded little-endian reader and writer ---- */

typedef struct Reader {
        const uint8_t *p;
        size_t left;
        bool bad;
} Reader;

static const uint8_t *take(Reader *r, size_t n) {
        if (r->bad || r->left < n) {
                r->bad = true;
                return NULL;
        }
        const uint8_t *p = r->p;
        r->p += n;
        r->left -= n;
        return p;
}

static uint64_t get_le(Reader *r, size_t n) {
        const uint8_t *p = take(r, n);
        return p ? unaligned_read_le(p, (unsigned)n) : 0;
}

static uint16_t get16(Reader *r) { return (uint16_t)get_le(r, 2); }
static uint32_t get32(Reader *r) { return (uint32_t)get_le(r, 4); }
static uint64_t get64(Reader *r) { return get_le(r, 8); }

static void get_id(Reader *r, EpdId *id) {
        const uint8_t *p = take(r, sizeof id->bytes);
        if (p)
                memcpy(id->bytes, p, sizeof id->bytes);
}

typedef struct Writer {
        uint8_t *p;
        size_t n, size;
} Writer;

static void put_le(Writer *w, uint64_t v, size_t n) {
        unaligned_write_le(w->p + w->n, v, (unsigned)n);
        w->n += n;
}

static void put16(Writer *w, uint16_t v) { put_le(w, v, 2); }
static void put32(Writer *w, uint32_t v) { put_le(w, v, 4); }
static void put64(Writer *w, uint64_t v) { put_le(w, v, 8); }

static void put_id(Writer *w, const EpdId *id) {
        memcpy(w->p + w->n, id->bytes, sizeof id->bytes);
        w->n += sizeof id->bytes;
}

/* ---- validation, shared by encode and decode ---- */

#define HEAD_SIZE (16 + 8)
#define PREPARE_FIXED (HEAD_SIZE + 8 * 3 + 16 + 4 + 4 + 4 + 4 + 8)
#define GROUP_HEAD 4
#define RANGE_SIZE 16

static bool cause_valid(int c) {
        return c > HANDOFF_CAUSE_NONE && c < _HANDOFF_CAUSE_MAX;
}

static int validate(const HandoffMessage *m) {
        if (epd_id_is_null(&m->request_id) || m->token == 0)
                return -EINVAL;

        switch (m->type) {
        case HANDOFF_MSG_PREPARE:
                if (m->page_size == 0 || m->page_size > HANDOFF_PAGE_SIZE_MAX)
                        return -EINVAL;
                if (m->n_pages == 0 || m->n_pages > HANDOFF_PAGES_MAX)
                        return -EINVAL;
                if (m->n_groups == 0 || m->n_groups > HANDOFF_GROUPS_MAX)
                        return -EINVAL;
                if (m->n_ranges == 0 || m->n_ranges > HANDOFF_PROTO_RANGES_MAX)
                        return -EINVAL;
                if (!m->group_ranges || !m->ranges)
                        return -EINVAL;
                if (m->group_ranges[0] != 0 || m->group_ranges[m->n_groups] != m->n_ranges)
                        return -EINVAL;
                if ((m->flags & ~HANDOFF_PREPARE_F_ALL) ||
                    (m->flags & HANDOFF_PREPARE_F_SLOT) == HANDOFF_PREPARE_F_SLOT ||
                    !(m->flags & HANDOFF_PREPARE_F_SLOT) != !m->slot)
                        return -EINVAL;
                for (uint32_t g = 0; g < m->n_groups; g++) {
                        HandoffGroupLayout l;
                        if (handoff_message_group_layout(m, g, &l) < 0 ||
                            handoff_group_layout_validate(&l, m->page_size) < 0)
                                return -EINVAL;
                }
                return 0;

        case HANDOFF_MSG_PREPARE_OK:
                if (m->n_pages == 0 || m->n_pages > HANDOFF_PAGES_MAX || !m->page_offsets)
                        return -EINVAL;
                return 0;

        case HANDOFF_MSG_PREPARE_REFUSED:
                if (!cause_valid(m->cause) || m->error >= 0 || m->error < -4095)
                        return -EINVAL;
                return 0;

        case HANDOFF_MSG_GROUP_SENT:
                return m->group < HANDOFF_GROUPS_MAX ? 0 : -EINVAL;

        case HANDOFF_MSG_COMMIT:
                return 0;

        case HANDOFF_MSG_ROLLBACK:
                return cause_valid(m->cause) ? 0 : -EINVAL;

        default:
                return -EOPNOTSUPP;
        }
}

int handoff_message_group_layout(const HandoffMessage *m, uint32_t g, HandoffGroupLayout *ret) {
        if (!m || !ret || m->type != HANDOFF_MSG_PREPARE || g >= m->n_groups || !m->group_ranges)
                return -EINVAL;
        uint32_t a = m->group_ranges[g], b = m->group_ranges[g + 1];
        if (b < a || b > m->n_ranges || b - a > HANDOFF_RANGES_PER_GROUP_MAX)
                return -EINVAL;
        ret->n_ranges = b - a;
        memcpy(ret->ranges, m->ranges + a, (size_t)(b - a) * sizeof(HandoffRange));
        return 0;
}

void handoff_message_done(HandoffMessage *m) {
        if (!m)
                return;
        free(m->group_ranges);
        free(m->ranges);
        free(m->page_offsets);
        m->group_ranges = NULL;
        m->ranges = NULL;
        m->page_offsets = NULL;
}

int handoff_message_decode(uint16_t type, const void *payload, size_t len, HandoffMessage *ret) {
        if (!ret || (!payload && len > 0))
                return -EINVAL;

        HandoffMessage m = { .type = type };
        Reader r = { .p = payload, .left = len };
        int e;

        if (type < HANDOFF_MSG_FIRST || type > HANDOFF_MSG_LAST)
                return -EINVAL;

        get_id(&r, &m.request_id);
        m.token = get64(&r);

        switch (type) {
        case HANDOFF_MSG_PREPARE: {
                m.timeout_usec = get64(&r);
                m.page_size = get64(&r);
                m.layout_hash = get64(&r);
                get_id(&r, &m.target_worker);
                m.n_pages = get32(&r);
                m.n_groups = get32(&r);
                m.flags = get32(&r);
                uint32_t reserved0 = get32(&r);
                m.slot = get64(&r);
                if (r.bad || reserved0 != 0 || m.n_groups == 0 || m.n_groups > HANDOFF_GROUPS_MAX)
                        return -EBADMSG;
                /* Each group takes at least GROUP_HEAD + one range: bound before
                 * allocating by what the payload can hold. */
                if (r.left / (GROUP_HEAD + RANGE_SIZE) < m.n_groups)
                        return -EBADMSG;
                m.group_ranges = calloc((size_t)m.n_groups + 1, sizeof *m.group_ranges);
                size_t max_ranges = MIN(r.left / RANGE_SIZE, (size_t)HANDOFF_PROTO_RANGES_MAX);
                m.ranges = calloc(MAX(max_ranges, (size_t)1), sizeof *m.ranges);
                if (!m.group_ranges || !m.ranges) {
                        handoff_message_done(&m);
                        return -ENOMEM;
                }
                uint32_t n = 0;
                for (uint32_t g = 0; g < m.n_groups; g++) {
                        uint16_t k = get16(&r);
                        uint16_t reserved = get16(&r);
                        if (r.bad || reserved != 0 || k == 0 || k > HANDOFF_RANGES_PER_GROUP_MAX ||
                            k > max_ranges - n) {
                                handoff_message_done(&m);
                                return -EBADMSG;
                        }
                        m.group_ranges[g] = n;
                        for (uint16_t i = 0; i < k; i++, n++) {
                                m.ranges[n].offset = get64(&r);
                                m.ranges[n].length = get64(&r);
                        }
                }
                m.group_ranges[m.n_groups] = n;
                m.n_ranges = n;
                break;
        }

        case HANDOFF_MSG_PREPARE_OK:
                m.region = get32(&r);
                m.n_pages = get32(&r);
                if (r.bad || m.n_pages == 0 || m.n_pages > HANDOFF_PAGES_MAX ||
                    r.left != (size_t)m.n_pages * 8)
                        return -EBADMSG;
                m.page_offsets = calloc(m.n_pages, sizeof *m.page_offsets);
                if (!m.page_offsets)
                        return -ENOMEM;
                for (uint32_t i = 0; i < m.n_pages; i++)
                        m.page_offsets[i] = get64(&r);
                break;

        case HANDOFF_MSG_PREPARE_REFUSED: {
                m.cause = get32(&r);
                uint32_t err = get32(&r);
                if (err == 0 || err > 4095)
                        return -EBADMSG;
                m.error = -(int)err;
                break;
        }

        case HANDOFF_MSG_GROUP_SENT:
                m.group = get32(&r);
                if (get32(&r) != 0)
                        return -EBADMSG;
                m.bytes = get64(&r);
                break;

        case HANDOFF_MSG_COMMIT:
                break;

        case HANDOFF_MSG_ROLLBACK:
                m.cause = get32(&r);
                if (get32(&r) != 0)
                        return -EBADMSG;
                break;

        default:
                return -EOPNOTSUPP;
        }

        if (r.bad || r.left != 0) {
                handoff_message_done(&m);
                return -EBADMSG;
        }
        e = validate(&m);
        if (e < 0) {
                handoff_message_done(&m);
                return e == -EOPNOTSUPP ? e : -EBADMSG;
        }
        *ret = m;
        return 0;
}

int handoff_message_decode_head(uint16_t type, const void *payload, size_t len, HandoffMessage *ret) {
        if (!ret || (!payload && len > 0))
                return -EINVAL;
        HandoffMessage m = { .type = type };
        Reader r = { .p = payload, .left = len };
        get_id(&r, &m.request_id);
        m.token = get64(&r);
        if (r.bad)
                return -EBADMSG;
        if (type == HANDOFF_MSG_PREPARE && len >= PREPARE_FIXED) {
                /* timeout, page size, layout hash, target, n_pages, n_groups */
                (void)take(&r, 8 + 8 + 8 + sizeof m.target_worker.bytes + 4 + 4);
                m.flags = get32(&r);
                (void)get32(&r);
                m.slot = get64(&r);
        }
        *ret = m;
        return 0;
}

int handoff_message_encode(const HandoffMessage *m, uint8_t **ret, size_t *ret_len) {
        if (!m || !ret || !ret_len)
                return -EINVAL;
        int e = validate(m);
        if (e < 0)
                return e;

        size_t size = HEAD_SIZE;
        switch (m->type) {
        case HANDOFF_MSG_PREPARE:
                size = PREPARE_FIXED + (size_t)m->n_groups * GROUP_HEAD + (size_t)m->n_ranges * RANGE_SIZE;
                break;
        case HANDOFF_MSG_PREPARE_OK:
                size += 8 + (size_t)m->n_pages * 8;
                break;
        case HANDOFF_MSG_PREPARE_REFUSED:
        case HANDOFF_MSG_ROLLBACK:
                size += 8;
                break;
        case HANDOFF_MSG_GROUP_SENT:
                size += 16;
                break;
        default:
                break;
        }

        Writer w = { .p = malloc(size), .size = size };
        if (!w.p)
                return -ENOMEM;

        put_id(&w, &m->request_id);
        put64(&w, m->token);
        switch (m->type) {
        case HANDOFF_MSG_PREPARE:
                put64(&w, m->timeout_usec);
                put64(&w, m->page_size);
                put64(&w, m->layout_hash);
                put_id(&w, &m->target_worker);
                put32(&w, m->n_pages);
                put32(&w, m->n_groups);
                put32(&w, m->flags);
                put32(&w, 0);
                put64(&w, m->slot);
                for (uint32_t g = 0; g < m->n_groups; g++) {
                        uint32_t a = m->group_ranges[g], b = m->group_ranges[g + 1];
                        put16(&w, (uint16_t)(b - a));
                        put16(&w, 0);
                        for (uint32_t i = a; i < b; i++) {
                                put64(&w, m->ranges[i].offset);
                                put64(&w, m->ranges[i].length);
                        }
                }
                break;
        case HANDOFF_MSG_PREPARE_OK:
                put32(&w, m->region);
                put32(&w, m->n_pages);
                for (uint32_t i = 0; i < m->n_pages; i++)
                        put64(&w, m->page_offsets[i]);
                break;
        case HANDOFF_MSG_PREPARE_REFUSED:
                put32(&w, (uint32_t)m->cause);
                put32(&w, (uint32_t)-m->error);
                break;
        case HANDOFF_MSG_GROUP_SENT:
                put32(&w, m->group);
                put32(&w, 0);
                put64(&w, m->bytes);
                break;
        case HANDOFF_MSG_ROLLBACK:
                put32(&w, (uint32_t)m->cause);
                put32(&w, 0);
                break;
        default:
                break;
        }

        if (w.n != size) {
                free(w.p);
                return -EIO; /* cannot happen: sizes above match the writes */
        }
        *ret = w.p;
        *ret_len = size;
        return 0;
}

const char *handoff_message_type_to_string(uint16_t type) {
        switch (type) {
        case HANDOFF_MSG_PREPARE:
                return "prepare";
        case HANDOFF_MSG_PREPARE_OK:
                return "prepare-ok";
        case HANDOFF_MSG_PREPARE_REFUSED:
                return "prepare-refused";
        case HANDOFF_MSG_GROUP_SENT:
                return "group-sent";
        case HANDOFF_MSG_COMMIT:
                return "commit";
        case HANDOFF_MSG_ROLLBACK:
                return "rollback";
        default:
                return NULL;
        }
}
