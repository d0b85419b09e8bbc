/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The tcp transport's receive path, two transports in one event loop over a socketpair
 * (the peer layer's operations are this file's: acknowledgements are handed straight
 * to the sender):
 *  - many small writes (layer groups of 1792 bytes) land byte-exact, read ahead several
 *    at a time, and big writes read straight into their region land likewise, in any
 *    mix;
 *  - a write whose target is not announced yet parks the stream with the writes behind
 *    it already read ahead: once the target is announced (resume_incoming) every one of
 *    them lands, although no further byte arrives on the socket to wake the stream;
 *  - writes posted one call after another (handoffs prepared by successive bus calls)
 *    leave together when the loop turns, not one sendmsg() each; 2 MiB posted leave at
 *    once, and posts a busy loop holds go after their bound (flush_overdue);
 *  - a stream whose full socket drains while posts are held writes the peer's held
 *    control frames before their data. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <systemd/sd-event.h>

#include "macro.h"
#include "time-util.h"
#include "peer/peer-proto.h"
#include "transport/tcp.h"
#include "../check-main.h"

#define REGION_SIZE (8U << 20)

struct Peer {
        int side;          /* 0: the sender's view of the receiver, 1: the receiver's of the sender */
        void *slot;
};

static struct Peer to_b = { 0 }, to_a = { 1 };
static Transport *ta, *tb;
static sd_event *ev;
static uint64_t announced = 0;   /* targets 1..announced are known at the receiver */
static uint64_t target_base[64]; /* where target k's bytes go in region 1 */
static size_t landed, completed, asked_again;
static int failures;
static bool failure_expected; /* a test that provokes a protocol error */

static const char *p_name(Peer *p) {
        return p->side ? "alpha" : "bravo";
}
static bool p_up(Peer *p) {
        return true;
}
static void **p_slot(Peer *p, TransportKind kind) {
        return &p->slot;
}
/* Control messages: the receiver's acknowledgements go to the sender at once. */
static bool raw_writes; /* writes framed by the test, not posted by ta: acks go nowhere */
static int p_send(Peer *p, uint16_t type, const void *payload, size_t len) {
        ck_assert_int_eq(p->side, 1);
        if (raw_writes)
                return 0;
        if (type == PEER_MSG_WRITE_ACKS) {
                PeerAckRun runs[64];
                size_t n;
                ck_assert_int_ge(peer_write_acks_decode(payload, len, runs, 64, &n), 0);
                tcp_transport_writes_acked(ta, &to_b, runs, n);
                return 0;
        }
        ck_abort_msg("unexpected control message %u", type);
        return -EPROTO;
}
static void p_cork(Peer *p) {
}
/* The peer layer's control frames held for the idle point: written before the data
 * (queued_at_receiver() then still 0: nothing of the data on the wire yet). */
static int rx_fd;
static int queued_at_receiver(void);
static unsigned control_flushes, control_flushed_after_data;
static void p_flush_control(Peer *p) {
        control_flushes++;
        if (queued_at_receiver() > 0)
                control_flushed_after_data++;
}
static void p_stream_failed(Peer *p, int error, const char *what) {
        failures++;
        if (!failure_expected)
                ck_abort_msg("stream failed: %s: %s", what, strerror(-error));
}
static int p_validate(void *userdata, Peer *p, TransportIncoming *in) {
        if (!(in->flags & TRANSPORT_WRITE_TARGET))
                return 0;
        if (in->target > announced) {
                asked_again++;
                return -EAGAIN;
        }
        in->region = 1;
        in->offset += target_base[in->target];
        return 0;
}
static size_t cancelled;
static void p_done(void *userdata, Peer *p, const TransportIncoming *in, int error) {
        if (error < 0 && failure_expected) {
                cancelled++;
                return;
        }
        ck_assert_int_eq(error, 0);
        landed++;
}

