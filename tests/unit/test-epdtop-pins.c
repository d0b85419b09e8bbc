/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdtop's reader of the pinned maps (tools/epdtop-pins.c) against a stand-in for the
 * kernel's maps: this file defines the libbpf calls it makes, and the test is linked
 * without libbpf. As the kernel does, a lookup or a walk writes the map's own value or
 * key size, whatever the buffer it is given. */
#include <bpf/bpf.h>
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
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
static int fd_tracked = -EBADF, fd_conns = -EBADF, fd_settings = -EBADF;
static uint64_t delete_when_next_of; /* deleted just before the key after it is asked */

/* The pinned maps as the kernel describes them; pinned_reset() gives epdd's layout. */
static struct {
        const char *name;
        bool absent;
        uint32_t type, key_size, value_size;
        unsigned lookups;
} pinned[3];
enum { PIN_TRACKED, PIN_CONNS, PIN_SETTINGS };
static uint32_t settings_abi;

static void pinned_reset(void) {
        pinned[PIN_TRACKED] = (typeof(pinned[0])){ "tracked", false, BPF_MAP_TYPE_HASH, 8,
                                                   sizeof(struct epd_conn_info) };
        pinned[PIN_CONNS] = (typeof(pinned[0])){ "conns", false, BPF_MAP_TYPE_HASH, 8,
                                                 sizeof(struct epd_conn_stats) };
        pinned[PIN_SETTINGS] = (typeof(pinned[0])){ "settings", false, BPF_MAP_TYPE_ARRAY, 4,
                                                    sizeof(struct epd_telemetry_config) };
        settings_abi = EPD_TELEMETRY_ABI;
}

static int pin_of(int fd) {
        if (fd >= 0 && fd == fd_tracked)
                return PIN_TRACKED;
        if (fd >= 0 && fd == fd_conns)
                return PIN_CONNS;
        ck_assert_int_eq(fd, fd_settings);
        return PIN_SETTINGS;
}

int bpf_obj_get(const char *path) {
        const char *slash = strrchr(path, '/');
        const char *name = slash ? slash + 1 : path;
        int *fds[] = { [PIN_TRACKED] = &fd_tracked, [PIN_CONNS] = &fd_conns, [PIN_SETTINGS] = &fd_settings };
        for (size_t i = 0; i < ELEMENTSOF(pinned); i++) {
                if (!pinned[i].name || strcmp(name, pinned[i].name) != 0 || pinned[i].absent)
                        continue;
                int fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
                if (fd < 0)
                        return -errno;
                return *fds[i] = fd;
        }
        errno = ENOENT;
        return -ENOENT;
}

int bpf_obj_get_info_by_fd(int fd, void *info, __u32 *info_len) {
        struct bpf_map_info m = {};
        int i = pin_of(fd);
        m.type = pinned[i].type;
        m.key_size = pinned[i].key_size;
        m.value_size = pinned[i].value_size;
        m.max_entries = i == PIN_SETTINGS ? 1 : EPD_TELEMETRY_MAX_CONNS;
        *info_len = MIN(*info_len, (__u32)sizeof m);
        memcpy(info, &m, *info_len);
        return 0;
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
        const uint32_t key_size = pinned[PIN_TRACKED].key_size;
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
                        memset(next_key, 0, key_size);
                        memcpy(next_key, &entries[i].cookie, MIN(key_size, (uint32_t)sizeof entries[i].cookie));
                        return 0;
                }
        errno = ENOENT;
        return -ENOENT;
}

