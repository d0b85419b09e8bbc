/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <unistd.h>

#include "handoff/handoff.h"
#include "handoff/ring.h"
#include "macro.h"
#include "telemetry/backpressure.h"

/* The ring ABI's numbers are the state machine's. */
_Static_assert((int)EPD_HANDOFF_STATE_PREPARING == (int)HANDOFF_PREPARING, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_PREPARED == (int)HANDOFF_PREPARED, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_TRANSFERRING == (int)HANDOFF_TRANSFERRING, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_TRANSFERRED == (int)HANDOFF_TRANSFERRED, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_COMMITTED == (int)HANDOFF_COMMITTED, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_RELEASED == (int)HANDOFF_RELEASED, "ABI");
_Static_assert((int)EPD_HANDOFF_STATE_ROLLED_BACK == (int)HANDOFF_ROLLED_BACK, "ABI");
_Static_assert((int)EPD_HANDOFF_CAUSE_PROTOCOL == (int)HANDOFF_CAUSE_PROTOCOL, "ABI");
_Static_assert((int)EPD_HANDOFF_CAUSE_PROTOCOL + 1 == (int)_HANDOFF_CAUSE_MAX, "ABI: add new causes to epd/ring.h");
_Static_assert((int)EPD_HANDOFF_CAUSE_TIMEOUT == (int)HANDOFF_CAUSE_TIMEOUT, "ABI");
_Static_assert((int)EPD_HANDOFF_CAUSE_PEER_DOWN == (int)HANDOFF_CAUSE_PEER_DOWN, "ABI");
_Static_assert((int)EPD_HANDOFF_CAUSE_NO_SPACE == (int)HANDOFF_CAUSE_NO_SPACE, "ABI");

