/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "core/config.h"
#include "crc32c.h"
#include "macro.h"
#include "time-util.h"
#include "unaligned.h"
#include "wal/wal.h"

/* fdatasync() as wal.c calls it in this test binary: the next fail_fdatasync calls fail
 * with EIO (a disk that lost the writes). */
static int fail_fdatasync;
int fdatasync(int fd) {
        if (fail_fdatasync > 0) {
                fail_fdatasync--;
                errno = EIO;
                return -1;
        }
        return (int)syscall(SYS_fdatasync, fd);
}

/* ftruncate() likewise (a file system that refuses the cut as well). */
static int fail_ftruncate;
int ftruncate(int fd, off_t length) {
        if (fail_ftruncate > 0) {
                fail_ftruncate--;
                errno = EIO;
                return -1;
        }
        return (int)syscall(SYS_ftruncate, fd, length);
}

/* fsync() likewise: the inodes of the last directories synced (wal_open's parents). */
static struct stat synced_dirs[16];
static unsigned n_synced_dirs;
int fsync(int fd) {
        struct stat st;
        if (fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) && n_synced_dirs < ELEMENTSOF(synced_dirs))
                synced_dirs[n_synced_dirs++] = st;
        return (int)syscall(SYS_fsync, fd);
}

static bool dir_synced(const char *path) {
        struct stat st;
        ck_assert_int_eq(stat(path, &st), 0);
        for (unsigned i = 0; i < n_synced_dirs; i++)
                if (synced_dirs[i].st_dev == st.st_dev && synced_dirs[i].st_ino == st.st_ino)
                        return true;
        return false;
}

/* Every record's payload is a function of its LSN, so that replay can check that it
 * sees exactly what was appended and nothing else. */
static size_t gen_payload(uint64_t lsn, uint8_t *buf) {
        size_t len = (size_t)((lsn * 37) % 200);
        uint64_t x = lsn * 0x9E3779B97F4A7C15ULL + 1;
        for (size_t i = 0; i < len; i++) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                buf[i] = (uint8_t)x;
        }
        return len;
}

typedef struct State {
        uint64_t n;          /* records applied: the state is "records 1..n" */
        uint64_t bad;        /* records that did not match the generator */
        uint64_t snapshot_n; /* from a snapshot record */
} State;

static int apply(void *userdata, const WalRecord *r, bool from_snapshot) {
        State *s = userdata;
        uint8_t buf[256];

        if (from_snapshot) {
                uint64_t n;
                if (r->type != WAL_RECORD_TEST || r->length != 8) {
                        s->bad++;
                        return 0;
                }
                memcpy(&n, r->payload, 8);
                s->n = s->snapshot_n = n;
                return 0;
        }
        size_t len = gen_payload(r->lsn, buf);
        if (r->type != WAL_RECORD_TEST + 1 || r->length != len || memcmp(r->payload, buf, len) != 0 ||
            r->lsn != s->n + 1)
                s->bad++;
        s->n = r->lsn;
        return 0;
}

static int snapshot(void *userdata, WalSnapshot *snap) {
        State *s = userdata;
        return wal_snapshot_add(snap, WAL_RECORD_TEST, &s->n, 8);
}

static char *make_dir(void) {
        char *d = strdup("/tmp/test-wal-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(d));
        return d;
}

static void rm_dir(char *d) {
        char cmd[512];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", d);
        ck_assert_int_eq(system(cmd), 0);
        free(d);
}

static void append_n(Wal *w, State *s, uint64_t n) {
        uint8_t buf[256];
        for (uint64_t i = 0; i < n; i++) {
                uint64_t lsn = wal_last_lsn(w) + 1, got;
                size_t len = gen_payload(lsn, buf);
                ck_assert_int_eq(wal_append(w, WAL_RECORD_TEST + 1, buf, len, &got), 0);
                ck_assert_uint_eq(got, lsn);
                s->n = lsn;
        }
}

static Wal *reopen(const char *dir, State *s) {
        Wal *w;
        *s = (State){};
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, s), 0);
        ck_assert_uint_eq(s->bad, 0);
        return w;
}

static off_t file_size(const char *dir, const char *name) {
        char p[512];
        struct stat st;
        snprintf(p, sizeof p, "%s/%s", dir, name);
        ck_assert_int_eq(stat(p, &st), 0);
        return st.st_size;
}

