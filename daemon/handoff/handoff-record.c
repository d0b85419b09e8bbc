/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "handoff/handoff-record.h"
#include "unaligned.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

size_t handoff_record_size(const HandoffRecord *r) {
        switch (r->type) {
        case HANDOFF_REC_PREPARED:
                return HANDOFF_REC_PREPARED_SIZE(r->n_pages);
        case HANDOFF_REC_COMMITTED:
                return HANDOFF_REC_HEADER_SIZE + r->extra_len;
        default:
                return HANDOFF_REC_HEADER_SIZE;
        }
}

void handoff_record_encode(void *buf, const HandoffRecord *r, const uint32_t *pages) {
        uint8_t *p = buf;
        memcpy(p, r->request_id.bytes, 16);
        unaligned_write_le(p + 16, r->token, 8);
        p[24] = (uint8_t)r->role;
        p[25] = r->type == HANDOFF_REC_ROLLED_BACK ? (uint8_t)r->cause : 0;
        unaligned_write_le(p + 26, 0, 2);
        unaligned_write_le(p + 28, r->type == HANDOFF_REC_PREPARED || r->type == HANDOFF_REC_GROUPS || r->type == HANDOFF_REC_COMMITTED ? r->value : 0, 4);
        if (r->type == HANDOFF_REC_PREPARED) {
                unaligned_write_le(p + 32, r->arena, 4);
                unaligned_write_le(p + 36, r->n_pages, 4);
                unaligned_write_le(p + 40, r->page_size, 8);
                for (uint32_t i = 0; i < r->n_pages; i++)
                        unaligned_write_le(p + 48 + 4 * (size_t)i, pages[i], 4);
        } else if (r->type == HANDOFF_REC_COMMITTED && r->extra_len > 0)
                memcpy(p + HANDOFF_REC_HEADER_SIZE, r->extra, r->extra_len);
}

int handoff_record_parse(uint8_t type, const void *buf, size_t n, HandoffRecord *ret) {
        const uint8_t *p = buf;
        if (type < HANDOFF_REC_PREPARED || type > HANDOFF_REC_RELEASED || n < HANDOFF_REC_HEADER_SIZE)
                return -EBADMSG;
        HandoffRecord r = { .type = type };
        memcpy(r.request_id.bytes, p, 16);
        r.token = unaligned_read_le(p + 16, 8);
        r.role = (HandoffRole)p[24];
        r.cause = (HandoffCause)p[25];
        r.value = (uint32_t)unaligned_read_le(p + 28, 4);
        if (p[24] >= _HANDOFF_ROLE_MAX || unaligned_read_le(p + 26, 2) != 0 || r.token == 0)
                return -EBADMSG;
        if (type == HANDOFF_REC_ROLLED_BACK ? p[25] >= _HANDOFF_CAUSE_MAX : p[25] != 0)
                return -EBADMSG;
        switch (type) {
        case HANDOFF_REC_PREPARED:
                if (n < HANDOFF_REC_PREPARED_SIZE(0))
                        return -EBADMSG;
                r.arena = (uint32_t)unaligned_read_le(p + 32, 4);
                r.n_pages = (uint32_t)unaligned_read_le(p + 36, 4);
                r.page_size = unaligned_read_le(p + 40, 8);
                if (r.value == 0 || r.value > HANDOFF_GROUPS_MAX || r.n_pages == 0 ||
                    r.n_pages > HANDOFF_JOURNAL_PAGES_MAX || r.page_size == 0 ||
                    n != HANDOFF_REC_PREPARED_SIZE(r.n_pages))
                        return -EBADMSG;
                r.pages = p + 48;
                break;
        case HANDOFF_REC_GROUPS:
                if (n != HANDOFF_REC_HEADER_SIZE || r.value > HANDOFF_GROUPS_MAX)
                        return -EBADMSG;
                break;
        case HANDOFF_REC_COMMITTED:
                if (r.value > HANDOFF_REC_COMMIT_PAIR || (r.value != 0 && r.role != HANDOFF_DESTINATION) ||
                    (n > HANDOFF_REC_HEADER_SIZE && r.role != HANDOFF_DESTINATION))
                        return -EBADMSG;
                r.extra = n > HANDOFF_REC_HEADER_SIZE ? p + HANDOFF_REC_HEADER_SIZE : NULL;
                r.extra_len = n - HANDOFF_REC_HEADER_SIZE;
                break;
        default:
                if (r.value != 0 || n != HANDOFF_REC_HEADER_SIZE)
                        return -EBADMSG;
                break;
        }
        *ret = r;
        return 0;
}

