/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Sessions that end as soon as they are up, and supersedes (peer.c, peer-handshake.c).
 *
 * A dialer's reconnect backoff is reset only by a session that lasted
 * (PEER_SESSION_STABLE_USEC), not by AUTH_OK: before, a session that died at once came
 * back every 100 ms for ever. An acceptor that takes a newer control connection of a
 * host tells the old session why (BYE superseded), and a dialer told so waits the
 * longest backoff and says that another host uses its HostId: before, two hosts with one
 * HostId took turns ten times a second. The other side of each is played here by the
 * test (a thread or the test's own frames) with the cluster key; the daemon's side is
 * the real peer code on 127.0.0.1. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <systemd/sd-event.h>

#include "peer/peer-auth.h"
#include "peer/peer-internal.h"
#include "peer/peer-manager.h"
#include "../check-main.h"

#define KEY "0123456789abcdef0123456789abcdef"

static unsigned short port_of(int fd) {
        struct sockaddr_in sa;
        socklen_t sl = sizeof sa;
        ck_assert_int_eq(getsockname(fd, (struct sockaddr *)&sa, &sl), 0);
        return ntohs(sa.sin_port);
}

static int listen_loopback(void) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(bind(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(fd, 16), 0);
        return fd;
}

static int tcp_to(unsigned short port) {
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port),
                                  .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(connect(fd, (struct sockaddr *)&sa, sizeof sa), 0);
        struct timeval tv = { .tv_sec = 10 };
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        return fd;
}

/* A key file (mkstemp: mode 0600); loaded by peer_manager_new(), then removed. */
static void key_file(char path[static 64]) {
        /* In the run's directory, which check_run() removes even after a failed test. */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        snprintf(path, 64, "%s/peer-session-key-XXXXXX", run ? run : "/tmp");
        int fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, KEY, strlen(KEY)), (ssize_t)strlen(KEY));
        close(fd);
}

static char *free_listen_address(char buf[static 64]) {
        int probe = listen_loopback();
        snprintf(buf, 64, "127.0.0.1:%u", port_of(probe));
        close(probe);
        return buf;
}

/* Until nothing happened for 50 ms. */
static void run_loop(sd_event *e) {
        for (int i = 0, idle = 0; idle < 5 && i < 100000; i++) {
                int r = sd_event_run(e, 10 * 1000);
                ck_assert_int_ge(r, 0);
                idle = r == 0 ? idle + 1 : 0;
        }
}

/* Runs e until done(arg) or `seconds` have passed; done's last answer. */
static bool run_until(sd_event *e, bool (*done)(void *), void *arg, unsigned seconds) {
        usec_t end = now_usec(CLOCK_MONOTONIC) + seconds * USEC_PER_SEC;
        while (!done(arg) && now_usec(CLOCK_MONOTONIC) < end)
                ck_assert_int_ge(sd_event_run(e, 20 * 1000), 0);
        return done(arg);
}

/* ---- frames, as the other side writes and reads them (blocking sockets) ---- */

static int send_frame(int fd, uint16_t type, const void *payload, size_t len) {
        uint8_t buf[PEER_FRAME_HEADER_SIZE + 512];
        int n = peer_frame_build(buf, sizeof buf, type, payload, len);
        if (n < 0)
                return n;
        return send(fd, buf, (size_t)n, MSG_NOSIGNAL) == n ? 0 : -EIO;
}

/* The next frame's type and payload (at most 512 bytes); -EIO at EOF or error. */
static int recv_frame(int fd, uint16_t *type, uint8_t payload[static 512], size_t *len) {
        uint8_t hdr[PEER_FRAME_HEADER_SIZE];
        PeerFrameHeader fh;

        if (recv(fd, hdr, sizeof hdr, MSG_WAITALL) != (ssize_t)sizeof hdr)
                return -EIO;
        if (peer_frame_header_decode(hdr, sizeof hdr, &fh) < 0 || fh.length > 512)
                return -EBADMSG;
        if (fh.length > 0 && recv(fd, payload, fh.length, MSG_WAITALL) != (ssize_t)fh.length)
                return -EIO;
        *type = fh.type;
        *len = fh.length;
        return 0;
}

static int send_reason(int fd, uint16_t type, uint32_t reason) {
        PeerReason pr = { .reason = reason };
        uint8_t buf[4];
        (void)peer_reason_encode(&pr, buf, sizeof buf);
        return send_frame(fd, type, buf, sizeof buf);
}

/* ---- the other side as acceptor: a thread ---- */