static void file_truncate(const char *dir, const char *name, off_t size) {
        char p[512];
        snprintf(p, sizeof p, "%s/%s", dir, name);
        ck_assert_int_eq(truncate(p, size), 0);
}

static void file_flip(const char *dir, const char *name, off_t off, int bit) {
        char p[512];
        uint8_t b;
        snprintf(p, sizeof p, "%s/%s", dir, name);
        int fd = open(p, O_RDWR | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(pread(fd, &b, 1, off), 1);
        b ^= (uint8_t)(1u << bit);
        ck_assert_int_eq(pwrite(fd, &b, 1, off), 1);
        close(fd);
}

static void copy_file(const char *dir, const char *from, const char *to) {
        char a[512], b[512], buf[65536];
        ssize_t k;
        snprintf(a, sizeof a, "%s/%s", dir, from);
        snprintf(b, sizeof b, "%s/%s", dir, to);
        int in = open(a, O_RDONLY | O_CLOEXEC), out = open(b, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
        ck_assert_int_ge(in, 0);
        ck_assert_int_ge(out, 0);
        while ((k = read(in, buf, sizeof buf)) > 0)
                ck_assert_int_eq(write(out, buf, (size_t)k), k);
        ck_assert_int_eq(k, 0);
        close(in);
        close(out);
}

START_TEST(test_crc32c) {
        ck_assert_uint_eq(crc32c(0, "123456789", 9), 0xE3069283u);
        ck_assert_uint_eq(crc32c_portable(0, "123456789", 9), 0xE3069283u);
        ck_assert_uint_eq(crc32c(0, "", 0), 0);
        /* 32 bytes of zeros: RFC 3720 B.4. */
        uint8_t z[32] = {};
        ck_assert_uint_eq(crc32c(0, z, 32), 0x8A9136AAu);
        uint8_t buf[1024];
        srand(1);
        for (size_t i = 0; i < sizeof buf; i++)
                buf[i] = (uint8_t)rand();
        for (size_t off = 0; off < 9; off++)
                for (size_t len = 0; len < 300; len += 7) {
                        ck_assert_uint_eq(crc32c(0, buf + off, len), crc32c_portable(0, buf + off, len));
                        /* Incremental equals one-shot. */
                        uint32_t c = crc32c(0, buf + off, len / 2);
                        c = crc32c(c, buf + off + len / 2, len - len / 2);
                        ck_assert_uint_eq(c, crc32c(0, buf + off, len));
                }
}
END_TEST

START_TEST(test_record_parse) {
        uint8_t payload[256], rec[512];
        WalRecord r;
        size_t size;

        for (uint64_t lsn = 1; lsn < 40; lsn++) {
                size_t len = gen_payload(lsn, payload);
                size_t total = wal_record_size(len);
                ck_assert_uint_eq(total % 8, 0);
                wal_record_encode(rec, lsn, 0x1234, payload, len);
                ck_assert_int_eq(wal_record_parse(rec, total, &r, &size), 0);
                ck_assert_uint_eq(size, total);
                ck_assert_uint_eq(r.lsn, lsn);
                ck_assert_uint_eq(r.type, 0x1234);
                ck_assert_uint_eq(r.length, len);
                ck_assert_int_eq(memcmp(r.payload, payload, len), 0);
                /* Every truncation is torn, never a record. */
                for (size_t n = 0; n < total; n++)
                        ck_assert_int_eq(wal_record_parse(rec, n, &r, &size), -EAGAIN);
                /* Every single-bit flip is detected (bad CRC, or a length that runs past). */
                for (size_t bit = 0; bit < total * 8; bit++) {
                        rec[bit / 8] ^= (uint8_t)(1u << (bit % 8));
                        int k = wal_record_parse(rec, total, &r, &size);
                        ck_assert_msg(k == -EBADMSG || k == -EAGAIN, "bit %zu: %d", bit, k);
                        rec[bit / 8] ^= (uint8_t)(1u << (bit % 8));
                }
        }
        /* Absurd lengths are corruption, not a wait for more bytes. */
        memset(rec, 0xff, WAL_RECORD_HEADER_SIZE);
        ck_assert_int_eq(wal_record_parse(rec, WAL_RECORD_HEADER_SIZE, &r, &size), -EBADMSG);

        uint8_t hdr[WAL_FILE_HEADER_SIZE];
        WalFileHeader h;
        wal_file_header_encode(hdr, &(WalFileHeader){ .kind = WAL_FILE_LOG, .base_lsn = 77 });
        ck_assert_int_eq(wal_file_header_parse(hdr, sizeof hdr, &h), 0);
        ck_assert_uint_eq(h.base_lsn, 77);
        ck_assert_int_eq(wal_file_header_parse(hdr, sizeof hdr - 1, &h), -EBADMSG);
        hdr[17] ^= 4;
        ck_assert_int_eq(wal_file_header_parse(hdr, sizeof hdr, &h), -EBADMSG);
}
END_TEST

/* An apply that refuses a record (-EBADMSG: its owner cannot read it) fails the replay
 * with -EIO; it is never taken for a damaged log, which replay would replace with a new
 * one, losing every record in it. */
static int apply_refuses_7(void *userdata, const WalRecord *r, bool from_snapshot) {
        return r->lsn == 7 ? -EBADMSG : apply(userdata, r, from_snapshot);
}

START_TEST(test_apply_refusal_keeps_the_log) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_ALWAYS, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 10);
        wal_free(w);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_ALWAYS, &w), 0);
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply_refuses_7, &s), -EIO);
        ck_assert_uint_eq(wal_get_stats(w)->corrupt, 0);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 10);
        ck_assert_uint_eq(wal_last_lsn(w), 10);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

