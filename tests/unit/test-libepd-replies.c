/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* libepd against a D-Bus peer server on a unix socket (as epdd's direct socket is) that
 * answers with canned replies a real epdd never sends (a short PrepareWrite, a feature
 * reply cut short after its handle, a registration without its arenas): nothing the
 * reply left out is used, and a handle or registration the daemon made is given back,
 * not held until the connection goes. And a refusal libepd words itself keeps its words.
 * The server can also go without answering (the connection lost) or not answer at all
 * (a hung daemon), and the test can make one strdup() of libepd's fail (out of memory
 * for an object the daemon made). */
#include <check.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <systemd/sd-bus.h>

#include "epd/epd.h"
#include "epd/epd-feature.h"
#include "epd/handoff.h"
#include "epd/ring.h"
#include "../check-main.h"

typedef struct Canned {
        char dir[64], path[80];
        int listen_fd;
        pthread_t thread;
        atomic_bool stop;
        atomic_int releases; /* Feature.Release calls seen */
        char released[64];
        char unregistered[64]; /* UnregisterWorker's worker */
        atomic_int ring_closes; /* CloseRing calls seen */
        atomic_int ring_mode;   /* what OpenRing answers (RingMode) */
        char die_on[32];        /* a call of this member closes the connection, unanswered */
        atomic_bool dying;
        atomic_bool short_replies; /* the object-making calls answer their path and then garbage */
        pthread_mutex_t log_lock;
        char log[4096];         /* "MEMBER PATH\n" of each call that gives something back */
} Canned;

/* strdup() of libepd (and of anything else in the process) fails for this string. */
static _Atomic(const char *) strdup_fails_for;

char *strdup(const char *s) {
        static char *(*real)(const char *);
        const char *f = atomic_load(&strdup_fails_for);
        if (f && strcmp(s, f) == 0) {
                errno = ENOMEM;
                return NULL;
        }
        if (!real)
                real = (char *(*)(const char *))dlsym(RTLD_NEXT, "strdup");
        return real(s);
}

static void log_call(Canned *s, sd_bus_message *m) {
        pthread_mutex_lock(&s->log_lock);
        size_t n = strlen(s->log);
        snprintf(s->log + n, sizeof s->log - n, "%s %s\n", sd_bus_message_get_member(m), sd_bus_message_get_path(m));
        pthread_mutex_unlock(&s->log_lock);
}

static bool logged(Canned *s, const char *line) {
        char l[200];
        snprintf(l, sizeof l, "%s\n", line);
        pthread_mutex_lock(&s->log_lock);
        bool r = strstr(s->log, l) != NULL;
        pthread_mutex_unlock(&s->log_lock);
        return r;
}

/* OpenRing's answers: a file shorter than the size said; a well-formed ring whose file
 * is not sealed against shrinking; one whose completion eventfd blocks; one whose
 * submission eventfd blocks; a ring as epdd makes it. */
typedef enum RingMode { RING_SHORT, RING_UNSEALED, RING_BLOCKING_COMPLETE, RING_BLOCKING_SUBMIT, RING_GOOD } RingMode;

