/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "epd/ring.h"
#include "handoff/handoff.h"
#include "handoff/ring.h"
#include "../check-main.h"

static const uint8_t rid[16] = { 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16 };

/* The worker's view: its own mapping of the memfd. */
typedef struct Worker {
        void *base;
        uint64_t size;
        struct epd_ring ring;
} Worker;

static void worker_map(Worker *w, const Ring *r) {
        w->size = r->size;
        w->base = mmap(NULL, w->size, PROT_READ | PROT_WRITE, MAP_SHARED, r->memfd, 0);
        ck_assert_ptr_ne(w->base, MAP_FAILED);
        ck_assert_int_eq(epd_ring_attach(&w->ring, w->base, w->size, 0), 0);
}

/* A daemon ring of 8 + 8 entries and the worker's view of it. */
static Ring *ring_8x8(Worker *w) {
        Ring *r = NULL;
        ck_assert_int_eq(ring_new(8, 8, &r), 0);
        worker_map(w, r);
        return r;
}

static void worker_unmap(Worker *w) {
        munmap(w->base, w->size);
}

static bool readable(int fd) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        return poll(&p, 1, 0) == 1;
}

START_TEST(test_ring_roundtrip) {
        Ring *r = NULL;
        Worker w;
        struct epd_ring_record rec, out;

        ck_assert_int_eq(ring_new(8, 16, &r), 0);
        worker_map(&w, r);
        ck_assert_uint_eq(w.ring.sq.entries, 8);
        ck_assert_uint_eq(w.ring.cq.entries, 16);

        /* Empty both ways. */
        ck_assert_int_eq(ring_consume(r, &out), -EAGAIN);
        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), -EAGAIN);
        ck_assert_int_eq(ring_kick(r), 0); /* nothing posted: no wakeup */
        ck_assert(!readable(r->complete_fd));

        /* Many rounds, to wrap the free-running indexes over the slots many times. */
        for (uint32_t round = 0; round < 100; round++) {
                for (uint32_t i = 0; i < 8; i++) {
                        epd_ring_record_layer_group_ready(&rec, rid, 99, i, round * 8 + i);
                        ck_assert_int_eq(epd_ring_produce(&w.ring.sq, &rec), 0);
                }
                ck_assert_int_eq(epd_ring_produce(&w.ring.sq, &rec), -EAGAIN); /* full */
                ck_assert_uint_eq(epd_ring_pending(&w.ring.sq, 1), 8);
                uint64_t one = 1;
                ck_assert_int_eq(write(r->submit_fd, &one, sizeof one), 8);
                ck_assert(readable(r->submit_fd));
                ck_assert_int_eq(ring_drain_submit(r), 1);
                ck_assert(!readable(r->submit_fd));
                ck_assert_int_eq(ring_drain_submit(r), 0);

                for (uint32_t i = 0; i < 8; i++) {
                        ck_assert_int_eq(ring_consume(r, &out), 0);
                        ck_assert_int_eq(ring_record_validate_submission(&out), 0);
                        ck_assert_uint_eq(out.opcode, EPD_RING_OP_LAYER_GROUP_READY);
                        ck_assert_uint_eq(out.group, i);
                        ck_assert_uint_eq(out.user_data, round * 8 + i);
                        ck_assert_uint_eq(out.token, 99);
                        ck_assert_mem_eq(out.request_id, rid, 16);
                        ring_record_group_progress(&rec, out.request_id, out.token, i + 1, 8, (i + 1) * 4096ULL);
                        ck_assert_int_eq(ring_post(r, &rec), 0);
                }
                ck_assert_int_eq(ring_consume(r, &out), -EAGAIN);
                ck_assert_int_eq(ring_kick(r), 1);
                ck_assert_int_eq(ring_kick(r), 0); /* one wakeup per batch */
                ck_assert(readable(r->complete_fd));
                uint64_t v;
                ck_assert_int_eq(read(r->complete_fd, &v, sizeof v), 8);
                for (uint32_t i = 0; i < 8; i++) {
                        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), 0);
                        ck_assert_uint_eq(out.opcode, EPD_RING_EV_GROUP_PROGRESS);
                        ck_assert_uint_eq(out.group, i + 1);
                        ck_assert_uint_eq(out.count, 8);
                        ck_assert_uint_eq(out.arg0, (i + 1) * 4096ULL);
                }
                ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), -EAGAIN);
        }
        ck_assert_uint_eq(r->submitted, 800);
        ck_assert_uint_eq(r->posted, 800);
        worker_unmap(&w);
        ring_free(r);
}
END_TEST