START_TEST(test_append_replay) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_ALWAYS, &w), 0);
        uint8_t x = 0;
        ck_assert_int_eq(wal_append(w, WAL_RECORD_TEST + 1, &x, 1, NULL), -ENOTCONN);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBUSY);
        ck_assert_uint_eq(s.n, 0);
        append_n(w, &s, 100);
        ck_assert(!wal_needs_sync(w));
        ck_assert_uint_eq(wal_synced_lsn(w), 100);
        ck_assert_uint_eq(wal_get_stats(w)->syncs, 100);
        ck_assert_int_eq(wal_append(w, WAL_RECORD_SNAPSHOT_END, &x, 1, NULL), -EINVAL);
        ck_assert_int_eq(wal_append(w, WAL_RECORD_TEST, NULL, 5, NULL), -EINVAL);

        /* Group commit: appends are written, one sync makes them durable. */
        wal_set_policy(w, WAL_SYNC_BATCH);
        append_n(w, &s, 50);
        ck_assert(wal_needs_sync(w));
        ck_assert_uint_eq(wal_synced_lsn(w), 100);
        ck_assert_int_eq(wal_sync(w), 0);
        ck_assert_uint_eq(wal_synced_lsn(w), 150);
        ck_assert_uint_eq(wal_get_stats(w)->syncs, 101);
        wal_free(w);

        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 150);
        ck_assert_uint_eq(wal_last_lsn(w), 150);
        ck_assert_uint_eq(wal_get_stats(w)->replayed, 150);
        append_n(w, &s, 10);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 160);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* A failed fdatasync: the records it was to cover (whose callers hear they failed) are
 * cut off, so that neither a clean close nor a restart's replay keeps them; the log goes
 * on from the last good sync, and a compacted log's cut stays within the new file. */
START_TEST(test_sync_failure_cuts) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 10);
        ck_assert_int_eq(wal_sync(w), 0);
        append_n(w, &s, 5);
        fail_fdatasync = 1;
        ck_assert_int_eq(wal_sync(w), -EIO);
        ck_assert_uint_eq(wal_last_lsn(w), 10);
        ck_assert_uint_eq(wal_synced_lsn(w), 10);
        s.n = 10;
        wal_free(w); /* a clean close keeps no cut record */
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 10);
        ck_assert_uint_eq(s.bad, 0);
        /* A log with records is synced once by its replay (a killed writer may have
         * left them unsynced): a failed sync there fails the replay. */
        wal_free(w);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
        fail_fdatasync = 1;
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply, &s), -EIO);
        wal_free(w);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        ck_assert_uint_eq(s.n, 10);
        ck_assert_uint_eq(wal_get_stats(w)->syncs, 1);
        /* It goes on from there; after a compaction too. */
        wal_set_policy(w, WAL_SYNC_BATCH);
        append_n(w, &s, 5);
        ck_assert_int_eq(wal_sync(w), 0);
        ck_assert_int_eq(wal_compact(w, snapshot, &s), 0);
        append_n(w, &s, 3);
        fail_fdatasync = 1;
        ck_assert_int_eq(wal_sync(w), -EIO);
        ck_assert_uint_eq(wal_last_lsn(w), 15);
        s.n = 15;
        append_n(w, &s, 2);
        ck_assert_int_eq(wal_sync(w), 0);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 17);
        ck_assert_uint_eq(s.bad, 0);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* A failed fdatasync whose records cannot be cut off either: the log takes no more
 * records (a later sync would make the failed ones durable), a clean close cuts them
 * instead of syncing them, and where even that cut fails, their first header zeroed
 * ends the log for a replay. */