/* A ring file of 64 + 64 entries with a valid header, sealed or not. */
static int ring_file(bool sealed, uint64_t *ret_size) {
        long ps = sysconf(_SC_PAGESIZE);
        uint64_t size = (epd_ring_size(64, 64) + (uint64_t)ps - 1) / (uint64_t)ps * (uint64_t)ps;
        int fd = memfd_create("canned-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (fd < 0 || ftruncate(fd, (off_t)size) < 0)
                return -errno;
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (p == MAP_FAILED)
                return -errno;
        struct epd_ring_header h = { .magic = EPD_RING_MAGIC, .version = EPD_RING_VERSION,
                                     .record_size = EPD_RING_RECORD_SIZE, .sq_entries = 64, .cq_entries = 64,
                                     .sq_offset = EPD_RING_OFF_RECORDS,
                                     .cq_offset = EPD_RING_OFF_RECORDS + 64ULL * EPD_RING_RECORD_SIZE,
                                     .size = size };
        memcpy(p, &h, sizeof h);
        munmap(p, size);
        if (sealed && fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0)
                return -errno;
        *ret_size = size;
        return fd;
}

static Canned canned;

static int on_call(sd_bus_message *m, void *userdata, sd_bus_error *e) {
        Canned *s = userdata;
        sd_bus_message *reply = NULL;
        sd_bus *bus = sd_bus_message_get_bus(m);
        int r = 0;

        if (!sd_bus_message_is_method_call(m, NULL, NULL))
                return 0;
        const char *member = sd_bus_message_get_member(m);
        bool shortened = atomic_load(&s->short_replies);
        if (s->die_on[0] && strcmp(member, s->die_on) == 0) {
                atomic_store(&s->dying, true); /* the loop closes the connection, this call unanswered */
                return 1;
        }
        if (strcmp(member, "Wait") == 0)
                return 1; /* a hung daemon: never answered */
        if (strcmp(member, "CreateSequence") == 0 || strcmp(member, "Clone") == 0 ||
            strcmp(member, "Attach") == 0 || strcmp(member, "CreateFromPrefix") == 0) {
                /* The path, then (short) a string where the rest was due. */
                static const uint32_t pages[] = { 1, 2 };
                const char *path = strcmp(member, "Clone") == 0 ? "/org/epd1/sequence/nomem" : "/org/epd1/sequence/s1";
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "o", path);
                if (r >= 0 && strcmp(member, "CreateFromPrefix") == 0)
                        r = sd_bus_message_append(reply, "u", 2u);
                if (r >= 0 && shortened)
                        r = sd_bus_message_append(reply, "s", "not the pages");
                else if (r >= 0 && (strcmp(member, "CreateSequence") == 0 || strcmp(member, "CreateFromPrefix") == 0))
                        r = sd_bus_message_append_array(reply, 'u', pages, sizeof pages);
        } else if (strcmp(member, "Prepare") == 0 && shortened) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "os", "/org/epd1/handoff/h1", "not the token");
        } else if (strcmp(member, "Prepare") == 0) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "ot", "/org/epd1/handoff/nomem", (uint64_t)7);
        } else if (strcmp(member, "Accept") == 0 || strcmp(member, "AcceptWait") == 0) {
                /* The handoff's path, then (short) a string where the token was due. */
                static const uint64_t offsets[] = { 4096, 8192 };
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0 && shortened)
                        r = sd_bus_message_append(reply, "os", "/org/epd1/handoff/a1", "not the token");
                else if (r >= 0)
                        r = sd_bus_message_append(reply, "ots", "/org/epd1/handoff/accepted", (uint64_t)7, "host0");
                if (r >= 0 && !shortened)
                        r = sd_bus_message_append_array(reply, 't', offsets, sizeof offsets);
                if (r >= 0 && !shortened)
                        r = sd_bus_message_append(reply, "uu", 2u, 0u);
        } else if (strcmp(member, "Commit") == 0 || strcmp(member, "CommitAndRelease") == 0) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "o", "/org/epd1/sequence/committed");
        } else if (strcmp(member, "Create") == 0) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "so", "0123456789abcdef0123456789abcdef",
                                                  "/org/epd1/sequence/nomem");
        } else if (strcmp(member, "Fork") == 0) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "uo", 5u, "/org/epd1/sequence/nomem");
        } else if (strcmp(member, "Advance") == 0) {
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "oua(uuub)", "/org/epd1/sequence/nomem", 1u, 1, 0u, 1u, 16u, 1);
        } else if (strcmp(member, "Drop") == 0) {
                uint32_t b = 0;
                const char *w = "";
                (void)sd_bus_message_read(m, "su", &w, &b);
                pthread_mutex_lock(&s->log_lock);
                size_t n = strlen(s->log);
                snprintf(s->log + n, sizeof s->log - n, "Drop %s %u\n", w, b);
                pthread_mutex_unlock(&s->log_lock);
                r = sd_bus_message_new_method_return(m, &reply);
        } else if (strcmp(member, "PrepareWrite") == 0) {
                /* Pages 0+3 asked for, one page id answered. */
                static const uint32_t one[] = { 7 };
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append_array(reply, 'u', one, sizeof one);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "u", 0u);
        } else if (strcmp(member, "Acquire") == 0) {
                /* The result and the handle's fields, then nothing: no descriptor, no
                 * request id. */
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "ssssstt", "hit", "h-1", "ready", "", "", (uint64_t)0,
                                                  (uint64_t)64);
        } else if (strcmp(member, "RegisterWorker") == 0) {
                /* The worker's path, then no arenas array. */
                r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "os", "/org/epd1/worker/w1", "not the arenas");
        } else if (strcmp(member, "UnregisterWorker") == 0) {
                const char *w;
                if (sd_bus_message_read(m, "o", &w) >= 0)
                        snprintf(s->unregistered, sizeof s->unregistered, "%s", w);
                r = sd_bus_message_new_method_return(m, &reply);
        } else if (strcmp(member, "OpenRing") == 0) {
                RingMode mode = (RingMode)atomic_load(&s->ring_mode);
                uint64_t size = 1 << 20;
                int mfd, sfd = eventfd(0, EFD_CLOEXEC | (mode == RING_BLOCKING_SUBMIT ? 0 : EFD_NONBLOCK)),
                         cfd = eventfd(0, EFD_CLOEXEC | (mode == RING_BLOCKING_COMPLETE ? 0 : EFD_NONBLOCK));
                if (mode == RING_SHORT) {
                        mfd = memfd_create("canned-ring", MFD_CLOEXEC);
                        if (mfd >= 0 && ftruncate(mfd, 4096) < 0)
                                mfd = -errno;
                } else
                        mfd = ring_file(mode != RING_UNSEALED, &size);
                if (mfd < 0 || sfd < 0 || cfd < 0)
                        r = -EIO;
                if (r >= 0)
                        r = sd_bus_message_new_method_return(m, &reply);
                if (r >= 0)
                        r = sd_bus_message_append(reply, "hhht", mfd, sfd, cfd, size);
                if (mfd >= 0)
                        close(mfd);
                if (sfd >= 0)
                        close(sfd);
                if (cfd >= 0)
                        close(cfd);
        } else if (strcmp(member, "CloseRing") == 0) {
                atomic_fetch_add(&s->ring_closes, 1);
                r = sd_bus_message_new_method_return(m, &reply);
        } else if (strcmp(member, "Release") == 0) {
                const char *h;
                log_call(s, m);
                if (sd_bus_message_read(m, "s", &h) >= 0)
                        snprintf(s->released, sizeof s->released, "%s", h);
                atomic_fetch_add(&s->releases, 1);
                r = sd_bus_message_new_method_return(m, &reply);
        } else
                r = sd_bus_message_new_method_errorf(m, &reply, "org.epd1.Error.NotSupported", "no %s here", member);
        if (r >= 0)
                r = sd_bus_send(bus, reply, NULL);
        sd_bus_message_unref(reply);
        return r < 0 ? r : 1;
}