START_TEST(test_ring_overflow) {
        Worker w;
        Ring *r = ring_8x8(&w);
        struct epd_ring_record rec, out;
        ring_record_backpressure(&rec, "bravo", EPD_BACKPRESSURE_HIGH, EPD_BACKPRESSURE_REASON_RETRANSMITS, 900, 250);
        /* The CQ's 8, then the backlog's 4 x 8, then none. */
        for (unsigned i = 0; i < 8 + RING_BACKLOG_MAX(8); i++)
                ck_assert_int_eq(ring_post(r, &rec), 0);
        ck_assert_uint_eq(__atomic_load_n(epd_ring_cq_backlog(&w.ring), __ATOMIC_ACQUIRE), RING_BACKLOG_MAX(8));
        ck_assert_int_eq(ring_post(r, &rec), -ENOBUFS);
        ck_assert_int_eq(ring_post(r, &rec), -ENOBUFS);
        ck_assert_uint_eq(r->overflows, 2);
        ck_assert_uint_eq(__atomic_load_n(w.ring.cq_overflow, __ATOMIC_ACQUIRE), 2);
        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), 0);
        ck_assert_uint_eq(out.opcode, EPD_RING_EV_BACKPRESSURE);
        ck_assert_uint_eq(out.arg0, 900);
        ck_assert_uint_eq(out.arg1, 250);
        struct epd_ring_backpressure bp;
        ck_assert_int_eq(epd_ring_record_backpressure(&out, &bp), 0);
        ck_assert_str_eq(bp.peer, "bravo");
        ck_assert_int_eq(bp.truncated, 0);
        ck_assert_uint_eq(bp.level, EPD_BACKPRESSURE_HIGH);
        ck_assert_uint_eq(bp.reason, EPD_BACKPRESSURE_REASON_RETRANSMITS);
        ck_assert_uint_eq(bp.permille, 900);
        ck_assert_uint_eq(bp.retry_after_usec, 250);
        ck_assert_uint_eq(ring_flush_backlog(r), RING_BACKLOG_MAX(8) - 1); /* room for one */
        ck_assert_int_eq(ring_post(r, &rec), 0); /* room in the backlog again */
        worker_unmap(&w);
        ring_free(r);
}
END_TEST

/* A worker that does not drain: what the CQ cannot take waits in the backlog, in order,
 * and is posted as the worker makes room (at the next post, kick or flush). */
START_TEST(test_ring_backlog_order) {
        Worker w;
        Ring *r = ring_8x8(&w);
        struct epd_ring_record rec, out;
        for (uint64_t i = 0; i < 20; i++) {
                ring_record_completion(&rec, i, 0);
                ck_assert_int_eq(ring_post(r, &rec), 0);
        }
        ck_assert_uint_eq(r->backlog_n, 12);
        ck_assert_uint_eq(r->backlogged, 12);
        ck_assert_uint_eq(__atomic_load_n(epd_ring_cq_backlog(&w.ring), __ATOMIC_ACQUIRE), 12);
        ck_assert_int_eq(ring_kick(r), 1);
        ck_assert(readable(r->complete_fd));
        uint64_t next = 0;
        for (int round = 0; round < 3; round++) {
                while (epd_ring_consume(&w.ring.cq, &out) == 0) {
                        ck_assert_uint_eq(out.user_data, next);
                        next++;
                }
                (void)ring_kick(r); /* what the daemon does on the worker's wakeup */
        }
        ck_assert_uint_eq(next, 20);
        ck_assert_uint_eq(r->backlog_n, 0);
        ck_assert_uint_eq(__atomic_load_n(epd_ring_cq_backlog(&w.ring), __ATOMIC_ACQUIRE), 0);
        ck_assert_uint_eq(r->overflows, 0);
        /* A post behind a backlog goes behind it, even with room in the CQ. */
        for (uint64_t i = 0; i < 9; i++) {
                ring_record_completion(&rec, 100 + i, 0);
                ck_assert_int_eq(ring_post(r, &rec), 0);
        }
        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), 0);
        ck_assert_uint_eq(out.user_data, 100);
        ring_record_completion(&rec, 109, 0);
        ck_assert_int_eq(ring_post(r, &rec), 0); /* the room taken by the backlog's 108 */
        ck_assert_uint_eq(r->backlog_n, 1);
        for (uint64_t i = 101; i <= 108; i++) {
                ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), 0);
                ck_assert_uint_eq(out.user_data, i);
        }
        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), -EAGAIN);
        ck_assert_uint_eq(ring_flush_backlog(r), 0);
        ck_assert_int_eq(epd_ring_consume(&w.ring.cq, &out), 0);
        ck_assert_uint_eq(out.user_data, 109);
        worker_unmap(&w);
        ring_free(r);
}
END_TEST

