/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The bound on unauthenticated connections (PEER_PENDING_MAX) is on the ones others
 * open to us: connections this host dials itself (data streams waiting for their
 * peer's CHALLENGE, as at the start of a session with many peers, or against a peer
 * that does not answer) do not take its places, so that another host's control
 * connection is still accepted; past the bound (or PEER_PENDING_PER_ADDRESS from one
 * address), the oldest incoming one is closed for the newest. Real sockets on
 * 127.0.0.0/8, the daemon's own peer code. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>
#include <systemd/sd-event.h>

#include "peer/peer-internal.h"
#include "peer/peer-manager.h"
#include "../check-main.h"

static unsigned short port_of(int fd) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
        return ntohs(sa.sin_port);
}

/* A connection from 127.0.<from >> 8>.<from & 255> (0: 127.0.0.1; all of 127/8 is
 * loopback), so that tests can tell many hosts from one. */
static int tcp_from(unsigned short port, unsigned from) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        if (from) {
                struct sockaddr_in me = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000000u | from) };
                ck_assert_int_eq(bind(fd, (struct sockaddr *)&me, sizeof me), 0);
        }
        ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        return fd;
}

static int tcp_to(unsigned short port) {
        return tcp_from(port, 0);
}

/* Until nothing happened for 50 ms (sd_event_run() dispatches one source a call). */
static void run_loop(sd_event *e) {
        for (int i = 0, idle = 0; idle < 5 && i < 100000; i++) {
                int r = sd_event_run(e, 10 * 1000);
                ck_assert_int_ge(r, 0);
                idle = r == 0 ? idle + 1 : 0;
        }
}

/* 1: the daemon closed it (EOF); 0: still open, waiting for our HELLO. */
static int closed(int fd) {
        char b;
        ssize_t n = recv(fd, &b, 1, MSG_DONTWAIT);
        if (n == 0)
                return 1;
        ck_assert_int_lt(n, 0);
        ck_assert_int_eq(errno, EAGAIN);
        return 0;
}

/* closed(), for a connection that said HELLO: its CHALLENGE read first. */
static int closed_after_challenge(int fd) {
        uint8_t b[1024];
        for (;;) {
                ssize_t n = recv(fd, b, sizeof b, MSG_DONTWAIT);
                if (n == 0 || (n < 0 && errno == ECONNRESET))
                        return 1;
                if (n < 0) {
                        ck_assert_int_eq(errno, EAGAIN);
                        return 0;
                }
        }
}

/* A cluster key file (mkstemp: mode 0600) and a free loopback port for Listen= (which
 * takes no port 0). */
static void key_and_port(char key[static 64], char listen_at[static 64]) {
        snprintf(key, 64, "/tmp/epd-test-peer-pending-XXXXXX");
        int kfd = mkstemp(key);
        ck_assert_int_ge(kfd, 0);
        ck_assert_int_eq(write(kfd, "0123456789abcdef0123456789abcdef", 32), 32);
        close(kfd);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int probe = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_eq(bind(probe, (struct sockaddr *)&sa, sizeof sa), 0);
        snprintf(listen_at, 64, "127.0.0.1:%u", port_of(probe));
        close(probe);
}