typedef enum FakeMode {
        FAKE_CLOSE,      /* AUTH_OK, then close at once */
        FAKE_HOLD,       /* AUTH_OK, then close when told (release) */
        FAKE_SUPERSEDED, /* AUTH_OK, BYE superseded, close */
} FakeMode;

typedef struct Fake {
        int listen_fd;
        PeerAuthKey *key;
        _Atomic FakeMode mode;
        atomic_bool release, stop;
        atomic_uint sessions; /* AUTH_OK sent */
        atomic_uint errors;
} Fake;

/* One control connection's handshake as acceptor "zz-fake"; 0 once AUTH_OK is out. */
static int fake_handshake(Fake *f, int fd, uint64_t sid) {
        uint8_t buf[512];
        size_t len;
        uint16_t type;
        PeerHello h;
        PeerChallenge ch = {};
        PeerAuth a;

        if (recv_frame(fd, &type, buf, &len) < 0 || type != PEER_MSG_HELLO || peer_hello_decode(buf, len, &h) < 0 ||
            h.role != PEER_ROLE_CONTROL)
                return -EBADMSG;
        PeerAuthTranscript t = { .dialer_id = h.host_id, .acceptor_id = "zz-fake", .role = PEER_ROLE_CONTROL };
        memcpy(t.nonce_dialer, h.nonce, PEER_NONCE_SIZE);
        if (peer_auth_random(t.nonce_acceptor, PEER_NONCE_SIZE) < 0)
                return -EIO;
        memcpy(ch.nonce, t.nonce_acceptor, PEER_NONCE_SIZE);
        snprintf(ch.host_id, sizeof ch.host_id, "zz-fake");
        if (peer_auth_mac(f->key, PEER_AUTH_ACCEPTOR, &t, ch.mac) < 0)
                return -EIO;
        int n = peer_challenge_encode(&ch, buf, sizeof buf);
        if (n < 0 || send_frame(fd, PEER_MSG_CHALLENGE, buf, (size_t)n) < 0)
                return -EIO;
        if (recv_frame(fd, &type, buf, &len) < 0 || type != PEER_MSG_AUTH || peer_auth_msg_decode(buf, len, &a) < 0 ||
            !peer_auth_verify(f->key, PEER_AUTH_DIALER, &t, a.mac))
                return -EACCES;
        PeerAuthOk ok = { .session_id = sid, .heartbeat_ms = 2000, .n_streams = 0 };
        n = peer_auth_ok_encode(&ok, buf, sizeof buf);
        if (n < 0 || send_frame(fd, PEER_MSG_AUTH_OK, buf, (size_t)n) < 0)
                return -EIO;
        return 0;
}

static void *fake_run(void *arg) {
        Fake *f = arg;

        while (!atomic_load(&f->stop)) {
                struct pollfd pfd = { .fd = f->listen_fd, .events = POLLIN };
                if (poll(&pfd, 1, 20) <= 0)
                        continue;
                int fd = accept4(f->listen_fd, NULL, NULL, SOCK_CLOEXEC);
                if (fd < 0)
                        continue;
                struct timeval tv = { .tv_sec = 10 };
                (void)setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
                if (fake_handshake(f, fd, atomic_load(&f->sessions) + 1) < 0) {
                        atomic_fetch_add(&f->errors, 1);
                        close(fd);
                        continue;
                }
                FakeMode m = atomic_load(&f->mode);
                if (m == FAKE_SUPERSEDED)
                        (void)send_reason(fd, PEER_MSG_BYE, PEER_FAIL_SUPERSEDED);
                atomic_fetch_add(&f->sessions, 1);
                if (m == FAKE_HOLD)
                        while (!atomic_load(&f->release) && !atomic_load(&f->stop))
                                usleep(1000);
                close(fd);
        }
        return NULL;
}

/* A started dialer "aa-self" whose one peer is the fake "zz-fake". */
static PeerManager *dialer_of(Fake *f, sd_event **ret_event, pthread_t *thread) {
        char key[64], addr[64];
        PeerManager *pm;

        f->listen_fd = listen_loopback();
        ck_assert_int_eq(peer_auth_key_from_bytes(KEY, strlen(KEY), &f->key), 0);
        snprintf(addr, sizeof addr, "127.0.0.1:%u", port_of(f->listen_fd));
        key_file(key);
        ck_assert_int_ge(sd_event_new(ret_event), 0);
        PeerConfig peer = { .name = "fake", .host_id = "zz-fake", .address = addr };
        PeerManagerConfig c = { .host_id = "aa-self", .peers = &peer, .n_peers = 1, .cluster_key_file = key,
                                .heartbeat_usec = 2 * USEC_PER_SEC };
        ck_assert_int_eq(peer_manager_new(&pm, *ret_event, &c), 0);
        unlink(key);
        ck_assert_int_eq(pthread_create(thread, NULL, fake_run, f), 0);
        ck_assert_int_eq(peer_manager_start(pm), 0);
        return pm;
}