static const TransportPeerOps ops = {
        .name = p_name, .is_up = p_up, .slot = p_slot, .send = p_send, .cork = p_cork, .uncork = p_cork, .flush_control = p_flush_control,
        .stream_failed = p_stream_failed, .validate_incoming = p_validate, .incoming_done = p_done,
};

static uint8_t *src, *dst;
static TransportRegion rs, rd;

static void setup(void) {
        int sv[2];
        ck_assert_int_ge(sd_event_new(&ev), 0);
        ck_assert_int_eq(tcp_transport_new(&ta, ev, &ops, 256U << 10), 0);
        ck_assert_int_eq(tcp_transport_new(&tb, ev, &ops, 256U << 10), 0);
        src = malloc(REGION_SIZE);
        dst = calloc(1, REGION_SIZE);
        for (size_t i = 0; i < REGION_SIZE; i++)
                src[i] = (uint8_t)(i * 131 + (i >> 13));
        rs = (TransportRegion) { .id = 0, .domain = MEMORY_HOST, .host_base = src, .size = REGION_SIZE };
        rd = (TransportRegion) { .id = 1, .domain = MEMORY_HOST, .host_base = dst, .size = REGION_SIZE };
        ck_assert_int_eq(ta->ops->register_region(ta, &rs), 0);
        ck_assert_int_eq(tb->ops->register_region(tb, &rd), 0);
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(ta, &to_b, sv[0], 0), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, sv[1], 0), 0);
        rx_fd = sv[1];
        announced = 0;
        landed = completed = asked_again = 0;
        failures = 0;
        failure_expected = false;
        raw_writes = false;
}

static void teardown(void) {
        tcp_transport_peer_reset(ta, &to_b, -ECANCELED);
        tcp_transport_peer_reset(tb, &to_a, -ECANCELED);
        ta->ops->free(ta);
        tb->ops->free(tb);
        to_a.slot = to_b.slot = NULL;
        sd_event_unref(ev);
        free(src);
        free(dst);
}

/* Runs the loop until `n` writes completed at the sender (and landed at the receiver),
 * or false once nothing happened for idle_ms. */
static bool run_until(size_t n, int idle_ms) {
        TransportCompletion c[256];
        while (completed < n) {
                int r = sd_event_run(ev, (uint64_t)idle_ms * 1000);
                ck_assert_int_ge(r, 0);
                size_t k;
                while ((k = ta->ops->poll(ta, c, 256)) > 0)
                        for (size_t i = 0; i < k; i++) {
                                ck_assert_int_eq(c[i].error, 0);
                                completed++;
                        }
                if (r == 0 && completed < n)
                        return false; /* nothing happened for idle_ms */
        }
        return landed == n;
}

START_TEST(test_small_and_big) {
        /* 36 small writes, 3 big ones, 36 small again, in one post; small sizes that put
         * the read-ahead's end anywhere in a frame or its header, up to and just past the
         * largest slice read ahead (16 KiB). */
        static const uint64_t smalls[] = { 1, 1000, 1792, 4000, 16383, 16384, 16385 };
        enum { N = 36 + 3 + 36 };
        size_t total = 0;
        for (size_t k = 0; k < ELEMENTSOF(smalls); k++) {
                TransportWrite w[N];
                uint64_t off = 0, doff = 0;
                memset(dst, 0, REGION_SIZE);
                for (int i = 0; i < N; i++) {
                        uint64_t len = (i >= 36 && i < 39) ? (1U << 20) + 77 : smalls[k];
                        w[i] = (TransportWrite) { .src_region = 0, .src_offset = off, .dst_region = 1,
                                                  .dst_offset = doff, .length = len, .cookie = 100 + i };
                        off += len + 5;
                        doff += len + 11;
                }
                ck_assert_int_eq(ta->ops->post(ta, &to_b, w, N), 0);
                total += N;
                ck_assert_msg(run_until(total, 5000), "writes of %llu bytes: %zu of %zu landed",
                              (unsigned long long)smalls[k], landed, total);
                for (int i = 0; i < N; i++)
                        ck_assert_mem_eq(dst + w[i].dst_offset, src + w[i].src_offset, w[i].length);
        }
}
END_TEST