int bpf_map_lookup_elem(int fd, const void *key, void *value) {
        int m = pin_of(fd);
        const uint32_t value_size = pinned[m].value_size;
        pinned[m].lookups++;
        if (m == PIN_SETTINGS) {
                uint32_t k;
                memcpy(&k, key, sizeof k);
                if (k != 0) {
                        errno = ENOENT;
                        return -ENOENT;
                }
                struct epd_telemetry_config cfg = { .sample_interval_ns = 1000, .abi = settings_abi };
                memset(value, 0, value_size);
                memcpy(value, &cfg, MIN(value_size, (uint32_t)sizeof cfg));
                return 0;
        }
        uint64_t k;
        memcpy(&k, key, sizeof k);
        ssize_t i = find(k);
        if (i < 0) {
                errno = ENOENT;
                return -ENOENT;
        }
        /* The kernel copies value_size bytes, its own. */
        memset(value, 0, value_size);
        if (m == PIN_TRACKED) {
                struct epd_conn_info info = { .peer_id = 1 };
                snprintf(info.peer, sizeof info.peer, "%s", entries[i].peer);
                memcpy(value, &info, MIN(value_size, (uint32_t)sizeof info));
        } else {
                struct epd_conn_stats st = {
                        .cookie = k, .srtt_us = 100, .min_rtt_us = 50, .snd_cwnd = 10,
                        .bytes_acked = entries[i].bytes_acked, .bytes_sent = entries[i].bytes_acked,
                };
                memcpy(value, &st, MIN(value_size, (uint32_t)sizeof st));
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
        ck_assert_int_eq(top_pins_read_why("/pins", &s, NULL, 0), 0);
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
        ck_assert_int_eq(top_pins_read_why("/pins", &s, NULL, 0), 0);
        ck_assert_uint_eq(s.n_peers, 1);
        ck_assert_uint_eq(s.peers[0].conns, 3);
        ck_assert_uint_eq(s.peers[0].bytes_acked, 3);
        top_snapshot_done(&s);
}
END_TEST

/* Two connections of alpha in the maps; the bus gave a row of bravo, with numbers. */
static void two_conns(TopSnapshot *s) {
        n_entries = 2;
        for (size_t i = 0; i < n_entries; i++) {
                entries[i].cookie = 100 + i;
                entries[i].peer = "alpha";
                entries[i].bytes_acked = 1;
                entries[i].deleted = false;
        }
        delete_when_next_of = 0;
        *s = (TopSnapshot){};
        TopPeer *b = top_snapshot_add_peer(s);
        ck_assert_ptr_nonnull(b);
        snprintf(b->name, sizeof b->name, "%s", "bravo");
        b->conns = 3;
        b->srtt_us = 7;
        b->bytes_acked = 42;
}

/* Nothing read and nothing changed: the snapshot is the bus's alone. */
static void assert_untouched(TopSnapshot *s) {
        ck_assert(!s->pins);
        ck_assert_uint_eq(pinned[PIN_TRACKED].lookups, 0);
        ck_assert_uint_eq(pinned[PIN_CONNS].lookups, 0);
        ck_assert_uint_eq(s->n_peers, 1);
        ck_assert_str_eq(s->peers[0].name, "bravo");
        ck_assert_uint_eq(s->peers[0].conns, 3);
        ck_assert_uint_eq(s->peers[0].srtt_us, 7);
        ck_assert_uint_eq(s->peers[0].bytes_acked, 42);
        ck_assert(!s->peers[0].kernel);
}

/* A pinned "conns" map whose values are larger than epdtop's struct epd_conn_stats (an
 * epdd of another version still running after an upgrade, or --pins=DIR at another
 * program's maps) is refused before anything is read, and why names the map and both
 * sizes. Before, the kernel's copy of the map's own value size overflowed epdtop's stack
 * (ASan: stack-buffer-overflow in bpf_map_lookup_elem). */
START_TEST(test_larger_value_refused) {
        const size_t ours = sizeof(struct epd_conn_stats), theirs = ours + 64;
        char why[512], want[64];
        TopSnapshot s;

        two_conns(&s);
        pinned[PIN_CONNS].value_size = theirs;
        ck_assert_int_eq(top_pins_read_why("/pins", &s, why, sizeof why), -EPROTO);
        assert_untouched(&s);
        ck_assert_msg(strstr(why, "/pins/conns"), "%s", why);
        snprintf(want, sizeof want, "%zu-byte values", theirs);
        ck_assert_msg(strstr(why, want), "%s", why);
        snprintf(want, sizeof want, "%zu-byte values", ours);
        ck_assert_msg(strstr(why, want), "%s", why);
        top_snapshot_done(&s);
}
END_TEST

/* Every other layout epdtop does not read is refused too, before any read. */
static const struct {
        int pin;
        bool absent;
        uint32_t type, key_size, value_size, abi; /* 0: as epdd pins it */
        const char *says;
} others[] = {
        { PIN_TRACKED, .key_size = 16, .says = "/pins/tracked is a hash map of 16-byte keys" },
        { PIN_TRACKED, .value_size = sizeof(struct epd_conn_info) + 8, .says = "/pins/tracked" },
        { PIN_TRACKED, .value_size = sizeof(struct epd_conn_info) - 8, .says = "/pins/tracked" },
        /* Same sizes, but the kernel writes a per-CPU map's value once per CPU. */
        { PIN_CONNS, .type = BPF_MAP_TYPE_PERCPU_HASH, .says = "/pins/conns is a per-CPU hash map" },
        { PIN_SETTINGS, .value_size = sizeof(struct epd_telemetry_config) * 2, .says = "/pins/settings" },
        { PIN_SETTINGS, .abi = EPD_TELEMETRY_ABI + 1, .says = "/pins/settings says telemetry ABI" },
        { PIN_SETTINGS, .absent = true, .says = "/pins/settings is missing" },
};

START_TEST(test_other_layouts_refused) {
        char why[512];
        TopSnapshot s;

        two_conns(&s);
        int p = others[_i].pin;
        pinned[p].absent = others[_i].absent;
        if (others[_i].type)
                pinned[p].type = others[_i].type;
        if (others[_i].key_size)
                pinned[p].key_size = others[_i].key_size;
        if (others[_i].value_size)
                pinned[p].value_size = others[_i].value_size;
        if (others[_i].abi)
                settings_abi = others[_i].abi;
        ck_assert_int_eq(top_pins_read_why("/pins", &s, why, sizeof why), -EPROTO);
        assert_untouched(&s);
        ck_assert_msg(strstr(why, others[_i].says), "%s", why);
        top_snapshot_done(&s);
}
END_TEST

/* Nothing pinned: -ENOENT, the snapshot the bus's alone, nothing said. */
START_TEST(test_nothing_pinned) {
        char why[512] = "x";
        TopSnapshot s;

        two_conns(&s);
        for (size_t i = 0; i < ELEMENTSOF(pinned); i++)
                pinned[i].absent = true;
        ck_assert_int_eq(top_pins_read_why("/pins", &s, why, sizeof why), -ENOENT);
        assert_untouched(&s);
        ck_assert_str_eq(why, "");
        top_snapshot_done(&s);
}
END_TEST


int main(void) {
        Suite *s = suite_create("epdtop-pins");
        TCase *tc = tcase_create("epdtop-pins");
        tcase_add_checked_fixture(tc, pinned_reset, NULL);
        tcase_add_test(tc, test_every_key_once);
        tcase_add_test(tc, test_key_deleted_during_iteration);
        tcase_add_test(tc, test_larger_value_refused);
        tcase_add_loop_test(tc, test_other_layouts_refused, 0, ELEMENTSOF(others));
        tcase_add_test(tc, test_nothing_pinned);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