START_TEST(test_sync_failure_uncut) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        for (int close_cut_fails = 0; close_cut_fails < 2; close_cut_fails++) {
                ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
                s = (State){};
                ck_assert_int_eq(wal_replay(w, apply, &s), 0);
                ck_assert_uint_eq(s.n, 10 * close_cut_fails);
                append_n(w, &s, 10);
                ck_assert_int_eq(wal_sync(w), 0);
                uint64_t good = wal_last_lsn(w);
                append_n(w, &s, 5);
                fail_fdatasync = 1;
                fail_ftruncate = 1;
                ck_assert_int_eq(wal_sync(w), -EIO);
                ck_assert_int_eq(fail_ftruncate, 0);
                ck_assert(wal_is_broken(w));
                uint8_t p[8] = {};
                ck_assert_int_eq(wal_append(w, WAL_RECORD_TEST + 1, p, sizeof p, NULL), -EIO);
                fail_ftruncate = close_cut_fails;
                wal_free(w);
                fail_ftruncate = 0;
                s.n = good;
                w = reopen(dir, &s);
                ck_assert_uint_eq(s.n, good); /* none of the five */
                ck_assert_uint_eq(s.bad, 0);
                /* The zeroed header marks records their callers heard failed: not damage
                 * with acknowledged records behind it, nothing kept aside. */
                ck_assert_uint_eq(wal_get_stats(w)->cut_records, 0);
                char cut[600];
                snprintf(cut, sizeof cut, "%s/wal.log.cut-%" PRIu64, dir, good);
                ck_assert_int_lt(access(cut, F_OK), 0);
                wal_free(w);
        }
        rm_dir(dir);
}
END_TEST

/* Cut the log at every byte of its last records and at random earlier points: replay
 * must give exactly the complete records before the cut, cut the file there, and
 * accept appends that replay again. */
START_TEST(test_truncated) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 60);
        wal_free(w);

        off_t full = file_size(dir, "wal.log");
        copy_file(dir, "wal.log", "orig");
        /* Offsets of the end of each record, to know how many are complete. */
        off_t ends[61];
        ends[0] = WAL_FILE_HEADER_SIZE;
        for (uint64_t l = 1; l <= 60; l++) {
                uint8_t buf[256];
                ends[l] = ends[l - 1] + (off_t)wal_record_size(gen_payload(l, buf));
        }
        ck_assert_int_eq(ends[60], full);

        srand(2);
        for (int iter = 0; iter < 400; iter++) {
                off_t cut = iter < 300 ? full - iter : WAL_FILE_HEADER_SIZE + rand() % (full - WAL_FILE_HEADER_SIZE);
                if (cut < WAL_FILE_HEADER_SIZE)
                        continue;
                copy_file(dir, "orig", "wal.log");
                file_truncate(dir, "wal.log", cut);
                uint64_t complete = 0;
                while (complete < 60 && ends[complete + 1] <= cut)
                        complete++;

                w = reopen(dir, &s);
                ck_assert_uint_eq(s.n, complete);
                ck_assert_int_eq(file_size(dir, "wal.log"), ends[complete]);
                ck_assert_uint_eq(wal_get_stats(w)->torn, cut != ends[complete]);
                append_n(w, &s, 3);
                wal_free(w);
                w = reopen(dir, &s);
                ck_assert_uint_eq(s.n, complete + 3);
                ck_assert_uint_eq(wal_get_stats(w)->torn, 0);
                wal_free(w);
        }
        rm_dir(dir);
}
END_TEST

/* Bytes after a damaged record crafted to pass the damage scan's cheap tests every 24
 * bytes, each header claiming a payload of 1 MiB: the scan's CRCs are bounded (without
 * the bound, these 4 MiB cost ~137 GB of CRC: 16 s in a release build here, far more
 * under ASan, and a tail of a GiB weeks). What it could not examine is
 * kept aside as if it held records; the good records before the damage are replayed. */