START_TEST(test_ring_backpressure_record) {
        struct epd_ring_record rec;
        struct epd_ring_backpressure bp;
        /* Exactly 32 bytes: fills the field, no terminator in the record, not cut. */
        const char *p32 = "host-0123456789abcdef0123456789a";
        ck_assert_uint_eq(strlen(p32), 32);
        ring_record_backpressure(&rec, p32, EPD_BACKPRESSURE_STALLED, EPD_BACKPRESSURE_REASON_DISCONNECTED, 1000,
                                 1000000);
        ck_assert_int_eq(epd_ring_record_backpressure(&rec, &bp), 0);
        ck_assert_str_eq(bp.peer, p32);
        ck_assert_int_eq(bp.truncated, 0);
        ck_assert_uint_eq(bp.level, EPD_BACKPRESSURE_STALLED);
        ck_assert_uint_eq(bp.reason, EPD_BACKPRESSURE_REASON_DISCONNECTED);
        ck_assert_uint_eq(rec.token >> 56, (uint8_t)'a'); /* the host id spans user_data..token */
        /* Longer: cut at 32 and flagged. */
        ring_record_backpressure(&rec, "gpu-node-17.rack-4.cluster.example.com", EPD_BACKPRESSURE_NONE,
                                 EPD_BACKPRESSURE_REASON_NONE, 0, 0);
        ck_assert_int_eq(epd_ring_record_backpressure(&rec, &bp), 0);
        ck_assert_int_eq(bp.truncated, 1);
        ck_assert_uint_eq(strlen(bp.peer), 32);
        ck_assert_int_eq(strncmp(bp.peer, "gpu-node-17.rack-4.cluster.examp", 32), 0);
        ck_assert_uint_eq(bp.retry_after_usec, 0);
        /* Not a backpressure record, or an unknown level. */
        ring_record_completion(&rec, 7, 0);
        ck_assert_int_eq(epd_ring_record_backpressure(&rec, &bp), -EINVAL);
        ring_record_backpressure(&rec, "x", 9, 0, 0, 0);
        ck_assert_int_eq(epd_ring_record_backpressure(&rec, &bp), -EINVAL);
        ck_assert_str_eq(ring_opcode_to_string(EPD_RING_EV_BACKPRESSURE), "backpressure");
}
END_TEST

START_TEST(test_ring_hostile_worker) {
        Ring *r = NULL;
        Worker w;
        struct epd_ring_record rec, out;
        ck_assert_int_eq(ring_new(8, 8, &r), 0);
        worker_map(&w, r);

        /* The worker cannot shrink or grow the memfd under the daemon. */
        ck_assert_int_ne(ftruncate(r->memfd, 0), 0);
        ck_assert_int_ne(ftruncate(r->memfd, (off_t)r->size * 2), 0);

        /* A tail too far ahead: the daemon sees a corrupt queue and stops reading it. */
        __atomic_store_n(w.ring.sq.tail, 1000, __ATOMIC_RELEASE);
        ck_assert_int_eq(ring_consume(r, &out), -EBADMSG);
        ck_assert(r->broken);
        ck_assert_int_eq(ring_consume(r, &out), -EBADMSG);
        ring_record_completion(&rec, 1, 0);
        ck_assert_int_eq(ring_post(r, &rec), -EBADMSG);
        worker_unmap(&w);
        ring_free(r);

        /* A head the worker moved past the daemon's tail breaks the CQ side. */
        ck_assert_int_eq(ring_new(8, 8, &r), 0);
        worker_map(&w, r);
        __atomic_store_n(w.ring.cq.head, 5, __ATOMIC_RELEASE);
        ck_assert_int_eq(ring_post(r, &rec), -EBADMSG);
        worker_unmap(&w);
        ring_free(r);
}
END_TEST