int ring_new(uint32_t sq_entries, uint32_t cq_entries, Ring **ret) {
        if (!ret || !epd_ring_entries_valid(sq_entries) || !epd_ring_entries_valid(cq_entries))
                return -EINVAL;

        long ps = sysconf(_SC_PAGESIZE);
        uint64_t size = ALIGN_TO(epd_ring_size(sq_entries, cq_entries), (uint64_t)(ps > 0 ? ps : 4096));

        Ring *r = calloc(1, sizeof *r);
        if (!r)
                return -ENOMEM;
        r->memfd = r->submit_fd = r->complete_fd = -EBADF;
        r->base = MAP_FAILED;

        int e;
        r->memfd = memfd_create("epd-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (r->memfd < 0)
                goto fail_errno;
        if (ftruncate(r->memfd, (off_t)size) < 0)
                goto fail_errno;
        /* The worker maps it too: it must not be able to shrink it under us (SIGBUS). */
        if (fcntl(r->memfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
                goto fail_errno;
        r->base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, r->memfd, 0);
        if (r->base == MAP_FAILED)
                goto fail_errno;
        r->size = size;
        r->submit_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (r->submit_fd < 0)
                goto fail_errno;
        r->complete_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (r->complete_fd < 0)
                goto fail_errno;

        struct epd_ring_header h = {
                .magic = EPD_RING_MAGIC,
                .version = EPD_RING_VERSION,
                .record_size = EPD_RING_RECORD_SIZE,
                .sq_entries = sq_entries,
                .cq_entries = cq_entries,
                .sq_offset = EPD_RING_OFF_RECORDS,
                .cq_offset = EPD_RING_OFF_RECORDS + (uint64_t)sq_entries * EPD_RING_RECORD_SIZE,
                .size = size,
        };
        memcpy(r->base, &h, sizeof h);
        e = epd_ring_attach(&r->view, r->base, size, 1);
        if (e < 0) {
                ring_free(r);
                return e;
        }
        *ret = r;
        return 0;

fail_errno:
        e = negative_errno();
        ring_free(r);
        return e;
}

void ring_mark_closed(Ring *r) {
        /* A worker waiting on the ring learns that nothing more comes (its client may
         * stay connected: a corrupt queue, CloseRing, an answer it could not take): after
         * the records posted, the flag, then a last wakeup. Through the mapping itself: a
         * ring that failed half-way through ring_new() has no view. */
        if (!r || r->base == MAP_FAILED || !r->base)
                return;
        if (r->size >= EPD_RING_OFF_CLOSED + sizeof(uint32_t))
                __atomic_store_n((uint32_t *)((uint8_t *)r->base + EPD_RING_OFF_CLOSED), 1U, __ATOMIC_RELEASE);
        if (r->complete_fd >= 0) {
                uint64_t one = 1;
                (void)!write(r->complete_fd, &one, sizeof one);
        }
}

Ring *ring_free(Ring *r) {
        if (!r)
                return NULL;
        if (r->base != MAP_FAILED && r->base) {
                ring_mark_closed(r);
                (void)munmap(r->base, r->size);
        }
        free(r->backlog);
        safe_close(r->memfd);
        safe_close(r->submit_fd);
        safe_close(r->complete_fd);
        free(r);
        return NULL;
}

int ring_consume(Ring *r, struct epd_ring_record *rec) {
        if (!r || !rec)
                return -EINVAL;
        if (r->broken)
                return -EBADMSG;
        int e = epd_ring_consume(&r->view.sq, rec);
        if (e == -EBADMSG)
                r->broken = true;
        if (e == 0)
                r->submitted++;
        return e;
}

int ring_record_validate_submission(const struct epd_ring_record *rec) {
        if (!rec)
                return -EINVAL;
        if (rec->flags & ~EPD_RING_F_ACK)
                return -EINVAL;
        if (rec->result != 0 || rec->arg1 != 0)
                return -EINVAL;
        switch (rec->opcode) {
        case EPD_RING_OP_NOP:
                return 0;
        case EPD_RING_OP_LAYER_GROUP_READY: {
                static const uint8_t zero[16] = {};
                if (memcmp(rec->request_id, zero, 16) == 0 || rec->token == 0)
                        return -EINVAL;
                if (rec->group >= HANDOFF_GROUPS_MAX || rec->count != 0 || rec->arg0 != 0)
                        return -EINVAL;
                return 0;
        }
        case EPD_RING_OP_ACCEPT: {
                static const uint8_t zero[16] = {};
                /* arg0: how long to wait, in microseconds. */
                if (memcmp(rec->request_id, zero, 16) == 0 || rec->token != 0 || rec->group != 0 ||
                    rec->count != 0)
                        return -EINVAL;
                return 0;
        }
        case EPD_RING_OP_COMMIT: {
                static const uint8_t zero[16] = {};
                if (memcmp(rec->request_id, zero, 16) == 0 || rec->token == 0 || rec->group != 0 ||
                    rec->count != 0 || (rec->arg0 & ~EPD_RING_COMMIT_RELEASE))
                        return -EINVAL;
                return 0;
        }
        default:
                return -EOPNOTSUPP;
        }
}

static void set_backlog(Ring *r) {
        __atomic_store_n(epd_ring_cq_backlog(&r->view), r->backlog_n, __ATOMIC_RELEASE);
}

uint32_t ring_flush_backlog(Ring *r) {
        if (!r || r->broken || r->backlog_n == 0)
                return r ? r->backlog_n : 0;
        uint32_t k = 0;
        while (k < r->backlog_n) {
                int e = epd_ring_produce(&r->view.cq, &r->backlog[k]);
                if (e == -EBADMSG)
                        r->broken = true;
                if (e < 0)
                        break;
                k++;
        }
        if (k > 0) {
                memmove(r->backlog, r->backlog + k, (size_t)(r->backlog_n - k) * sizeof *r->backlog);
                r->backlog_n -= k;
                r->posted += k;
                r->kick_pending = true;
                set_backlog(r);
        }
        return r->backlog_n;
}

int ring_post(Ring *r, const struct epd_ring_record *rec) {
        if (!r || !rec)
                return -EINVAL;
        if (r->broken)
                return -EBADMSG;
        int e = r->backlog_n > 0 ? -EAGAIN : epd_ring_produce(&r->view.cq, rec); /* in order behind the backlog */
        if (e == -EBADMSG) {
                r->broken = true;
                return e;
        }
        r->kick_pending = true; /* posted, or waiting for room: wake the worker to drain */
        if (e == 0) {
                r->posted++;
                return 0;
        }
        if (r->backlog_n >= RING_BACKLOG_MAX(r->view.cq.entries)) {
                r->overflows++;
                __atomic_fetch_add(r->view.cq_overflow, 1, __ATOMIC_RELEASE);
                return -ENOBUFS;
        }
        if (r->backlog_n == r->backlog_cap) {
                uint32_t cap = r->backlog_cap ? r->backlog_cap * 2 : 16;
                struct epd_ring_record *b = reallocarray(r->backlog, cap, sizeof *b);
                if (!b) {
                        /* Not posted: counted where ring.h says every such record is. */
                        r->overflows++;
                        __atomic_fetch_add(r->view.cq_overflow, 1, __ATOMIC_RELEASE);
                        return -ENOMEM;
                }
                r->backlog = b;
                r->backlog_cap = cap;
        }
        r->backlog[r->backlog_n++] = *rec;
        r->backlogged++;
        set_backlog(r);
        /* The worker may have made room and looked at cq_backlog before it was set (it
         * then wrote no wakeup): look at the CQ again after setting it. */
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        (void)ring_flush_backlog(r);
        return 0;
}

int ring_kick(Ring *r) {
        if (!r)
                return -EINVAL;
        (void)ring_flush_backlog(r);
        if (!r->kick_pending)
                return 0;
        uint64_t one = 1;
        if (write(r->complete_fd, &one, sizeof one) < 0 && errno != EAGAIN)
                return -errno;
        /* EAGAIN: the counter is saturated, the worker is already woken. */
        r->kick_pending = false;
        return 1;
}

int ring_drain_submit(Ring *r) {
        if (!r)
                return -EINVAL;
        uint64_t v;
        if (read(r->submit_fd, &v, sizeof v) < 0)
                return errno == EAGAIN ? 0 : -errno;
        return 1;
}

int ring_wake_submit(Ring *r) {
        if (!r)
                return -EINVAL;
        uint64_t one = 1;
        if (write(r->submit_fd, &one, sizeof one) < 0 && errno != EAGAIN)
                return -errno;
        return 0;
}

void ring_record_completion(struct epd_ring_record *rec, uint64_t user_data, int result) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_EV_COMPLETION;
        rec->user_data = user_data;
        rec->result = result;
}

void ring_record_group_progress(struct epd_ring_record *rec, const uint8_t request_id[16],
                                uint64_t token, uint32_t groups_done, uint32_t n_groups,
                                uint64_t bytes) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_EV_GROUP_PROGRESS;
        memcpy(rec->request_id, request_id, 16);
        rec->token = token;
        rec->group = groups_done;
        rec->count = n_groups;
        rec->arg0 = bytes;
}