static void fake_stop(Fake *f, pthread_t thread) {
        atomic_store(&f->stop, true);
        pthread_join(thread, NULL);
        close(f->listen_fd);
        peer_auth_key_free(f->key);
}

typedef struct Want {
        Peer *p;
        uint64_t disconnects;
        PeerState state;
} Want;

static bool peer_reached(void *arg) {
        Want *w = arg;
        return peer_stats(w->p)->disconnects >= w->disconnects && peer_state(w->p) == w->state;
}

/* Sessions that end as soon as they are up double the backoff as failed attempts do;
 * one that lasted resets it. */
START_TEST(test_short_sessions_back_off) {
        Fake f = { .mode = FAKE_CLOSE };
        sd_event *e;
        pthread_t thread;
        PeerManager *pm = dialer_of(&f, &e, &thread);
        Peer *p = peer_manager_peer(pm, 0);

        /* Four sessions, each ended at once: 100, 200, 400 ms between them, and
         * 1.6 s from the fourth to the next (before: 100 ms every time). */
        Want w = { p, 4, PEER_DOWN };
        ck_assert_msg(run_until(e, peer_reached, &w, 10), "4 sessions: %" PRIu64 " disconnects",
                      peer_stats(p)->disconnects);
        ck_assert_uint_eq(peer_stats(p)->connects, 4);
        ck_assert_msg(p->backoff_usec == 16 * PEER_RECONNECT_MIN_USEC,
                      "backoff after 4 sessions that ended at once: %" PRIu64 " ms, want %" PRIu64 " ms",
                      (uint64_t)(p->backoff_usec / USEC_PER_MSEC),
                      (uint64_t)(16 * PEER_RECONNECT_MIN_USEC / USEC_PER_MSEC));
        ck_assert_uint_eq(atomic_load(&f.errors), 0);

        /* The fifth lasts (as if for longer than PEER_SESSION_STABLE_USEC): its end
         * resets the backoff, the next attempt comes after the shortest. */
        atomic_store(&f.mode, FAKE_HOLD);
        w = (Want){ p, 4, PEER_UP };
        ck_assert(run_until(e, peer_reached, &w, 10));
        p->stats.up_since_usec -= PEER_SESSION_STABLE_USEC + USEC_PER_SEC;
        atomic_store(&f.mode, FAKE_CLOSE);
        atomic_store(&f.release, true);
        w = (Want){ p, 5, PEER_DOWN };
        ck_assert(run_until(e, peer_reached, &w, 10));
        ck_assert_msg(p->backoff_usec == 2 * PEER_RECONNECT_MIN_USEC,
                      "backoff after a session that lasted: %" PRIu64 " ms", (uint64_t)(p->backoff_usec / USEC_PER_MSEC));

        peer_manager_free(pm);
        fake_stop(&f, thread);
        sd_event_unref(e);
}
END_TEST