/* More writes unanswered than the peer takes begun at once (PEER_INCOMING_MAX): the post
 * past it is refused (ENOBUFS, nothing queued), not sent for the peer to reset the whole
 * session over; the ones taken land. */
START_TEST(test_post_bounded_by_peer_incoming) {
        enum { N = 65536 };
        static TransportWrite w[N];
        for (int i = 0; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 0, .src_offset = (uint64_t)i, .dst_region = 1,
                                          .dst_offset = (uint64_t)i, .length = 1, .cookie = 1 };
        ck_assert_int_eq(ta->ops->post(ta, &to_b, w, N), 0);
        ck_assert_int_eq(ta->ops->post(ta, &to_b, w, 1), -ENOBUFS);
        ck_assert_msg(run_until(N, 10000), "%zu of %d landed", landed, N);
        ck_assert_int_eq(ta->ops->post(ta, &to_b, w, 1), 0);
        ck_assert(run_until(N + 1, 5000));
}
END_TEST

START_TEST(test_parked_with_read_ahead) {
        /* A small write the receiver takes, then 29 into target 1, which it does not know
         * yet: reading the first one's payload reads all the others' frames ahead (30
         * frames fit in the 64 KiB read: none is left in the socket to wake the stream). */
        enum { SMALL = 1792, N = 30 };
        TransportWrite w[N];
        target_base[1] = 4096;
        w[0] = (TransportWrite) { .src_region = 0, .dst_region = 1, .length = SMALL, .cookie = 0 };
        for (int i = 1; i < N; i++)
                w[i] = (TransportWrite) { .src_region = 0, .src_offset = (uint64_t)i * SMALL,
                                          .dst_offset = (uint64_t)i * SMALL, .length = SMALL, .cookie = i,
                                          .flags = TRANSPORT_WRITE_TARGET, .target = 1 };
        ck_assert_int_eq(ta->ops->post(ta, &to_b, w, N), 0);
        /* Everything is sent; the receiver took the first write and waits: nothing more
         * lands. */
        ck_assert(!run_until(N, 200));
        ck_assert_uint_eq(landed, 1);
        ck_assert_uint_ge(asked_again, 1);
        /* Announced: every write lands, with no new byte on the socket. */
        announced = 1;
        tb->ops->resume_incoming(tb, &to_a);
        ck_assert_msg(run_until(N, 2000), "%zu of %d landed after the target was announced", landed, N);
        ck_assert_mem_eq(dst, src, SMALL);
        ck_assert_mem_eq(dst + 4096 + SMALL, src + SMALL, (size_t)(N - 1) * SMALL);
}
END_TEST

/* One DATA frame: slice `index` (of `slice` bytes) of write `id`, `total` bytes into
 * region 1 at 0, its payload from src. */
static size_t data_frame(uint8_t *buf, uint64_t id, uint64_t total, uint32_t slice, uint64_t index) {
        PeerDataHeader dh = { .write_id = id, .cookie = 7, .dst_offset = 0, .total_length = total,
                              .slice_offset = index * slice, .region = 1, .slice_size = slice };
        uint64_t len = peer_slice_length(total, slice, index);
        peer_frame_header_encode(buf, PEER_MSG_DATA, (uint32_t)(PEER_DATA_HEADER_SIZE + len));
        ck_assert_int_eq(peer_data_header_encode(&dh, buf + PEER_FRAME_HEADER_SIZE, PEER_DATA_HEADER_SIZE),
                         PEER_DATA_HEADER_SIZE);
        memcpy(buf + PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE, src + index * slice, len);
        return PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + len;
}