START_TEST(test_own_dials_do_not_take_the_places_of_others) {
        char key[64], listen_at[64], addr[64];
        key_and_port(key, listen_at);

        /* A peer that accepts connections (the kernel's backlog) and never answers. */
        int silent = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        ck_assert_int_eq(bind(silent, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(silent, 512), 0);
        snprintf(addr, sizeof addr, "127.0.0.1:%u", port_of(silent));

        sd_event *e;
        PeerManager *pm;
        ck_assert_int_ge(sd_event_new(&e), 0);
        PeerConfig peer = { .name = "silent", .host_id = "zz-silent", .address = addr };
        PeerManagerConfig c = { .host_id = "aa-self", .listen_address = listen_at, .peers = &peer,
                                .n_peers = 1, .cluster_key_file = key, .heartbeat_usec = 60 * USEC_PER_SEC };
        ck_assert_int_eq(peer_manager_new(&pm, e, &c), 0);
        unlink(key); /* loaded: nothing left behind, whatever fails below */
        ck_assert_int_eq(peer_manager_start(pm), 0);
        unsigned short port = port_of(pm->listen_fd);

        /* More data streams of our own than the bound, all waiting for the silent
         * peer's CHALLENGE. */
        Peer *p = peer_manager_peer(pm, 0);
        for (unsigned i = 0; i < PEER_PENDING_MAX + 8; i++)
                ck_assert_int_eq(peer_dial(p, PEER_ROLE_DATA, i % PEER_MAX_STREAMS), 0);
        run_loop(e);

        /* Others' connections, each from its own address: the first PEER_PENDING_MAX
         * are taken (and wait for a HELLO); past them, the oldest is closed for the
         * newest, one by one. */
        int in[PEER_PENDING_MAX + 2];
        for (unsigned i = 0; i < PEER_PENDING_MAX; i++) {
                in[i] = tcp_from(port, 0x100 + i);
                run_loop(e);
        }
        for (unsigned i = 0; i < PEER_PENDING_MAX; i++)
                ck_assert_msg(!closed(in[i]), "incoming connection %u refused", i);
        ck_assert_uint_eq(pm->n_pending, PEER_PENDING_MAX);
        in[PEER_PENDING_MAX] = tcp_from(port, 0x100 + PEER_PENDING_MAX);
        run_loop(e);
        in[PEER_PENDING_MAX + 1] = tcp_from(port, 0x100 + PEER_PENDING_MAX + 1);
        run_loop(e);
        ck_assert(closed(in[0]));
        ck_assert(closed(in[1]));
        for (unsigned i = 2; i < PEER_PENDING_MAX + 2; i++)
                ck_assert_msg(!closed(in[i]), "incoming connection %u closed", i);
        ck_assert_uint_eq(pm->n_pending, PEER_PENDING_MAX);

        /* One goes: a place is free again, and nobody is closed for the next. */
        close(in[2]);
        run_loop(e);
        close(in[0]);
        in[0] = tcp_from(port, 0x100);
        run_loop(e);
        ck_assert(!closed(in[0]));
        ck_assert(!closed(in[3]));
        close(in[1]);
        close(in[2]);
        for (unsigned i = 0; i < PEER_PENDING_MAX + 2; i++)
                if (i != 1 && i != 2)
                        close(in[i]);
        run_loop(e);
        ck_assert_uint_eq(pm->n_pending, 0);

        /* From one address, at most PEER_PENDING_PER_ADDRESS: a flood from there
         * pushes out its own oldest, although there is room in all; another
         * address's connection is taken beside them. */
        int one[PEER_PENDING_PER_ADDRESS + 4];
        for (unsigned i = 0; i < PEER_PENDING_PER_ADDRESS + 4; i++) {
                one[i] = tcp_from(port, 0x200);
                run_loop(e);
        }
        for (unsigned i = 0; i < PEER_PENDING_PER_ADDRESS + 4; i++)
                ck_assert_msg(closed(one[i]) == (i < 4), "connection %u from one address", i);
        int other = tcp_from(port, 0x300);
        run_loop(e);
        ck_assert(!closed(other));
        ck_assert_uint_eq(pm->n_pending, PEER_PENDING_PER_ADDRESS + 1);
        for (unsigned i = 4; i < PEER_PENDING_PER_ADDRESS + 4; i++)
                ck_assert(!closed(one[i]));
        for (unsigned i = 0; i < PEER_PENDING_PER_ADDRESS + 4; i++)
                close(one[i]);
        close(other);
        peer_manager_free(pm);
        sd_event_unref(e);
        close(silent);
}
END_TEST

/* A started peer manager "bb-self" with no peers, listening on loopback. */
static PeerManager *listening_manager(sd_event **ret_event) {
        char key[64], listen_at[64];
        PeerManager *pm;
        key_and_port(key, listen_at);
        ck_assert_int_ge(sd_event_new(ret_event), 0);
        PeerManagerConfig c = { .host_id = "bb-self", .listen_address = listen_at, .cluster_key_file = key,
                                .heartbeat_usec = 60 * USEC_PER_SEC };
        ck_assert_int_eq(peer_manager_new(&pm, *ret_event, &c), 0);
        unlink(key); /* loaded: nothing left behind, whatever fails below */
        ck_assert_int_eq(peer_manager_start(pm), 0);
        return pm;
}

/* A control connection's HELLO naming host_id, framed, in frame; its length. */
static size_t hello_frame(const char *host_id, uint8_t frame[static PEER_FRAME_HEADER_SIZE + 512]) {
        PeerHello h = { .role = PEER_ROLE_CONTROL, .min_version = PEER_PROTOCOL_VERSION,
                        .max_version = PEER_PROTOCOL_VERSION, .n_streams = 2 };
        snprintf(h.host_id, sizeof h.host_id, "%s", host_id);
        int n = peer_hello_encode(&h, frame + PEER_FRAME_HEADER_SIZE, 512);
        ck_assert_int_gt(n, 0);
        peer_frame_header_encode(frame, PEER_MSG_HELLO, (uint32_t)n);
        return PEER_FRAME_HEADER_SIZE + (size_t)n;
}

/* A member that leaves the cluster while its control connection to us is between HELLO
 * and AUTH: that handshake ends with it (it was left waiting, and an AUTH arriving later
 * brought the departed member up again). */
START_TEST(test_retired_member_handshake_ends) {
        sd_event *e;
        PeerManager *pm = listening_manager(&e);
        /* "aa-m" sorts first: it dials us. */
        ck_assert_int_eq(peer_manager_add_member(pm, "aa-m", "127.0.0.1:9", NULL), 0);

        int fd = tcp_to(port_of(pm->listen_fd));
        uint8_t frame[PEER_FRAME_HEADER_SIZE + 512];
        size_t len = hello_frame("aa-m", frame);
        ck_assert_int_eq(write(fd, frame, len), (ssize_t)len);
        run_loop(e);
        uint8_t got[1024];
        ck_assert_int_gt(recv(fd, got, sizeof got, MSG_DONTWAIT), 0); /* its CHALLENGE */
        ck_assert(!closed(fd));

        ck_assert_int_eq(peer_manager_retire_member(pm, "aa-m"), 0);
        run_loop(e);
        ck_assert(closed(fd));

        close(fd);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

/* Connections from one address that said HELLO (naming a known host: it costs nothing)
 * and wait for AUTH count against that address's bound too: before, only silent ones
 * did, so one address kept any number of them, and a real peer's fresh connection was
 * the one closed for the next (review). */
START_TEST(test_hello_counts_per_address) {
        sd_event *e;
        PeerManager *pm = listening_manager(&e);
        ck_assert_int_eq(peer_manager_add_member(pm, "aa-m", "127.0.0.1:9", NULL), 0);
        unsigned short port = port_of(pm->listen_fd);

        uint8_t frame[PEER_FRAME_HEADER_SIZE + 512];
        size_t len = hello_frame("aa-m", frame);
        int fds[PEER_PENDING_PER_ADDRESS + 4];
        for (unsigned i = 0; i < ELEMENTSOF(fds); i++) {
                fds[i] = tcp_from(port, 0x400);
                ck_assert_int_eq(write(fds[i], frame, len), (ssize_t)len);
                run_loop(e);
        }
        unsigned open = 0;
        for (unsigned i = 0; i < ELEMENTSOF(fds); i++)
                open += !closed_after_challenge(fds[i]);
        ck_assert_uint_le(open, PEER_PENDING_PER_ADDRESS);
        ck_assert(closed_after_challenge(fds[0]));
        ck_assert(!closed_after_challenge(fds[ELEMENTSOF(fds) - 1]));
        /* Another address is taken beside them. */
        int other = tcp_from(port, 0x500);
        run_loop(e);
        ck_assert(!closed(other));
        for (unsigned i = 0; i < ELEMENTSOF(fds); i++)
                close(fds[i]);
        close(other);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

/* A connection whose first frame is of another protocol version is told so (AUTH_FAIL
 * version, in a frame of ours) before it is closed, not just closed: the other side
 * can say why it cannot connect rather than retry blindly. */
START_TEST(test_other_version_told) {
        sd_event *e;
        PeerManager *pm = listening_manager(&e);

        int fd = tcp_to(port_of(pm->listen_fd));
        PeerHello h = { .role = PEER_ROLE_CONTROL, .min_version = 1, .max_version = 1, .n_streams = 2 };
        snprintf(h.host_id, sizeof h.host_id, "aa-old");
        uint8_t frame[PEER_FRAME_HEADER_SIZE + 512];
        int n = peer_hello_encode(&h, frame + PEER_FRAME_HEADER_SIZE, sizeof frame - PEER_FRAME_HEADER_SIZE);
        ck_assert_int_gt(n, 0);
        peer_frame_header_encode(frame, PEER_MSG_HELLO, (uint32_t)n);
        frame[4] = 1; /* a version 1 peer's header (its payload not sent: the daemon
                       * closes with nothing of ours unread, no reset) */
        ck_assert_int_eq(write(fd, frame, PEER_FRAME_HEADER_SIZE), PEER_FRAME_HEADER_SIZE);
        run_loop(e);

        uint8_t got[64];
        ssize_t k = recv(fd, got, sizeof got, MSG_DONTWAIT);
        ck_assert_int_eq(k, PEER_FRAME_HEADER_SIZE + 4);
        PeerFrameHeader fh;
        ck_assert_int_eq(peer_frame_header_decode(got, (size_t)k, &fh), 0);
        ck_assert_uint_eq(fh.type, PEER_MSG_AUTH_FAIL);
        PeerReason pr = {};
        ck_assert_int_eq(peer_reason_decode(got + PEER_FRAME_HEADER_SIZE, 4, &pr), 0);
        ck_assert_uint_eq(pr.reason, PEER_FAIL_VERSION);
        ck_assert(closed(fd));

        close(fd);
        peer_manager_free(pm);
        sd_event_unref(e);
}
END_TEST

int main(void) {
        Suite *s = suite_create("peer-pending");
        TCase *tc = tcase_create("peer-pending");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_own_dials_do_not_take_the_places_of_others);
        tcase_add_test(tc, test_retired_member_handshake_ends);
        tcase_add_test(tc, test_other_version_told);
        tcase_add_test(tc, test_hello_counts_per_address);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