START_TEST(test_ring_new_fails_half_way) {
        /* The memfd is made and mapped, then no fd is left for the eventfds: the
         * half-made ring is freed (no ring view yet, no wakeup to give), the error said,
         * no fd kept. */
        struct rlimit old, lim;
        ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &old), 0);
        int probe = open("/dev/null", O_RDONLY | O_CLOEXEC);
        ck_assert_int_ge(probe, 0);
        close(probe);
        lim = old;
        lim.rlim_cur = (rlim_t)probe + 1; /* room for the memfd alone */
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &lim), 0);
        Ring *r = NULL;
        int k = ring_new(8, 8, &r);
        ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &old), 0);
        ck_assert_int_eq(k, -EMFILE);
        ck_assert_ptr_null(r);
        int again = open("/dev/null", O_RDONLY | O_CLOEXEC);
        ck_assert_int_eq(again, probe); /* the memfd was closed */
        close(again);
        ck_assert_int_eq(ring_new(8, 8, &r), 0);
        ring_free(r);
}
END_TEST

START_TEST(test_ring_validate) {
        struct epd_ring_record rec;
        epd_ring_record_layer_group_ready(&rec, rid, 5, 3, 0);
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        rec.flags = EPD_RING_F_ACK;
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        rec.flags = 0x8000;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        rec.flags = 0;
        rec.token = 0;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        rec.token = 5;
        rec.group = HANDOFF_GROUPS_MAX;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        rec.group = 1;
        rec.result = -1;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        rec.result = 0;
        rec.arg0 = 1;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        static const uint8_t zero[16] = {};
        epd_ring_record_layer_group_ready(&rec, zero, 5, 3, 0);
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        memset(&rec, 0, sizeof rec);
        rec.opcode = EPD_RING_OP_NOP;
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        rec.opcode = EPD_RING_EV_COMPLETION; /* a daemon record submitted by a worker */
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EOPNOTSUPP);
        rec.opcode = 0x7777;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EOPNOTSUPP);
        /* ACCEPT: a request id and a wait in arg0; nothing else. */
        epd_ring_record_accept(&rec, rid, 250000, 12);
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        ck_assert_uint_eq(rec.arg0, 250000);
        rec.token = 1;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        epd_ring_record_accept(&rec, rid, 0, 12);
        rec.count = 2;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        epd_ring_record_accept(&rec, zero, 0, 12);
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        ring_record_handoff_accepted(&rec, 12, rid, 77, 1, 4, 16, 2);
        ck_assert_uint_eq(rec.opcode, EPD_RING_EV_HANDOFF_ACCEPTED);
        ck_assert_uint_eq(rec.user_data, 12);
        ck_assert_uint_eq(rec.token, 77);
        ck_assert_uint_eq(rec.group, 1);
        ck_assert_uint_eq(rec.count, 4);
        ck_assert_uint_eq(rec.arg0, 16);
        ck_assert_uint_eq(rec.arg1, 2);
        ck_assert_str_eq(ring_opcode_to_string(EPD_RING_OP_ACCEPT), "accept");
        /* COMMIT: a request id, a token, and in arg0 only EPD_RING_COMMIT_RELEASE. */
        epd_ring_record_commit(&rec, rid, 77, 1, 13);
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        ck_assert_uint_eq(rec.arg0, EPD_RING_COMMIT_RELEASE);
        ck_assert_uint_eq(rec.user_data, 13);
        epd_ring_record_commit(&rec, rid, 77, 0, 13);
        ck_assert_int_eq(ring_record_validate_submission(&rec), 0);
        ck_assert_uint_eq(rec.arg0, 0);
        rec.arg0 = 2;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        epd_ring_record_commit(&rec, rid, 0, 1, 13);
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        epd_ring_record_commit(&rec, zero, 77, 1, 13);
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        epd_ring_record_commit(&rec, rid, 77, 1, 13);
        rec.group = 1;
        ck_assert_int_eq(ring_record_validate_submission(&rec), -EINVAL);
        ck_assert_str_eq(ring_opcode_to_string(EPD_RING_OP_COMMIT), "commit");
        /* A commit's answer names the decode sequence by its id's bytes. */
        char path[EPD_RING_SEQUENCE_PATH_MAX];
        ring_record_completion(&rec, 13, 0);
        for (int i = 0; i < 16; i++)
                rec.request_id[i] = (uint8_t)(0xa0 + i);
        ck_assert_int_eq(epd_ring_record_sequence_path(&rec, path, sizeof path - 1), -ENOBUFS);
        ck_assert_int_eq(epd_ring_record_sequence_path(&rec, path, sizeof path), 0);
        ck_assert_str_eq(path, "/org/epd1/sequence/a0a1a2a3a4a5a6a7a8a9aaabacadaeaf");
        rec.result = -EBUSY;
        ck_assert_int_eq(epd_ring_record_sequence_path(&rec, path, sizeof path), -EINVAL);
        ck_assert_ptr_null(ring_opcode_to_string(0x7777));
        ck_assert_str_eq(ring_opcode_to_string(EPD_RING_OP_LAYER_GROUP_READY), "layer-group-ready");

        ring_record_handoff_state(&rec, rid, 8, EPD_HANDOFF_STATE_ROLLED_BACK, EPD_HANDOFF_CAUSE_TIMEOUT);
        ck_assert_uint_eq(rec.opcode, EPD_RING_EV_HANDOFF_STATE);
        ck_assert_uint_eq(rec.arg0, HANDOFF_ROLLED_BACK);
        ck_assert_uint_eq(rec.arg1, HANDOFF_CAUSE_TIMEOUT);
        ck_assert_uint_eq(rec.token, 8);
}
END_TEST