START_TEST(test_damage_scan_bounded) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 10);
        wal_free(w);
        off_t good = file_size(dir, "wal.log");

        const size_t n = 4u << 20;
        uint8_t *junk = calloc(1, n);
        ck_assert_ptr_nonnull(junk);
        /* A record whose CRC is wrong (the damage), then the crafted headers. */
        for (size_t off = 0; off + WAL_RECORD_HEADER_SIZE <= n; off += WAL_RECORD_HEADER_SIZE) {
                unaligned_write_le32(junk + off, WAL_RECORD_PAYLOAD_MAX);
                unaligned_write_le32(junk + off + 4, 0xdeadbeef);
                unaligned_write_le64(junk + off + 8, 11);
                unaligned_write_le16(junk + off + 16, WAL_RECORD_TEST + 1);
        }
        char path[512];
        snprintf(path, sizeof path, "%s/wal.log", dir);
        int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(write(fd, junk, n), (ssize_t)n);
        close(fd);
        free(junk);

        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        w = reopen(dir, &s);
        usec_t took = now_usec(CLOCK_MONOTONIC) - t0;
        ck_assert_uint_eq(s.n, 10);
        ck_assert_int_eq(file_size(dir, "wal.log"), good);
        ck_assert(wal_get_stats(w)->cut_scan_incomplete);
        ck_assert_uint_eq(wal_get_stats(w)->cut_records, 0);
        ck_assert_int_eq(file_size(dir, "wal.log.cut-10"), (off_t)n);
        /* A bound of twice the bytes' size plus 2 MiB of CRC: well under a second even
         * under ASan. */
        ck_assert_msg(took < 10 * USEC_PER_SEC, "the scan took %" PRIu64 " us", took);
        append_n(w, &s, 2);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 12);
        ck_assert(!wal_get_stats(w)->cut_scan_incomplete);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* Flip bits anywhere past the header: replay applies only records before the damaged
 * one (all of them intact), never the damaged one or anything after it. */
START_TEST(test_bitflip) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 40);
        wal_free(w);
        off_t full = file_size(dir, "wal.log");
        copy_file(dir, "wal.log", "orig");
        off_t ends[41];
        ends[0] = WAL_FILE_HEADER_SIZE;
        for (uint64_t l = 1; l <= 40; l++) {
                uint8_t buf[256];
                ends[l] = ends[l - 1] + (off_t)wal_record_size(gen_payload(l, buf));
        }

        srand(3);
        for (int iter = 0; iter < 500; iter++) {
                off_t off = WAL_FILE_HEADER_SIZE + rand() % (full - WAL_FILE_HEADER_SIZE);
                copy_file(dir, "orig", "wal.log");
                file_flip(dir, "wal.log", off, rand() % 8);
                uint64_t damaged = 0; /* index of the record holding the flip */
                while (ends[damaged + 1] <= off)
                        damaged++;

                w = reopen(dir, &s);
                ck_assert_uint_eq(s.n, damaged);
                ck_assert_uint_eq(wal_get_stats(w)->corrupt + wal_get_stats(w)->torn, 1);
                ck_assert_int_eq(file_size(dir, "wal.log"), ends[damaged]);
                /* The well-formed records after the damage are not replayed, but the
                 * bytes cut are kept aside (they may hold acknowledged changes). */
                ck_assert_uint_eq(wal_get_stats(w)->cut_records, 39 - damaged);
                char cut[64], path[512];
                snprintf(cut, sizeof cut, "wal.log.cut-%" PRIu64, damaged);
                snprintf(path, sizeof path, "%s/%s", dir, cut);
                if (damaged < 39) {
                        ck_assert_int_eq(file_size(dir, cut), full - ends[damaged]);
                        ck_assert_int_eq(unlink(path), 0);
                } else
                        ck_assert_int_lt(access(path, F_OK), 0);
                wal_free(w);
        }

        /* A damaged file header: the start is refused and the log left as it is (a new
         * log over it dropped all 40 acknowledged records, silently). */
        copy_file(dir, "orig", "wal.log");
        file_flip(dir, "wal.log", 20, 0);
        s = (State){};
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBADMSG);
        ck_assert_uint_eq(s.n, 0);
        wal_free(w);
        ck_assert_int_eq(file_size(dir, "wal.log"), full);
        /* Moved aside, the start goes on without it. */
        copy_file(dir, "wal.log", "wal.log.damaged");
        char p[512];
        snprintf(p, sizeof p, "%s/wal.log", dir);
        ck_assert_int_eq(unlink(p), 0);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 0);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