/* Stderr into a file, from now until capture_end(), which returns what was written. */
static int capture_start(void) {
        fflush(stderr);
        int saved = dup(STDERR_FILENO);
        ck_assert_int_ge(saved, 0);
        int fd = open("/tmp", O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_ge(dup2(fd, STDERR_FILENO), 0);
        close(fd);
        return saved;
}

static char *capture_end(int saved) {
        fflush(stderr);
        off_t n = lseek(STDERR_FILENO, 0, SEEK_END);
        ck_assert_int_ge(n, 0);
        char *s = calloc(1, (size_t)n + 1);
        ck_assert_ptr_nonnull(s);
        ck_assert_int_eq(pread(STDERR_FILENO, s, (size_t)n, 0), n);
        ck_assert_int_ge(dup2(saved, STDERR_FILENO), 0);
        close(saved);
        fputs(s, stderr); /* still in the test's log */
        return s;
}

/* Told that its session was superseded, the dialer waits the longest backoff and says
 * that another host uses its HostId (before: "peer said goodbye", back in 100 ms). */
START_TEST(test_superseded_waits_longest) {
        Fake f = { .mode = FAKE_SUPERSEDED };
        sd_event *e;
        pthread_t thread;
        int saved = capture_start();
        PeerManager *pm = dialer_of(&f, &e, &thread);
        Peer *p = peer_manager_peer(pm, 0);

        Want w = { p, 1, PEER_DOWN };
        bool reached = run_until(e, peer_reached, &w, 10);
        usec_t now = now_usec(CLOCK_MONOTONIC), due = 0;
        (void)sd_event_source_get_time(p->reconnect_timer, &due);
        char *log = capture_end(saved);

        ck_assert(reached);
        ck_assert_msg(p->backoff_usec == PEER_RECONNECT_MAX_USEC, "backoff after a supersede: %" PRIu64 " ms",
                      (uint64_t)(p->backoff_usec / USEC_PER_MSEC));
        /* The longest, less its jitter (25 %) and some slack. */
        ck_assert_msg(due >= now + PEER_RECONNECT_MAX_USEC * 3 / 4 - 100 * USEC_PER_MSEC,
                      "next attempt in %" PRIi64 " ms", (int64_t)(due - now) / 1000);
        ck_assert_msg(strstr(log, "superseded") && strstr(log, "HostId 'aa-self'") && strstr(log, "HostId=aa-self"),
                      "the log does not name the HostId:\n%s", log);
        ck_assert_str_eq(peer_last_error(p), "superseded: another host uses our HostId: Connection reset by peer");
        free(log);

        peer_manager_free(pm);
        fake_stop(&f, thread);
        sd_event_unref(e);
}
END_TEST

/* The other side as dialer "aa-m": the test's own frames against the daemon's acceptor.
 * A handshake's first half: HELLO sent, CHALLENGE read (the acceptor waits for AUTH). */
typedef struct MemberHandshake {
        int fd;
        PeerHello h;
        PeerChallenge ch;
} MemberHandshake;

static void hello_as_member(sd_event *e, unsigned short port, MemberHandshake *m) {
        uint8_t buf[512];
        size_t len;
        uint16_t type;
        m->h = (PeerHello){ .role = PEER_ROLE_CONTROL, .min_version = PEER_PROTOCOL_VERSION,
                            .max_version = PEER_PROTOCOL_VERSION, .n_streams = 0 };
        m->fd = tcp_to(port);
        ck_assert_int_eq(peer_auth_random(m->h.nonce, PEER_NONCE_SIZE), 0);
        snprintf(m->h.host_id, sizeof m->h.host_id, "aa-m");
        int n = peer_hello_encode(&m->h, buf, sizeof buf);
        ck_assert_int_gt(n, 0);
        ck_assert_int_eq(send_frame(m->fd, PEER_MSG_HELLO, buf, (size_t)n), 0);
        run_loop(e);
        ck_assert_int_eq(recv_frame(m->fd, &type, buf, &len), 0);
        ck_assert_uint_eq(type, PEER_MSG_CHALLENGE);
        ck_assert_int_eq(peer_challenge_decode(buf, len, &m->ch), 0);
}

/* Its second half: AUTH sent, AUTH_OK read. Returns the control connection. */
static int auth_as_member(sd_event *e, MemberHandshake *m, const PeerAuthKey *key) {
        uint8_t buf[512];
        size_t len;
        uint16_t type;
        PeerAuth a;
        PeerAuthOk ok;
        PeerAuthTranscript t = { .dialer_id = "aa-m", .acceptor_id = m->ch.host_id, .role = PEER_ROLE_CONTROL };
        memcpy(t.nonce_dialer, m->h.nonce, PEER_NONCE_SIZE);
        memcpy(t.nonce_acceptor, m->ch.nonce, PEER_NONCE_SIZE);
        ck_assert(peer_auth_verify(key, PEER_AUTH_ACCEPTOR, &t, m->ch.mac));
        ck_assert_int_eq(peer_auth_mac(key, PEER_AUTH_DIALER, &t, a.mac), 0);
        int n = peer_auth_msg_encode(&a, buf, sizeof buf);
        ck_assert_int_gt(n, 0);
        ck_assert_int_eq(send_frame(m->fd, PEER_MSG_AUTH, buf, (size_t)n), 0);
        run_loop(e);
        ck_assert_msg(recv_frame(m->fd, &type, buf, &len) == 0, "the handshake was closed before AUTH_OK");
        ck_assert_uint_eq(type, PEER_MSG_AUTH_OK);
        ck_assert_int_eq(peer_auth_ok_decode(buf, len, &ok), 0);
        return m->fd;
}

/* Returns the control connection, authenticated (AUTH_OK read). */
static int dial_as_member(sd_event *e, unsigned short port, const PeerAuthKey *key) {
        MemberHandshake m;
        hello_as_member(e, port, &m);
        return auth_as_member(e, &m, key);
}

/* The daemon's side as acceptor "bb-self", member "aa-m" known (dialing it itself goes
 * nowhere: port 9), and the cluster key the test signs with. */
typedef struct Acceptor {
        sd_event *e;
        PeerManager *pm;
        PeerAuthKey *k;
        unsigned short port;
        Peer *p;
} Acceptor;

static void acceptor_start(Acceptor *a) {
        char key[64], listen_at[64];
        key_file(key);
        ck_assert_int_ge(sd_event_new(&a->e), 0);
        PeerManagerConfig c = { .host_id = "bb-self", .listen_address = free_listen_address(listen_at),
                                .cluster_key_file = key, .heartbeat_usec = 60 * USEC_PER_SEC };
        ck_assert_int_eq(peer_manager_new(&a->pm, a->e, &c), 0);
        unlink(key);
        ck_assert_int_eq(peer_manager_start(a->pm), 0);
        ck_assert_int_eq(peer_manager_add_member(a->pm, "aa-m", "127.0.0.1:9", NULL), 0);
        ck_assert_int_eq(peer_auth_key_from_bytes(KEY, strlen(KEY), &a->k), 0);
        a->port = port_of(a->pm->listen_fd);
        a->p = peer_manager_find(a->pm, "aa-m");
}

static void acceptor_stop(Acceptor *a) {
        peer_auth_key_free(a->k);
        peer_manager_free(a->pm);
        sd_event_unref(a->e);
}

/* An acceptor that takes a newer control connection of an up peer tells the old one why
 * (BYE superseded) before it closes it (before: closed, nothing said). */
START_TEST(test_acceptor_tells_superseded) {
        Acceptor acc;
        acceptor_start(&acc);
        sd_event *e = acc.e;
        Peer *p = acc.p;

        int old = dial_as_member(e, acc.port, acc.k);
        ck_assert(peer_is_up(p));
        uint64_t sid = peer_session_id(p);
        int new = dial_as_member(e, acc.port, acc.k);
        ck_assert(peer_is_up(p));
        ck_assert(peer_session_id(p) != sid);
        ck_assert_uint_eq(peer_stats(p)->connects, 2);

        uint8_t buf[512];
        size_t len;
        uint16_t type;
        PeerReason pr = {};
        /* Whatever the session carried first (an RDMA transport's CONNECT, say), then BYE. */
        do
                ck_assert_msg(recv_frame(old, &type, buf, &len) == 0, "the old session was closed without a word");
        while (type != PEER_MSG_BYE);
        ck_assert_int_eq(peer_reason_decode(buf, len, &pr), 0);
        ck_assert_uint_eq(pr.reason, PEER_FAIL_SUPERSEDED);
        ck_assert_int_eq(recv(old, buf, 1, 0), 0); /* then closed */

        close(old);
        close(new);
        acceptor_stop(&acc);
}
END_TEST

static bool peer_down_now(void *arg) {
        return !peer_is_up(arg);
}

/* A host that restarts dials again while its old session still stands: the old one's
 * end (its socket's EOF here; a heartbeat timeout as well) spares the new control
 * handshake waiting for AUTH, which then completes. It was closed with the data
 * streams' handshakes, and the host backed off before trying again. */
START_TEST(test_session_end_spares_new_handshake) {
        Acceptor acc;
        acceptor_start(&acc);
        sd_event *e = acc.e;
        Peer *p = acc.p;

        int old = dial_as_member(e, acc.port, acc.k);
        ck_assert(peer_is_up(p));
        MemberHandshake fresh;
        hello_as_member(e, acc.port, &fresh);
        close(old);
        ck_assert(run_until(e, peer_down_now, p, 5));
        int fd = auth_as_member(e, &fresh, acc.k);
        ck_assert(peer_is_up(p));
        ck_assert_uint_eq(peer_stats(p)->connects, 2);

        close(fd);
        acceptor_stop(&acc);
}
END_TEST

int main(void) {
        Suite *s = suite_create("peer-session");
        TCase *tc = tcase_create("peer-session");
        tcase_set_timeout(tc, 60);
        tcase_add_test(tc, test_short_sessions_back_off);
        tcase_add_test(tc, test_superseded_waits_longest);
        tcase_add_test(tc, test_acceptor_tells_superseded);
        tcase_add_test(tc, test_session_end_spares_new_handshake);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