START_TEST(test_ring_attach_checks) {
        Ring *r = NULL;
        ck_assert_int_eq(ring_new(7, 8, &r), -EINVAL);
        ck_assert_int_eq(ring_new(8, EPD_RING_ENTRIES_MAX * 2, &r), -EINVAL);
        ck_assert_int_eq(ring_new(4, 8, &r), -EINVAL);
        ck_assert_int_eq(ring_new(8, 8, &r), 0);

        struct epd_ring v;
        void *copy = malloc(r->size);
        struct epd_ring_header *h = copy;
#define RESET() memcpy(copy, r->base, r->size)
        RESET();
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), 0);
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size - 1, 0), -EBADMSG);
        ck_assert_int_eq(epd_ring_attach(&v, copy, 10, 0), -EINVAL);
        h->magic = 0;
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EPROTONOSUPPORT);
        RESET();
        h->version = 2;
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EPROTONOSUPPORT);
        RESET();
        h->sq_entries = 12;
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
        RESET();
        h->cq_offset = h->sq_offset; /* overlapping queues */
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
        RESET();
        h->cq_offset = h->size; /* past the end */
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
        RESET();
        h->sq_offset = 64; /* over the indexes */
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
        RESET();
        h->cq_offset = 0; /* the completion queue over the header and the indexes */
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
        RESET();
        h->cq_offset = 64;
        ck_assert_int_eq(epd_ring_attach(&v, copy, r->size, 0), -EBADMSG);
#undef RESET
        free(copy);
        ring_free(r);
        ck_assert_ptr_null(ring_free(NULL));
}
END_TEST

int main(void) {
        Suite *s = suite_create("ring");
        TCase *tc = tcase_create("ring");
        tcase_add_test(tc, test_ring_roundtrip);
        tcase_add_test(tc, test_ring_overflow);
        tcase_add_test(tc, test_ring_backlog_order);
        tcase_add_test(tc, test_ring_backpressure_record);
        tcase_add_test(tc, test_ring_hostile_worker);
        tcase_add_test(tc, test_ring_new_fails_half_way);
        tcase_add_test(tc, test_ring_validate);
        tcase_add_test(tc, test_ring_attach_checks);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