static void *serve(void *userdata) {
        Canned *s = userdata;
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_CLOEXEC);
        if (fd < 0)
                return NULL;
        sd_bus *bus = NULL;
        sd_id128_t id;
        int r = sd_id128_randomize(&id);
        if (r >= 0)
                r = sd_bus_new(&bus);
        if (r >= 0)
                r = sd_bus_set_fd(bus, fd, fd);
        if (r >= 0)
                r = sd_bus_set_server(bus, true, id);
        if (r >= 0)
                r = sd_bus_set_anonymous(bus, false);
        if (r >= 0)
                r = sd_bus_negotiate_fds(bus, true);
        if (r >= 0)
                r = sd_bus_add_filter(bus, NULL, on_call, s);
        if (r >= 0)
                r = sd_bus_start(bus);
        while (r >= 0 && !atomic_load(&s->stop) && !atomic_load(&s->dying)) {
                r = sd_bus_process(bus, NULL);
                if (r == 0)
                        r = sd_bus_wait(bus, 50 * 1000);
        }
        if (bus)
                sd_bus_flush_close_unref(bus);
        else
                close(fd);
        return NULL;
}

static void setup(void) {
        memset(&canned, 0, sizeof canned);
        pthread_mutex_init(&canned.log_lock, NULL);
        atomic_store(&strdup_fails_for, NULL);
        /* Under the run's directory (check_run() removes it, even after a failed test
         * that never reached its teardown). */
        const char *run = getenv("EPD_TEST_RUN_DIR");
        ck_assert_ptr_nonnull(run);
        ck_assert_int_lt(snprintf(canned.dir, sizeof canned.dir, "%s/libepd-XXXXXX", run), (int)sizeof canned.dir);
        ck_assert_ptr_nonnull(mkdtemp(canned.dir));
        snprintf(canned.path, sizeof canned.path, "%s/bus", canned.dir);
        struct sockaddr_un sa = { .sun_family = AF_UNIX };
        snprintf(sa.sun_path, sizeof sa.sun_path, "%s", canned.path);
        canned.listen_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        ck_assert_int_ge(canned.listen_fd, 0);
        ck_assert_int_eq(bind(canned.listen_fd, (struct sockaddr *)&sa, sizeof sa), 0);
        ck_assert_int_eq(listen(canned.listen_fd, 4), 0);
        ck_assert_int_eq(pthread_create(&canned.thread, NULL, serve, &canned), 0);
}