START_TEST(test_compaction) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 30);
        ck_assert_int_eq(wal_compact(w, snapshot, &s), 0);
        ck_assert_int_eq(file_size(dir, "wal.log"), WAL_FILE_HEADER_SIZE);
        append_n(w, &s, 5);
        ck_assert_int_eq(wal_sync(w), 0);
        wal_free(w);

        w = reopen(dir, &s);
        ck_assert_uint_eq(s.snapshot_n, 30);
        ck_assert_uint_eq(s.n, 35);
        ck_assert_uint_eq(wal_get_stats(w)->replayed, 5);
        /* Crash between the snapshot's rename and the log's: keep an old log. */
        append_n(w, &s, 5);
        copy_file(dir, "wal.log", "old-log");
        ck_assert_int_eq(wal_compact(w, snapshot, &s), 0);
        wal_free(w);
        copy_file(dir, "old-log", "wal.log");
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 40);
        append_n(w, &s, 2);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 42);
        wal_free(w);

        /* A compaction that crashed before its rename leaves a tmp file: ignored. */
        copy_file(dir, "wal.snapshot", "wal.snapshot.tmp");
        file_truncate(dir, "wal.snapshot.tmp", 50);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 42);
        wal_free(w);

        /* A damaged snapshot is fatal: its state cannot be rebuilt by cutting. */
        copy_file(dir, "wal.snapshot", "good-snap");
        file_flip(dir, "wal.snapshot", WAL_FILE_HEADER_SIZE + 30, 1);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBADMSG);
        wal_free(w);
        /* And one cut at a record boundary before its SNAPSHOT_END (each record whole,
         * the state's end missing), or with a record after it. */
        copy_file(dir, "good-snap", "wal.snapshot");
        file_truncate(dir, "wal.snapshot", file_size(dir, "good-snap") - wal_record_size(8));
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBADMSG);
        wal_free(w);
        {
                uint8_t rec[WAL_RECORD_HEADER_SIZE + 8] = {};
                uint64_t v = 1;
                size_t n = (size_t)file_size(dir, "good-snap");
                uint8_t *buf = malloc(n + sizeof rec);
                char p[600];
                snprintf(p, sizeof p, "%s/good-snap", dir);
                FILE *f = fopen(p, "re");
                ck_assert_ptr_nonnull(f);
                ck_assert_uint_eq(fread(buf, 1, n, f), n);
                fclose(f);
                /* The END's LSN is the snapshot's record count: the next one follows it. */
                WalParseResult pr;
                ck_assert_int_eq(wal_parse_buffer(buf, n, 0, NULL, NULL, true, &pr), 0);
                wal_record_encode(rec, pr.last_lsn + 1, WAL_RECORD_TEST, &v, 8);
                memcpy(buf + n, rec, sizeof rec);
                snprintf(p, sizeof p, "%s/wal.snapshot", dir);
                f = fopen(p, "we");
                ck_assert_ptr_nonnull(f);
                ck_assert_uint_eq(fwrite(buf, 1, n + sizeof rec, f), n + sizeof rec);
                fclose(f);
                free(buf);
        }
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        s = (State){};
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBADMSG);
        wal_free(w);
        /* So is a missing one, when the log starts after LSN 0. */
        copy_file(dir, "good-snap", "wal.snapshot");
        char path[600];
        snprintf(path, sizeof path, "%s/wal.snapshot", dir);
        ck_assert_int_eq(unlink(path), 0);
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), -EBADMSG);
        wal_free(w);
        copy_file(dir, "good-snap", "wal.snapshot");
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 42);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* kill -9 a writer at random points, compactions included: after every restart each
 * acknowledged record is there, and nothing but appended records. */
/* Records are written over zeros written ahead: a log left by a kill (the zeros still
 * there) replays every record and takes the zeros for its end, not for damage, and the
 * next records go where the last one ended; a clean close leaves the records alone. A
 * damaged record before the zeros is still damage. */