static void run_idle(int ms) {
        while (sd_event_run(ev, (uint64_t)ms * 1000) > 0)
                ;
}

/* A slice sent again on a second stream while the first is still landing it: refused
 * at its header (a protocol error: the session goes), never completing the write under
 * the first stream, which would then land its bytes into a write already reported done
 * and freed (a use-after-free a peer could cause). */
START_TEST(test_slice_twice_on_two_streams) {
        enum { SLICE = 64 * 1024, TOTAL = 2 * SLICE };
        static uint8_t f0[PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + SLICE],
                f1[PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + SLICE];
        int s0[2], s1[2];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, s0), 0);
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, s1), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, s0[1], 1), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, s1[1], 2), 0);
        failure_expected = true;

        /* Stream 1: slice 0's header and 1000 bytes of it. */
        size_t n0 = data_frame(f0, 900, TOTAL, SLICE, 0);
        size_t part = PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + 1000;
        ck_assert_int_eq(write(s0[0], f0, part), (ssize_t)part);
        run_idle(50);
        ck_assert_uint_eq(landed, 0);
        /* Stream 2: slice 0 whole (again), then slice 1. */
        ck_assert_int_eq(write(s1[0], f0, n0), (ssize_t)n0);
        size_t n1 = data_frame(f1, 900, TOTAL, SLICE, 1);
        ck_assert_int_eq(write(s1[0], f1, n1), (ssize_t)n1);
        run_idle(50);
        ck_assert_int_ge(failures, 1);
        ck_assert_uint_eq(landed, 0);
        /* The rest of stream 1's slice: nothing lands (the session is gone). */
        (void)!write(s0[0], f0 + part, n0 - part);
        run_idle(50);
        ck_assert_uint_eq(landed, 0);
        close(s0[0]);
        close(s1[0]);
}
END_TEST

static int queued_at_receiver(void) {
        int n = -1;
        ck_assert_int_eq(ioctl(rx_fd, FIONREAD, &n), 0);
        return n;
}

START_TEST(test_posts_leave_together) {
        enum { N = 8, LEN = 16384 };
        const int frame = PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + LEN;
        /* One post per call, as handoffs prepared by one bus call after another: nothing
         * is on the wire until the loop turns, then all of it at once (one sendmsg()). */
        for (int i = 0; i < N; i++) {
                TransportWrite w = { .src_region = 0, .src_offset = (uint64_t)i * LEN, .dst_region = 1,
                                     .dst_offset = (uint64_t)i * LEN, .length = LEN, .cookie = i };
                ck_assert_int_eq(ta->ops->post(ta, &to_b, &w, 1), 0);
        }
        ck_assert_int_eq(queued_at_receiver(), 0);
        control_flushes = control_flushed_after_data = 0;
        ck_assert_int_eq(sd_event_run(ev, 0), 1); /* the flush: the receiver's read is the next turn */
        ck_assert_int_eq(queued_at_receiver(), N * frame);
        ck_assert_uint_eq(control_flushes, 1); /* the PREPAREs the peer layer held go first */
        ck_assert_msg(run_until(N, 2000), "%zu of %d landed", landed, N);
        ck_assert_mem_eq(dst, src, (size_t)N * LEN);

        /* A loop that never idles: the posts go once they waited their bound. */
        TransportWrite w = { .src_region = 0, .dst_region = 1, .dst_offset = 1U << 20, .length = LEN, .cookie = 50 };
        ck_assert_int_eq(ta->ops->post(ta, &to_b, &w, 1), 0);
        tcp_transport_flush_overdue(ta);
        ck_assert_int_eq(queued_at_receiver(), 0);
        uint64_t t0 = now_usec(CLOCK_MONOTONIC);
        while (now_usec(CLOCK_MONOTONIC) < t0 + 1000)
                ;
        tcp_transport_flush_overdue(ta);
        ck_assert_int_eq(queued_at_receiver(), frame);
        ck_assert_uint_eq(control_flushes, 2);
        ck_assert_msg(run_until(N + 1, 2000), "the overdue write: %zu of %d landed", landed, N + 1);

        /* A full batch's bytes do not wait for the loop. */
        w = (TransportWrite){ .src_region = 0, .dst_region = 1, .dst_offset = 2U << 20, .length = 2U << 20,
                              .cookie = 60 };
        ck_assert_int_eq(ta->ops->post(ta, &to_b, &w, 1), 0);
        ck_assert_int_gt(queued_at_receiver(), 0);
        ck_assert_uint_eq(control_flushes, 3);
        ck_assert_uint_eq(control_flushed_after_data, 0);
        ck_assert_msg(run_until(N + 2, 5000), "the big write: %zu of %d landed", landed, N + 2);
        ck_assert_mem_eq(dst + (2U << 20), src, 2U << 20);
}
END_TEST