static void teardown(void) {
        atomic_store(&canned.stop, true);
        shutdown(canned.listen_fd, SHUT_RDWR); /* a thread still in accept() */
        pthread_join(canned.thread, NULL);
        close(canned.listen_fd);
        unlink(canned.path);
        rmdir(canned.dir);
}

static epd_client *connect_canned(void) {
        char address[200];
        epd_client *c = NULL;
        snprintf(address, sizeof address, "direct:%s", canned.path);
        ck_assert_int_eq(epd_connect(address, &c), 0);
        return c;
}

START_TEST(test_short_prepare_write) {
        epd_client *c = connect_canned();
        uint32_t pages[3] = { 0xdead, 0xdead, 0xdead };
        ck_assert_int_eq(epd_sequence_prepare_write(c, "/org/epd1/sequence/x", 0, 3, pages), -EBADMSG);
        ck_assert_str_eq(epd_last_error_name(c), "errno.74");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "1 page ids for 3 pages"));
        /* Nothing of the short answer was taken for page ids. */
        ck_assert_uint_eq(pages[0], 0xdead);
        epd_disconnect(c);
}
END_TEST

START_TEST(test_cut_feature_reply_releases_handle) {
        epd_client *c = connect_canned();
        epd_feature *f = NULL;
        ck_assert_int_lt(epd_feature_acquire(c, "k", false, &f), 0);
        ck_assert_ptr_null(f);
        ck_assert_int_eq(atomic_load(&canned.releases), 1);
        ck_assert_str_eq(canned.released, "h-1");
        /* The error is the reply's, not the Release's. */
        ck_assert_ptr_nonnull(epd_last_error_name(c));
        ck_assert_str_ne(epd_last_error_name(c), "errno.0");
        epd_disconnect(c);
}
END_TEST

/* A registration whose reply cannot be read past the worker's path is undone: the
 * daemon is asked to unregister that worker, and the client stays unregistered. */
START_TEST(test_unreadable_registration_undone) {
        epd_client *c = connect_canned();
        ck_assert_int_lt(epd_register(c, "prefill", "m", "cpu", NULL, NULL), 0);
        ck_assert_str_eq(canned.unregistered, "/org/epd1/worker/w1");
        ck_assert_ptr_null(epd_worker_path(c));
        ck_assert_uint_eq(epd_arena_count(c), 0);
        epd_disconnect(c);
}
END_TEST

/* A ring the daemon made that the client cannot map (here its file is shorter than the
 * size said) is closed at the daemon too: one ring a client, so it could never open
 * another. The open's own error stays the one reported. */
START_TEST(test_unmappable_ring_closed) {
        atomic_store(&canned.ring_mode, RING_SHORT);
        epd_client *c = connect_canned();
        epd_ring_client *ring = NULL;
        ck_assert_int_eq(epd_ring_open(c, 64, 64, &ring), -EBADMSG);
        ck_assert_ptr_null(ring);
        ck_assert_int_eq(atomic_load(&canned.ring_closes), 1);
        ck_assert_str_eq(epd_last_error_name(c), "errno.74");
        epd_disconnect(c);
}
END_TEST

/* A ring's fds are checked, not trusted: a file that can be made shorter would fault the
 * client (SIGBUS), a blocking eventfd would block a wait of 0 or a submission. Each is
 * refused (EBADMSG) and the ring closed at the daemon; the ring epdd makes is taken. */