/* ---- the journal ---- */

static void make_key(uint8_t key[17], const EpdId *id, HandoffRole role) {
        memcpy(key, id->bytes, 16);
        key[16] = (uint8_t)role;
}

static HandoffJournalEntry *entry_free(HandoffJournalEntry *e) {
        if (e)
                free(e->pages);
        free(e);
        return NULL;
}

int handoff_journal_init(HandoffJournal *j) {
        j->entries = hashmap_new(HASHMAP_KEY_BYTES, 17);
        return j->entries ? 0 : -ENOMEM;
}

void handoff_journal_done(HandoffJournal *j) {
        HandoffJournalEntry *e;
        size_t i = 0;
        while (j->entries && hashmap_iterate(j->entries, &i, (void **)&e, NULL))
                entry_free(e);
        j->entries = hashmap_free(j->entries);
}

HandoffJournalEntry *handoff_journal_get(HandoffJournal *j, const EpdId *request_id, HandoffRole role) {
        uint8_t key[17];
        make_key(key, request_id, role);
        return j->entries ? hashmap_get(j->entries, key) : NULL;
}

size_t handoff_journal_size(const HandoffJournal *j) {
        return j->entries ? hashmap_size(j->entries) : 0;
}

bool handoff_journal_iterate(HandoffJournal *j, size_t *i, HandoffJournalEntry **ret) {
        return j->entries && hashmap_iterate(j->entries, i, (void **)ret, NULL);
}

int handoff_journal_apply(HandoffJournal *j, uint8_t type, const void *payload, size_t len) {
        HandoffRecord r;
        HandoffJournalEntry *e, *n;
        int k = handoff_record_parse(type, payload, len, &r);
        if (k < 0)
                return k;
        if (!j->entries)
                return -EINVAL;
        e = handoff_journal_get(j, &r.request_id, r.role);

        if (type == HANDOFF_REC_PREPARED) {
                if (e && e->token > r.token)
                        return -ESTALE;
                if (!e && hashmap_size(j->entries) >= HANDOFF_JOURNAL_MAX)
                        return -EDQUOT;
                n = calloc(1, sizeof *n);
                if (!n)
                        return -ENOMEM;
                n->pages = malloc((size_t)r.n_pages * sizeof *n->pages);
                if (!n->pages)
                        return entry_free(n), -ENOMEM;
                n->request_id = r.request_id;
                n->token = r.token;
                n->role = r.role;
                n->state = HANDOFF_PREPARED;
                n->n_groups = r.value;
                n->arena = r.arena;
                n->n_pages = r.n_pages;
                n->page_size = r.page_size;
                for (uint32_t i = 0; i < r.n_pages; i++)
                        n->pages[i] = (uint32_t)unaligned_read_le(r.pages + 4 * (size_t)i, 4);
                make_key(n->key, &r.request_id, r.role);
                void *old = NULL;
                k = hashmap_replace(j->entries, n->key, n, &old);
                if (k < 0)
                        return entry_free(n), k;
                entry_free(old);
                return 0;
        }

        if (!e || e->token != r.token)
                return -ENOENT;
        switch (type) {
        case HANDOFF_REC_GROUPS:
                if (e->state != HANDOFF_PREPARED || r.value > e->n_groups)
                        return -EINVAL;
                if (r.value > e->groups_done)
                        e->groups_done = r.value;
                return 0;
        case HANDOFF_REC_COMMITTED:
                if (e->state == HANDOFF_ROLLED_BACK)
                        return -ESTALE;
                if (r.extra_len > 0) {
                        /* The decode sequence's id: the first 16 bytes of its PUT. */
                        if (r.extra_len < 16)
                                return -EBADMSG;
                        memcpy(e->sequence.bytes, r.extra, 16);
                        e->has_sequence = true;
                }
                e->state = HANDOFF_COMMITTED;
                e->groups_done = e->n_groups;
                if (r.value == HANDOFF_REC_COMMIT_PAIR) {
                        /* The source side of the same attempt, in this daemon, with it. */
                        HandoffJournalEntry *src = handoff_journal_get(j, &r.request_id, HANDOFF_SOURCE);
                        if (src && src->token == r.token && src->state == HANDOFF_PREPARED) {
                                src->state = HANDOFF_COMMITTED;
                                src->groups_done = src->n_groups;
                        }
                }
                return 0;
        case HANDOFF_REC_ROLLED_BACK:
                if (e->state == HANDOFF_COMMITTED)
                        return -EALREADY;
                e->state = HANDOFF_ROLLED_BACK;
                e->cause = r.cause;
                return 0;
        case HANDOFF_REC_RELEASED:
                (void)hashmap_remove(j->entries, e->key);
                entry_free(e);
                return 0;
        default:
                return -EBADMSG;
        }
}