/* A stream whose socket was full (its EPOLLOUT armed) becomes writable while a post is
 * held for the idle point: its send goes before the idle point, and the peer's control
 * frames held with the post (its PREPARE) go before it. The receiver here is the test,
 * reading the socket itself. */
START_TEST(test_held_post_on_writable_stream) {
        enum { LEN = 16384, N = 64 };
        struct Peer to_c = { 0 };
        int sv[2];
        char buf[1 << 16];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0, sv), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(ta, &to_c, sv[0], 0), 0);
        int saved_rx = rx_fd;
        rx_fd = sv[1];
        /* 1 MiB in 64 writes: the socket takes part of it, the stream waits for room. */
        for (int i = 0; i < N; i++) {
                TransportWrite w = { .src_region = 0, .src_offset = (uint64_t)i * LEN, .dst_region = 1,
                                     .dst_offset = (uint64_t)i * LEN, .length = LEN, .cookie = i };
                ck_assert_int_eq(ta->ops->post(ta, &to_c, &w, 1), 0);
        }
        run_idle(20);
        int capacity = queued_at_receiver();
        ck_assert_int_gt(capacity, 0);
        const uint64_t total = (uint64_t)N * (PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + LEN);
        uint64_t drained = 0;
        /* Read a little at a time until what the stream has left to send (the socket
         * full again each time) would fit in the socket at once. */
        while (total - drained - (uint64_t)queued_at_receiver() > (uint64_t)capacity / 2) {
                ssize_t k = read(sv[1], buf, sizeof buf);
                ck_assert_int_gt(k, 0);
                drained += (uint64_t)k;
                run_idle(20);
        }
        ck_assert_uint_gt(total - drained, (uint64_t)queued_at_receiver()); /* some left to send */
        /* A post now: held, with a control frame of the peer's; then the socket is
         * emptied, and the stream's next send goes before the loop's idle point. */
        TransportWrite w = { .src_region = 0, .dst_region = 1, .dst_offset = 2U << 20, .length = LEN, .cookie = 99 };
        ck_assert_int_eq(ta->ops->post(ta, &to_c, &w, 1), 0);
        while (queued_at_receiver() > 0) {
                ssize_t k = read(sv[1], buf, sizeof buf);
                ck_assert_int_gt(k, 0);
                drained += (uint64_t)k;
        }
        control_flushes = control_flushed_after_data = 0;
        run_idle(20);
        ck_assert_uint_ge(control_flushes, 1);
        ck_assert_msg(control_flushed_after_data == 0,
                      "the held post's data left before the control frames held with it");
        ck_assert_uint_eq(drained + (uint64_t)queued_at_receiver(),
                          total + PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + LEN);
        tcp_transport_peer_reset(ta, &to_c, -ECANCELED);
        rx_fd = saved_rx;
        close(sv[1]);
}
END_TEST

