/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdtop's reader of the pinned maps (tools/epdtop-pins.c) against a stand-in for the
 * kernel's hash maps: this file defines the three libbpf calls it makes, and the test is
 * linked without libbpf. */
#include <bpf/bpf.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "bpf/epd-telemetry.h"
#include "epdtop-pins.h"
#include "macro.h"
#include "../check-main.h"

/* The "tracked" and "conns" maps: one entry per connection, in the order the kernel's
 * iteration gives them. */
static struct {
        uint64_t cookie;
        bool deleted;
        const char *peer;
        uint64_t bytes_acked;
} entries[8];
static size_t n_entries;
static int fd_tracked = -EBADF, fd_conns = -EBADF;
static uint64_t delete_when_next_of; /* deleted just before the key after it is asked */

int bpf_obj_get(const char *path) {
        const char *slash = strrchr(path, '/');
        const char *name = slash ? slash + 1 : path;
        int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        if (strcmp(name, "tracked") == 0)
                return fd_tracked = fd;
        if (strcmp(name, "conns") == 0)
                return fd_conns = fd;
        close(fd);
        errno = ENOENT;
        return -ENOENT;
}

static ssize_t find(uint64_t cookie) {
        for (size_t i = 0; i < n_entries; i++)
                if (!entries[i].deleted && entries[i].cookie == cookie)
                        return (ssize_t)i;
        return -1;
}

/* As the kernel's hash map: the key after `key`, or the first key when `key` is NULL
 * or no longer in the map. */
int bpf_map_get_next_key(int fd, const void *key, void *next_key) {
        ck_assert_int_eq(fd, fd_tracked);
        size_t from = 0;
        if (key) {
                uint64_t k;
                memcpy(&k, key, sizeof k);
                if (k == delete_when_next_of) /* untracked by the daemon meanwhile */
                        for (size_t i = 0; i < n_entries; i++)
                                if (entries[i].cookie == k)
                                        entries[i].deleted = true;
                ssize_t i = find(k);
                from = i < 0 ? 0 : (size_t)i + 1;
        }
        for (size_t i = from; i < n_entries; i++)
                if (!entries[i].deleted) {
                        memcpy(next_key, &entries[i].cookie, sizeof entries[i].cookie);
                        return 0;
                }
        errno = ENOENT;
        return -ENOENT;
}

int bpf_map_lookup_elem(int fd, const void *key, void *value) {
        uint64_t k;
        memcpy(&k, key, sizeof k);
        ssize_t i = find(k);
        if (i < 0) {
                errno = ENOENT;
                return -ENOENT;
        }
        if (fd == fd_tracked) {
                struct epd_conn_info info = { .peer_id = 1 };
                snprintf(info.peer, sizeof info.peer, "%s", entries[i].peer);
                memcpy(value, &info, sizeof info);
        } else {
                ck_assert_int_eq(fd, fd_conns);
                struct epd_conn_stats st = {
                        .cookie = k, .srtt_us = 100, .min_rtt_us = 50, .snd_cwnd = 10,
                        .bytes_acked = entries[i].bytes_acked, .bytes_sent = entries[i].bytes_acked,
                };
                memcpy(value, &st, sizeof st);
        }
        return 0;
}

static TopPeer *peer(TopSnapshot *s, const char *name) {
        for (size_t i = 0; i < s->n_peers; i++)
                if (strcmp(s->peers[i].name, name) == 0)
                        return &s->peers[i];
        return NULL;
}

/* A connection untracked while epdtop walks the map: the kernel's iteration starts
 * again from the first key, and the connections read before it counted twice (alpha
 * showed 5 connections and 122 bytes acked for 2 and 11). */
START_TEST(test_key_deleted_during_iteration) {
        static const struct {
                uint64_t cookie;
                const char *peer;
                uint64_t acked;
        } conns[] = {
                { 0xa, "alpha", 1 }, { 0xb, "alpha", 10 }, { 0xc, "alpha", 100 },
                { 0xd, "bravo", 1000 }, { 0xe, "bravo", 10000 },
        };
        n_entries = ELEMENTSOF(conns);
        for (size_t i = 0; i < n_entries; i++) {
                entries[i].cookie = conns[i].cookie;
                entries[i].peer = conns[i].peer;
                entries[i].bytes_acked = conns[i].acked;
                entries[i].deleted = false;
        }
        delete_when_next_of = 0xc;

        TopSnapshot s = {};
        ck_assert_int_eq(top_pins_read("/pins", &s), 0);
        ck_assert(s.pins);
        ck_assert_uint_eq(s.n_peers, 2);
        TopPeer *a = peer(&s, "alpha"), *b = peer(&s, "bravo");
        ck_assert_ptr_nonnull(a);
        ck_assert_ptr_nonnull(b);
        /* 0xc was untracked before its numbers were read, or after: either way once. */
        ck_assert_uint_eq(a->conns, 2);
        ck_assert_uint_eq(a->bytes_acked, 11);
        ck_assert(a->kernel);
        ck_assert_uint_eq(b->conns, 2);
        ck_assert_uint_eq(b->bytes_acked, 11000);
        ck_assert_uint_eq(b->cwnd, 20);
        top_snapshot_done(&s);
}
END_TEST

/* Nothing deleted: every connection once. */
START_TEST(test_every_key_once) {
        n_entries = 3;
        for (size_t i = 0; i < n_entries; i++) {
                entries[i].cookie = 100 + i;
                entries[i].peer = "alpha";
                entries[i].bytes_acked = 1;
                entries[i].deleted = false;
        }
        delete_when_next_of = 0;

        TopSnapshot s = {};
        ck_assert_int_eq(top_pins_read("/pins", &s), 0);
        ck_assert_uint_eq(s.n_peers, 1);
        ck_assert_uint_eq(s.peers[0].conns, 3);
        ck_assert_uint_eq(s.peers[0].bytes_acked, 3);
        top_snapshot_done(&s);
}
END_TEST

int main(void) {
        Suite *s = suite_create("epdtop-pins");
        TCase *tc = tcase_create("epdtop-pins");
        tcase_add_test(tc, test_every_key_once);
        tcase_add_test(tc, test_key_deleted_during_iteration);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