START_TEST(test_written_ahead) {
        char *dir = make_dir();
        State s = {};
        Wal *w;

        ck_assert_int_eq(wal_open(dir, WAL_SYNC_BATCH, &w), 0);
        ck_assert_int_eq(wal_replay(w, apply, &s), 0);
        append_n(w, &s, 20);
        ck_assert_int_eq(wal_sync(w), 0);
        uint64_t end = wal_get_stats(w)->log_bytes;
        off_t ahead = file_size(dir, "wal.log");
        ck_assert_int_gt(ahead, (off_t)end); /* zeros after the records */
        copy_file(dir, "wal.log", "killed"); /* what a kill -9 leaves */
        wal_free(w);
        ck_assert_int_eq(file_size(dir, "wal.log"), (off_t)end);

        copy_file(dir, "killed", "wal.log");
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 20);
        ck_assert_uint_eq(wal_get_stats(w)->torn, 0);
        ck_assert_uint_eq(wal_get_stats(w)->corrupt, 0);
        ck_assert_uint_eq(wal_get_stats(w)->cut_bytes, 0);
        ck_assert_uint_eq(wal_get_stats(w)->log_bytes, end);
        append_n(w, &s, 5);
        wal_free(w);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 25);
        ck_assert_uint_eq(wal_get_stats(w)->torn + wal_get_stats(w)->corrupt, 0);
        wal_free(w);

        /* A flipped bit in the last record before the zeros: that record is cut. */
        copy_file(dir, "killed", "wal.log");
        file_flip(dir, "wal.log", (off_t)end - 3, 1);
        w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 19);
        ck_assert_uint_eq(wal_get_stats(w)->corrupt + wal_get_stats(w)->torn, 1);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

/* Where the zeros cannot be written ahead (here RLIMIT_FSIZE stands in for a full
 * disk: the file may not grow by the next MiB), a record that fits is still written, as
 * an append, and later zeros never overwrite it; replay has every record. */
START_TEST(test_no_room_ahead) {
        char *dir = make_dir();
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                State s = {};
                Wal *w;
                signal(SIGXFSZ, SIG_IGN); /* a write past the limit fails with EFBIG */
                if (wal_open(dir, WAL_SYNC_BATCH, &w) < 0 || wal_replay(w, apply, &s) < 0)
                        _exit(2);
                /* Room for the header and about 200 records, not for 1 MiB of zeros. */
                struct rlimit rl = { 64 * 1024, 64 * 1024 };
                if (setrlimit(RLIMIT_FSIZE, &rl) < 0)
                        _exit(3);
                for (unsigned i = 0; i < 100; i++) {
                        uint8_t buf[256];
                        size_t len = gen_payload(wal_last_lsn(w) + 1, buf);
                        if (wal_append(w, WAL_RECORD_TEST + 1, buf, len, NULL) < 0 || wal_sync(w) < 0)
                                _exit(4);
                }
                _exit(0); /* as a kill would leave it: no clean close */
        }
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the writer failed (%d)", status);
        State s = {};
        Wal *w = reopen(dir, &s);
        ck_assert_uint_eq(s.n, 100);
        ck_assert_uint_eq(wal_get_stats(w)->torn + wal_get_stats(w)->corrupt, 0);
        wal_free(w);
        rm_dir(dir);
}
END_TEST

START_TEST(test_crash) {
        char *dir = make_dir();
        uint64_t acked_total = 0;

        srand((unsigned)time(NULL));
        for (int iter = 0; iter < 25; iter++) {
                int p[2];
                ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
                pid_t pid = fork();
                ck_assert_int_ge(pid, 0);
                if (pid == 0) {
                        State s = {};
                        Wal *w;
                        close(p[0]);
                        if (wal_open(dir, iter % 3 == 0 ? WAL_SYNC_ALWAYS : WAL_SYNC_BATCH, &w) < 0 ||
                            wal_replay(w, apply, &s) < 0 || s.bad)
                                _exit(2);
                        for (uint64_t i = 0;; i++) {
                                uint8_t buf[256];
                                uint64_t lsn = wal_last_lsn(w) + 1;
                                size_t len = gen_payload(lsn, buf);
                                if (wal_append(w, WAL_RECORD_TEST + 1, buf, len, NULL) < 0 ||
                                    wal_sync(w) < 0)
                                        _exit(3);
                                s.n = lsn;
                                /* Acknowledge only after the append (and its sync) returned. */
                                if (write(p[1], &lsn, sizeof lsn) != sizeof lsn)
                                        _exit(4);
                                if (i % 97 == 50 && wal_compact(w, snapshot, &s) < 0)
                                        _exit(5);
                        }
                }
                close(p[1]);
                /* Kill it at a random point after it started appending. */
                uint64_t lsn, acked = acked_total;
                if (read(p[0], &lsn, sizeof lsn) == sizeof lsn)
                        acked = lsn;
                usleep(rand() % 20000);
                kill(pid, SIGKILL);
                int status;
                ck_assert_int_eq(waitpid(pid, &status, 0), pid);
                ck_assert(WIFSIGNALED(status));
                while (read(p[0], &lsn, sizeof lsn) == sizeof lsn)
                        acked = lsn;
                close(p[0]);

                State s = {};
                Wal *w;
                ck_assert_int_eq(wal_open(dir, WAL_SYNC_NONE, &w), 0);
                ck_assert_int_eq(wal_replay(w, apply, &s), 0);
                ck_assert_uint_eq(s.bad, 0);
                ck_assert_uint_ge(s.n, acked);
                /* At most the one record whose acknowledgement was in flight. */
                ck_assert_uint_le(s.n, acked + 1);
                acked_total = s.n;
                wal_free(w);
        }
        ck_assert_uint_gt(acked_total, 25);
        rm_dir(dir);
}
END_TEST