START_TEST(test_ring_fds_checked) {
        static const RingMode bad[] = { RING_UNSEALED, RING_BLOCKING_COMPLETE, RING_BLOCKING_SUBMIT };
        epd_client *c = connect_canned();
        epd_ring_client *ring = NULL;
        for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
                atomic_store(&canned.ring_mode, bad[i]);
                int closes = atomic_load(&canned.ring_closes);
                ck_assert_msg(epd_ring_open(c, 64, 64, &ring) == -EBADMSG, "ring mode %d taken", (int)bad[i]);
                ck_assert_ptr_null(ring);
                ck_assert_int_eq(atomic_load(&canned.ring_closes), closes + 1);
        }
        atomic_store(&canned.ring_mode, RING_GOOD);
        ck_assert_int_eq(epd_ring_open(c, 64, 64, &ring), 0);
        ck_assert_ptr_nonnull(ring);
        struct epd_ring_record out;
        ck_assert_int_eq(epd_ring_next(ring, &out, 0), -EAGAIN); /* a wait of 0 does not block */
        /* Nor once the daemon (sharing the eventfd's open file description) has made it
         * blocking after the check: the read blocked for ever (review). Check's timeout
         * fails the case if it blocks. */
        int fl = fcntl(ring->complete_fd, F_GETFL);
        ck_assert_int_ge(fl, 0);
        ck_assert_int_eq(fcntl(ring->complete_fd, F_SETFL, fl & ~O_NONBLOCK), 0);
        ck_assert_int_eq(epd_ring_next(ring, &out, 0), -EAGAIN);
        ck_assert_int_eq(epd_ring_next(ring, &out, 20000), -EAGAIN);
        ck_assert_int_eq(epd_ring_release(c, ring), 0);
        epd_disconnect(c);
}
END_TEST

/* A refusal libepd words itself keeps its name and words (a bad tensor is
 * InvalidArgument naming the tensor), not a bare errno text. */
START_TEST(test_local_refusal_keeps_its_words) {
        epd_client *c = connect_canned();
        epd_feature *f = NULL;
        epd_feature_tensor t = { .name = "x", .dtype = "no-such-dtype", .rank = 1, .shape = { 64 } };
        ck_assert_int_eq(epd_feature_reserve(c, "k", 64, &t, 1, NULL, &f), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "org.epd1.Error.InvalidArgument");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "Tensor 0"));
        epd_disconnect(c);
}
END_TEST

/* The connection lost under calls sent without waiting: epd_flush() says so as a refusal
 * of libepd's own (errno.N, not sd-bus's NoReply as a timeout), and says it again
 * later: a producer never believes that a Release it sent went through. */