unsigned handoff_journal_recover(HandoffJournal *j, void (*fn)(void *userdata, const HandoffJournalEntry *e),
                                 void *userdata) {
        HandoffJournalEntry *e;
        unsigned n = 0;
        size_t i = 0;
        while (handoff_journal_iterate(j, &i, &e)) {
                e->recovered = true;
                if (e->state != HANDOFF_PREPARED)
                        continue;
                e->state = HANDOFF_ROLLED_BACK;
                e->cause = HANDOFF_CAUSE_SHUTDOWN;
                n++;
                if (fn)
                        fn(userdata, e);
        }
        return n;
}

int handoff_journal_snapshot_entry(const HandoffJournalEntry *e,
                                   int (*add)(void *userdata, uint8_t type, const void *rec, size_t len),
                                   void *userdata) {
        HandoffRecord r = {
                .type = HANDOFF_REC_PREPARED,
                .request_id = e->request_id,
                .token = e->token,
                .role = e->role,
                .value = e->n_groups,
                .arena = e->arena,
                .n_pages = e->n_pages,
                .page_size = e->page_size,
        };
        size_t len = handoff_record_size(&r);
        uint8_t *buf = malloc(len);
        int k;
        if (!buf)
                return -ENOMEM;
        handoff_record_encode(buf, &r, e->pages);
        k = add(userdata, HANDOFF_REC_PREPARED, buf, len);
        free(buf);
        if (k < 0)
                return k;

        uint8_t head[HANDOFF_REC_HEADER_SIZE];
        if (e->groups_done > 0 && e->state == HANDOFF_PREPARED) {
                r.type = HANDOFF_REC_GROUPS;
                r.value = e->groups_done;
                handoff_record_encode(head, &r, NULL);
                k = add(userdata, HANDOFF_REC_GROUPS, head, sizeof head);
                if (k < 0)
                        return k;
        }
        if (e->state == HANDOFF_COMMITTED || e->state == HANDOFF_ROLLED_BACK) {
                /* A committed destination keeps the id of its decode sequence (the
                 * sequence itself is in the snapshot as its own record). */
                uint8_t rec[HANDOFF_REC_HEADER_SIZE + 16];
                r.type = e->state == HANDOFF_COMMITTED ? HANDOFF_REC_COMMITTED : HANDOFF_REC_ROLLED_BACK;
                r.value = 0;
                r.cause = e->cause;
                if (r.type == HANDOFF_REC_COMMITTED && e->has_sequence) {
                        r.extra = e->sequence.bytes;
                        r.extra_len = 16;
                }
                handoff_record_encode(rec, &r, NULL);
                k = add(userdata, r.type, rec, handoff_record_size(&r));
                if (k < 0)
                        return k;
        }
        return 0;
}