/* A parked stream's deadline runs from its first park: resumes that leave its target
 * unknown (every pipelined PREPARE of the peer resumes it) do not push it back. The
 * stream fails at TCP_PARK_TIMEOUT_USEC after the park, resumed every 500 ms meanwhile;
 * it never failed before. */
START_TEST(test_park_deadline_survives_resumes) {
        TransportWrite w = { .src_region = 0, .dst_region = 1, .length = 1792, .cookie = 1,
                             .flags = TRANSPORT_WRITE_TARGET, .target = 5 };
        failure_expected = true;
        ck_assert_int_eq(ta->ops->post(ta, &to_b, &w, 1), 0);
        run_idle(100);
        ck_assert_uint_ge(asked_again, 1); /* parked */
        usec_t t0 = now_usec(CLOCK_MONOTONIC), bound = TCP_PARK_TIMEOUT_USEC + 1500 * USEC_PER_MSEC;
        while (failures == 0 && now_usec(CLOCK_MONOTONIC) - t0 < bound) {
                tb->ops->resume_incoming(tb, &to_a); /* target 5 still unknown: parked again */
                run_idle(500);
        }
        ck_assert_msg(failures >= 1, "a stream resumed every 500 ms stayed parked %.1f s",
                      (double)(now_usec(CLOCK_MONOTONIC) - t0) / USEC_PER_SEC);
        ck_assert_uint_eq(landed, 0);
}
END_TEST

/* A write whose sender stops in the middle (one slice of two, then nothing, the
 * stream and session otherwise alive) ends the session once no byte of it came for the
 * stall bound: before, its destination pages stayed held as long as the session lived.
 * One whose bytes keep coming, however long it takes in all, is left alone. */
START_TEST(test_stalled_write_ends_session) {
        enum { SLICE = 64 * 1024 };
        static uint8_t f[PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + SLICE];
        int sv[2];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, sv[1], 1), 0);
        tcp_transport_set_in_stall(tb, 400 * USEC_PER_MSEC);
        failure_expected = true;
        raw_writes = true;

        /* Slowly but surely: a slice of four every 150 ms, 600 ms in all. */
        for (uint64_t k = 0; k < 4; k++) {
                size_t n = data_frame(f, 910, 4 * SLICE, SLICE, k);
                ck_assert_int_eq(write(sv[0], f, n), (ssize_t)n);
                usec_t t0 = now_usec(CLOCK_MONOTONIC);
                while (now_usec(CLOCK_MONOTONIC) - t0 < 150 * USEC_PER_MSEC)
                        run_idle(20);
        }
        ck_assert_uint_eq(landed, 1);
        ck_assert_int_eq(failures, 0);

        /* Then one that stops after its first slice. */
        size_t n = data_frame(f, 911, 2 * SLICE, SLICE, 0);
        ck_assert_int_eq(write(sv[0], f, n), (ssize_t)n);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        while (failures == 0 && now_usec(CLOCK_MONOTONIC) - t0 < 3 * USEC_PER_SEC)
                run_idle(20);
        usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_msg(failures >= 1, "a write stalled %.1f s did not end the session", (double)took / USEC_PER_SEC);
        ck_assert_msg(took >= 400 * USEC_PER_MSEC, "ended after %.3f s, before the bound", (double)took / USEC_PER_SEC);
        close(sv[0]);
}
END_TEST

/* A write waiting its turn while another of the same peer moves is not stalled: the
 * sender's round robin gives each queued write a slice in turn, and with much queued a
 * write's next slice comes long after its last. Write 921 gets its first slice, then
 * nothing for 1.6 times the bound (1 s) while 920's slices keep coming; the session stays.
 * Once nothing moves at all, it ends after the bound (it ended while 920 was moving). */