START_TEST(test_flush_connection_lost) {
        snprintf(canned.die_on, sizeof canned.die_on, "Release");
        epd_client *c = connect_canned();
        ck_assert_int_eq(epd_sequence_release_nowait(c, "/org/epd1/sequence/x"), 0);
        ck_assert_int_eq(epd_flush(c, 5 * 1000000ULL), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_ptr_nonnull(strstr(epd_last_error_message(c), "Release"));
        /* Sticky: the connection stays gone. */
        ck_assert_int_eq(epd_flush(c, 5 * 1000000ULL), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_int_eq(epd_flush(c, 0), -ENOTCONN);
        /* A blocking call says the same. */
        char *v = NULL;
        ck_assert_int_eq(epd_get_version(c, &v), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_int_eq(epd_sequence_release(c, "/org/epd1/sequence/x"), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        /* As do the event-loop calls, each naming its own error, once sd-bus has taken
         * the connection's end in (a closing connection still has its fd to poll). */
        ck_assert_int_eq(epd_sequence_release(c, NULL), -EINVAL);
        while (epd_process(c) >= 0)
                ;
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_int_eq(epd_sequence_release(c, NULL), -EINVAL);
        ck_assert_int_lt(epd_get_fd(c), 0);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        ck_assert_int_eq(epd_sequence_release(c, NULL), -EINVAL);
        ck_assert_int_lt(epd_get_events(c), 0);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        epd_disconnect(c);
}
END_TEST

/* A blocking call in flight when the connection goes: the same errno and name. */
START_TEST(test_blocking_call_connection_lost) {
        snprintf(canned.die_on, sizeof canned.die_on, "Release");
        epd_client *c = connect_canned();
        ck_assert_int_eq(epd_sequence_release(c, "/org/epd1/sequence/x"), -ENOTCONN);
        ck_assert_str_eq(epd_last_error_name(c), "errno.107");
        epd_disconnect(c);
}
END_TEST

typedef struct Prepared {
        int calls, error;
        char name[64];
        int nowait[2];
} Prepared;

static void on_prepared_lost(epd_client *c, int error, const char *handoff, uint64_t token, void *userdata) {
        Prepared *p = userdata;
        p->calls++;
        p->error = error;
        snprintf(p->name, sizeof p->name, "%s", epd_last_error_name(c) ?: "");
}

/* prepare_async's callback hears of a lost connection as the blocking calls do. */
START_TEST(test_prepare_async_connection_lost) {
        snprintf(canned.die_on, sizeof canned.die_on, "Prepare");
        epd_client *c = connect_canned();
        Prepared p = { 0 };
        ck_assert_int_eq(epd_handoff_prepare_async(c, "0123456789abcdef0123456789abcdef", "", "/org/epd1/sequence/x",
                                                   NULL, 0, NULL, on_prepared_lost, &p), 0);
        (void)epd_flush(c, 5 * 1000000ULL);
        ck_assert_int_eq(p.calls, 1);
        ck_assert_int_eq(p.error, -ENOTCONN);
        ck_assert_str_eq(p.name, "errno.107");
        ck_assert_int_eq(epd_flush(c, 0), -ENOTCONN);
        epd_disconnect(c);
}
END_TEST

static void on_prepared_release_twice(epd_client *c, int error, const char *handoff, uint64_t token,
                                      void *userdata) {
        Prepared *p = userdata;
        p->calls++;
        p->error = error;
        p->nowait[0] = epd_sequence_release_nowait(c, "/org/epd1/sequence/a");
        p->nowait[1] = epd_sequence_release_nowait(c, "/org/epd1/sequence/b");
}

/* Calls sent without waiting from within a callback of libepd (sd_bus_process() cannot
 * run there): sent, not refused with EBUSY. */
START_TEST(test_nowait_from_callback) {
        epd_client *c = connect_canned();
        Prepared p = { 0 };
        ck_assert_int_eq(epd_handoff_prepare_async(c, "0123456789abcdef0123456789abcdef", "", "/org/epd1/sequence/x",
                                                   NULL, 0, NULL, on_prepared_release_twice, &p), 0);
        ck_assert_int_eq(epd_flush(c, 5 * 1000000ULL), 0);
        ck_assert_int_eq(p.calls, 1);
        ck_assert_int_eq(p.nowait[0], 0);
        ck_assert_int_eq(p.nowait[1], 0);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/a"));
        ck_assert(logged(&canned, "Release /org/epd1/sequence/b"));
        epd_disconnect(c);
}
END_TEST

/* A blocking call that a hung daemon never answers ends with the call's timeout, named
 * as libepd's own (errno.110), not sd-bus's org.freedesktop.DBus.Error.Timeout. */
START_TEST(test_local_timeout_named) {
        epd_client *c = connect_canned();
        epd_feature *f = calloc(1, sizeof *f);
        ck_assert_ptr_nonnull(f);
        snprintf(f->key, sizeof f->key, "k");
        snprintf(f->handle, sizeof f->handle, "h-1");
        snprintf(f->state, sizeof f->state, "reserved");
        ck_assert_int_eq(epd_feature_wait(c, f, 200 * 1000), -ETIMEDOUT);
        ck_assert_str_eq(epd_last_error_name(c), "errno.110");
        free(f);
        epd_disconnect(c);
}
END_TEST

/* Refusals made without a call name themselves, never leaving an earlier call's error. */
START_TEST(test_refusals_named) {
        epd_client *c = connect_canned();
        uint32_t pages[1];
        /* An earlier error of another name. */
        ck_assert_int_eq(epd_sequence_prepare_write(c, "/org/epd1/sequence/x", 0, 3, NULL), -EBADMSG);
        ck_assert_str_eq(epd_last_error_name(c), "errno.74");
        ck_assert_int_eq(epd_get_version(c, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "errno.22");
        (void)pages;
        ck_assert_int_eq(epd_sequence_prepare_write(c, "/org/epd1/sequence/x", 0, 3, NULL), -EBADMSG);
        ck_assert_int_eq(epd_get_timeout(c, NULL), -EINVAL);
        ck_assert_str_eq(epd_last_error_name(c), "errno.22");
        /* A failed feature: -EPIPE, named. */
        epd_feature *f = calloc(1, sizeof *f);
        ck_assert_ptr_nonnull(f);
        snprintf(f->handle, sizeof f->handle, "h-1");
        snprintf(f->state, sizeof f->state, "failed");
        ck_assert_int_eq(epd_sequence_prepare_write(c, "/org/epd1/sequence/x", 0, 3, NULL), -EBADMSG);
        ck_assert_int_eq(epd_feature_wait(c, f, 0), -EPIPE);
        ck_assert_str_eq(epd_last_error_name(c), "errno.32");
        ck_assert_int_eq(epd_sequence_prepare_write(c, "/org/epd1/sequence/x", 0, 3, NULL), -EBADMSG);
        ck_assert_int_eq(epd_feature_wait(c, f, 1000000), -EPIPE);
        ck_assert_str_eq(epd_last_error_name(c), "errno.32");
        free(f);
        epd_disconnect(c);
}
END_TEST

/* Objects the daemon made whose answer cannot be read past their path are given back
 * (Release), and nothing half made reaches the caller. */
START_TEST(test_unreadable_objects_released) {
        atomic_store(&canned.short_replies, true);
        epd_client *c = connect_canned();
        char *path = NULL;
        uint32_t *pages = NULL;
        size_t n = 0, blocks = 0;
        ck_assert_int_lt(epd_sequence_create(c, "host0", 2, &path, &pages, &n), 0);
        ck_assert_ptr_null(path);
        ck_assert_ptr_null(pages);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/s1"));
        memset(canned.log, 0, sizeof canned.log);
        uint64_t h[2] = { 1, 2 };
        ck_assert_int_lt(epd_sequence_create_from_prefix(c, "host0", h, 2, &path, &blocks, &pages, &n), 0);
        ck_assert_ptr_null(path);
        ck_assert_ptr_null(pages);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/s1"));
        ck_assert_int_lt(epd_handoff_prepare(c, "0123456789abcdef0123456789abcdef", "", "/org/epd1/sequence/x", NULL, 0,
                                             NULL, &path, NULL), 0);
        ck_assert_ptr_null(path);
        ck_assert(logged(&canned, "Release /org/epd1/handoff/h1"));
        /* An accepted handoff is this client's: given back (rolled back) as well. */
        epd_handoff_accepted acc;
        memset(canned.log, 0, sizeof canned.log);
        ck_assert_int_lt(epd_handoff_accept(c, "0123456789abcdef0123456789abcdef", &acc), 0);
        ck_assert_ptr_null(acc.path);
        ck_assert(logged(&canned, "Release /org/epd1/handoff/a1"));
        memset(canned.log, 0, sizeof canned.log);
        ck_assert_int_lt(epd_handoff_accept_wait(c, "0123456789abcdef0123456789abcdef", 1000, &acc), 0);
        ck_assert_ptr_null(acc.path);
        ck_assert(logged(&canned, "Release /org/epd1/handoff/a1"));
        epd_disconnect(c);
}
END_TEST

/* The same for a Prepare sent without waiting: a reply that cannot be read past the
 * handoff's path gives the handoff back before the callback hears of the error (the
 * callback has no path to release it by). */
START_TEST(test_unreadable_async_prepare_released) {
        atomic_store(&canned.short_replies, true);
        epd_client *c = connect_canned();
        Prepared p = { 0 };
        ck_assert_int_eq(epd_handoff_prepare_async(c, "0123456789abcdef0123456789abcdef", "", "/org/epd1/sequence/x",
                                                   NULL, 0, NULL, on_prepared_lost, &p), 0);
        ck_assert_int_eq(epd_flush(c, 5 * 1000000ULL), 0);
        ck_assert_int_eq(p.calls, 1);
        ck_assert_int_lt(p.error, 0);
        ck_assert_str_ne(p.name, "");
        ck_assert(logged(&canned, "Release /org/epd1/handoff/h1"));
        epd_disconnect(c);
}
END_TEST

/* Out of memory for the path of an object the daemon made: the object is given back,
 * and no array of the answer is left to the caller (nor leaked). */
START_TEST(test_nomem_objects_released) {
        epd_client *c = connect_canned();
        char *path = NULL, *wf = NULL;
        uint32_t *pages = NULL, branch = 0, prefix = 0;
        size_t n = 0, blocks = 0;
        uint64_t h[2] = { 1, 2 };
        uint32_t tokens[2] = { 1, 2 };
        epd_segment *segs = NULL;

        atomic_store(&strdup_fails_for, "/org/epd1/sequence/s1");
        ck_assert_int_eq(epd_sequence_create(c, "host0", 2, &path, &pages, &n), -ENOMEM);
        ck_assert_ptr_null(pages);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/s1"));
        memset(canned.log, 0, sizeof canned.log);
        ck_assert_int_eq(epd_sequence_create_from_prefix(c, "host0", h, 2, &path, &blocks, &pages, &n), -ENOMEM);
        ck_assert_ptr_null(pages);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/s1"));
        memset(canned.log, 0, sizeof canned.log);
        ck_assert_int_eq(epd_sequence_attach(c, "s1", &path), -ENOMEM);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/s1"));

        atomic_store(&strdup_fails_for, "/org/epd1/sequence/nomem");
        ck_assert_int_eq(epd_sequence_clone(c, "/org/epd1/sequence/x", &path), -ENOMEM);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/nomem"));
        ck_assert_int_eq(epd_workflow_fork(c, "0123456789abcdef0123456789abcdef", 0, &branch, &path), -ENOMEM);
        ck_assert(logged(&canned, "Drop 0123456789abcdef0123456789abcdef 5"));
        ck_assert_int_eq(epd_workflow_create(c, "/org/epd1/sequence/x", tokens, 2, &wf, &path), -ENOMEM);
        ck_assert_ptr_null(wf);
        ck_assert_str_eq(canned.released, "0123456789abcdef0123456789abcdef");
        ck_assert_int_eq(epd_workflow_advance(c, "0123456789abcdef0123456789abcdef", 0, tokens, 2, true, &path,
                                              &prefix, &segs, &n), -ENOMEM);
        ck_assert_ptr_null(segs);

        atomic_store(&strdup_fails_for, "/org/epd1/handoff/nomem");
        ck_assert_int_eq(epd_handoff_prepare(c, "0123456789abcdef0123456789abcdef", "", "/org/epd1/sequence/x", NULL,
                                             0, NULL, &path, NULL), -ENOMEM);
        ck_assert(logged(&canned, "Release /org/epd1/handoff/nomem"));

        epd_handoff_accepted acc;
        atomic_store(&strdup_fails_for, "/org/epd1/handoff/accepted");
        ck_assert_int_eq(epd_handoff_accept(c, "0123456789abcdef0123456789abcdef", &acc), -ENOMEM);
        ck_assert_ptr_null(acc.path);
        ck_assert_ptr_null(acc.offsets);
        ck_assert(logged(&canned, "Release /org/epd1/handoff/accepted"));
        memset(canned.log, 0, sizeof canned.log);
        /* The decode sequence a commit made. */
        atomic_store(&strdup_fails_for, "/org/epd1/sequence/committed");
        ck_assert_int_eq(epd_handoff_commit(c, "/org/epd1/handoff/accepted", &path), -ENOMEM);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/committed"));
        memset(canned.log, 0, sizeof canned.log);
        ck_assert_int_eq(epd_handoff_commit_and_release(c, "/org/epd1/handoff/accepted", &path), -ENOMEM);
        ck_assert(logged(&canned, "Release /org/epd1/sequence/committed"));
        atomic_store(&strdup_fails_for, NULL);
        epd_disconnect(c);
}
END_TEST

int main(void) {
        Suite *s = suite_create("libepd-replies");
        TCase *tc = tcase_create("replies");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_short_prepare_write);
        tcase_add_test(tc, test_cut_feature_reply_releases_handle);
        tcase_add_test(tc, test_unreadable_registration_undone);
        tcase_add_test(tc, test_local_refusal_keeps_its_words);
        tcase_add_test(tc, test_unmappable_ring_closed);
        tcase_add_test(tc, test_ring_fds_checked);
        tcase_add_test(tc, test_flush_connection_lost);
        tcase_add_test(tc, test_blocking_call_connection_lost);
        tcase_add_test(tc, test_prepare_async_connection_lost);
        tcase_add_test(tc, test_nowait_from_callback);
        tcase_add_test(tc, test_local_timeout_named);
        tcase_add_test(tc, test_refusals_named);
        tcase_add_test(tc, test_unreadable_objects_released);
        tcase_add_test(tc, test_unreadable_async_prepare_released);
        tcase_add_test(tc, test_nomem_objects_released);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