START_TEST(test_config) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(c.wal_sync, WAL_SYNC_BATCH);
        ck_assert_int_eq(config_parse_string(&c, "[Wal]\nSync=always\nCompactSize=1M\n", "t", &errors), 0);
        ck_assert_int_eq(c.wal_sync, WAL_SYNC_ALWAYS);
        ck_assert_uint_eq(c.wal_compact_bytes, 1 << 20);
        ck_assert_int_eq(config_parse_string(&c, "[Wal]\nSync=sometimes\n", "t", &errors), -EINVAL);
        ck_assert_ptr_nonnull(errors);
        ck_assert_ptr_nonnull(strstr(errors, "always, batch or none"));
        free(errors);
        ck_assert_int_eq(c.wal_sync, WAL_SYNC_ALWAYS); /* nothing half-applied */
        config_done(&c);
        for (int p = 0; p < _WAL_SYNC_POLICY_MAX; p++)
                ck_assert_int_eq(wal_sync_policy_from_string(wal_sync_policy_to_string(p)), p);
        ck_assert_int_eq(wal_sync_policy_from_string("fast"), -EINVAL);
}
END_TEST

/* A new log's directory entries are durable before anything is acknowledged: the
 * directory above it (which holds `wal`) and the one above that (which holds the state
 * directory, made by epdd or systemd without a sync) are synced at open. Else a power
 * loss after the first acknowledged record could take the whole directory. */
START_TEST(test_new_directory_entries_synced) {
        char *base = make_dir(), state[64], dir[80];
        snprintf(state, sizeof state, "%s/state", base);
        snprintf(dir, sizeof dir, "%s/wal", state);
        ck_assert_int_eq(mkdir(state, 0755), 0);
        n_synced_dirs = 0;
        Wal *w = NULL;
        ck_assert_int_eq(wal_open(dir, WAL_SYNC_ALWAYS, &w), 0);
        ck_assert_msg(dir_synced(state), "the state directory (holding wal/) was not synced");
        ck_assert_msg(dir_synced(base), "the directory holding the state directory was not synced");
        wal_free(w);
        rm_dir(base);
}
END_TEST

int main(void) {
        Suite *s = suite_create("wal");
        TCase *tc = tcase_create("wal");
        tcase_set_timeout(tc, 120);
        tcase_add_test(tc, test_crc32c);
        tcase_add_test(tc, test_config);
        tcase_add_test(tc, test_record_parse);
        tcase_add_test(tc, test_append_replay);
        tcase_add_test(tc, test_sync_failure_cuts);
        tcase_add_test(tc, test_sync_failure_uncut);
        tcase_add_test(tc, test_truncated);
        tcase_add_test(tc, test_bitflip);
        tcase_add_test(tc, test_damage_scan_bounded);
        tcase_add_test(tc, test_compaction);
        tcase_add_test(tc, test_apply_refusal_keeps_the_log);
        tcase_add_test(tc, test_written_ahead);
        tcase_add_test(tc, test_no_room_ahead);
        tcase_add_test(tc, test_crash);
        tcase_add_test(tc, test_new_directory_entries_synced);
        suite_add_tcase(s, tc);
        SRunner *sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