void ring_record_handoff_state(struct epd_ring_record *rec, const uint8_t request_id[16],
                               uint64_t token, uint32_t state, uint32_t cause) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_EV_HANDOFF_STATE;
        memcpy(rec->request_id, request_id, 16);
        rec->token = token;
        rec->arg0 = state;
        rec->arg1 = cause;
}

void ring_record_handoff_accepted(struct epd_ring_record *rec, uint64_t user_data, const uint8_t request_id[16],
                                  uint64_t token, uint32_t groups_done, uint32_t n_groups, uint32_t n_pages,
                                  uint32_t arena) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_EV_HANDOFF_ACCEPTED;
        rec->user_data = user_data;
        memcpy(rec->request_id, request_id, 16);
        rec->token = token;
        rec->group = groups_done;
        rec->count = n_groups;
        rec->arg0 = n_pages;
        rec->arg1 = arena;
}

_Static_assert(offsetof(struct epd_ring_record, group) == 8 + EPD_RING_PEER_MAX, "backpressure record ABI");
_Static_assert((int)EPD_BACKPRESSURE_STALLED == (int)BACKPRESSURE_STALLED &&
               (int)EPD_BACKPRESSURE_HIGH == (int)BACKPRESSURE_HIGH &&
               (int)EPD_BACKPRESSURE_ELEVATED == (int)BACKPRESSURE_ELEVATED, "backpressure levels ABI");
_Static_assert((int)EPD_BACKPRESSURE_REASON_DISCONNECTED == (int)BACKPRESSURE_REASON_DISCONNECTED &&
               (int)EPD_BACKPRESSURE_REASON_RETRANSMITS == (int)BACKPRESSURE_REASON_RETRANSMITS &&
               (int)EPD_BACKPRESSURE_REASON_DESTINATION_FULL == (int)BACKPRESSURE_REASON_DESTINATION_FULL &&
               (int)_BACKPRESSURE_REASON_MAX == (int)EPD_BACKPRESSURE_REASON_DISCONNECTED + 1,
               "backpressure reasons ABI");

void ring_record_backpressure(struct epd_ring_record *rec, const char *peer, uint32_t level, uint32_t reason,
                              uint32_t permille, uint64_t delay_usec) {
        memset(rec, 0, sizeof *rec);
        rec->opcode = EPD_RING_EV_BACKPRESSURE;
        size_t n = peer ? strlen(peer) : 0;
        if (n > EPD_RING_PEER_MAX) {
                n = EPD_RING_PEER_MAX;
                rec->flags |= EPD_RING_F_PEER_TRUNCATED;
        }
        if (n > 0)
                memcpy((uint8_t *)rec + 8, peer, n);
        rec->group = level;
        rec->count = reason;
        rec->arg0 = permille;
        rec->arg1 = delay_usec;
}

const char *ring_opcode_to_string(uint16_t opcode) {
        switch (opcode) {
        case EPD_RING_OP_NOP:
                return "nop";
        case EPD_RING_OP_LAYER_GROUP_READY:
                return "layer-group-ready";
        case EPD_RING_OP_ACCEPT:
                return "accept";
        case EPD_RING_OP_COMMIT:
                return "commit";
        case EPD_RING_EV_HANDOFF_ACCEPTED:
                return "handoff-accepted";
        case EPD_RING_EV_COMPLETION:
                return "completion";
        case EPD_RING_EV_GROUP_PROGRESS:
                return "group-progress";
        case EPD_RING_EV_HANDOFF_STATE:
                return "handoff-state";
        case EPD_RING_EV_BACKPRESSURE:
                return "backpressure";
        default:
                return NULL;
        }
}