START_TEST(test_waiting_write_not_stalled) {
        enum { SLICE = 64 * 1024 };
        static uint8_t f[PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + SLICE];
        int sv[2];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, sv[1], 1), 0);
        tcp_transport_set_in_stall(tb, USEC_PER_SEC);
        failure_expected = true;
        raw_writes = true;

        size_t n = data_frame(f, 921, 2 * SLICE, SLICE, 0);
        ck_assert_int_eq(write(sv[0], f, n), (ssize_t)n);
        for (uint64_t k = 0; k < 16; k++) {
                n = data_frame(f, 920, 16 * SLICE, SLICE, k);
                ck_assert_int_eq(write(sv[0], f, n), (ssize_t)n);
                usec_t t0 = now_usec(CLOCK_MONOTONIC);
                while (now_usec(CLOCK_MONOTONIC) - t0 < 100 * USEC_PER_MSEC)
                        run_idle(20);
        }
        ck_assert_uint_eq(landed, 1);
        ck_assert_msg(failures == 0, "the session ended while a write of it was moving");

        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        while (failures == 0 && now_usec(CLOCK_MONOTONIC) - t0 < 5 * USEC_PER_SEC)
                run_idle(20);
        ck_assert_msg(failures >= 1, "write 921, alone and stalled, did not end the session");
        close(sv[0]);
}
END_TEST

/* Tiny frames that each name a new, huge write (refused: a region nobody registered)
 * cannot make the receiver allocate without bound: past TCP_IN_MAPS_MAX of slice maps
 * (128 KiB each here, a bit per 4 KiB slice of 4 GiB), the next is a protocol error. */
START_TEST(test_slice_maps_bounded) {
        enum { SLICE = 4096, EACH = 131072 };
        const uint64_t total = (UINT64_C(1) << 32) - (SLICE - 1); /* last slice: 1 byte */
        const unsigned fit = (unsigned)(TCP_IN_MAPS_MAX / EACH);
        int sv[2];
        ck_assert_int_eq(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
        int big = 4 << 20;
        (void)setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &big, sizeof big);
        ck_assert_int_eq(tcp_transport_attach_stream(tb, &to_a, sv[1], 1), 0);
        failure_expected = true;

        uint8_t f[PEER_FRAME_HEADER_SIZE + PEER_DATA_HEADER_SIZE + 1] = {};
        for (unsigned i = 0; i <= fit; i++) {
                PeerDataHeader dh = { .write_id = 5000 + i, .cookie = 1, .total_length = total,
                                      .slice_offset = total - 1, .region = 7, .slice_size = SLICE };
                peer_frame_header_encode(f, PEER_MSG_DATA, PEER_DATA_HEADER_SIZE + 1);
                ck_assert_int_eq(peer_data_header_encode(&dh, f + PEER_FRAME_HEADER_SIZE, PEER_DATA_HEADER_SIZE),
                                 PEER_DATA_HEADER_SIZE);
                ck_assert_int_eq(write(sv[0], f, sizeof f), (ssize_t)sizeof f);
                if (i + 1 == fit) {
                        run_idle(50);
                        ck_assert_int_eq(failures, 0); /* every one so far fits */
                }
        }
        run_idle(50);
        ck_assert_int_ge(failures, 1);
        ck_assert_uint_eq(landed, 0);
        close(sv[0]);
}
END_TEST

int main(void) {
        Suite *s = suite_create("tcp-stream");
        TCase *tc = tcase_create("receive");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_post_bounded_by_peer_incoming);
        tcase_add_test(tc, test_small_and_big);
        tcase_add_test(tc, test_parked_with_read_ahead);
        tcase_add_test(tc, test_slice_twice_on_two_streams);
        tcase_add_test(tc, test_posts_leave_together);
        tcase_add_test(tc, test_held_post_on_writable_stream);
        tcase_add_test(tc, test_park_deadline_survives_resumes);
        tcase_add_test(tc, test_stalled_write_ends_session);
        tcase_add_test(tc, test_waiting_write_not_stalled);
        tcase_add_test(tc, test_slice_maps_bounded);
        tcase_set_timeout(tc, 60);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
