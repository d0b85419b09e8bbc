/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-restart-crash-every-record: preloaded into epdd, it kills the
 * daemon right after WAL record N is in the log. When $EPD_FAULT_WAL_LSN is N, a write()
 * or pwrite() to a file named wal.log that holds the record of LSN N writes the records
 * up to and including it, fdatasync()s the file, and raises SIGKILL: what a kill -9
 * between that record and the next would leave, whatever the writer thread batched
 * together. When $EPD_FAULT_WAL_ENOSPC_LSN is N instead, every write to wal.log that
 * holds a record of LSN N or later fails with ENOSPC, writing nothing (a full disk);
 * with $EPD_FAULT_WAL_ENOSPC_DELAY_MS as well, the first such write fails only after that
 * long (a disk that takes its time to say so: what the loop does meanwhile is tested).
 * $EPD_FAULT_WAL_SLOW_LSN (N) and $EPD_FAULT_WAL_SLOW_MS: the first write holding a
 * record of LSN N or later takes that much longer, then succeeds (a slow disk: what the
 * loop does while a record is not yet durable is tested); with $EPD_FAULT_WAL_SLOW_WRITES
 * (K), the first K such writes do. It combines with the others.
 * Every other write is the real one (the zeros the log writes ahead hold no record: LSN
 * 0). Also a slow disk to read from: with $EPD_FAULT_READ_SLOW ("MS:BYTES:SUBSTRING"),
 * every read() of BYTES or more from a regular file whose path contains SUBSTRING takes
 * MS milliseconds longer (the feature store's read back of a feature's data, not of its
 * header: test-feature's slow-store case); $EPD_FAULT_WRITE_SLOW, of the same form, does
 * the same to write() (the spill thread's: test-feature's spill-drop case). With $EPD_FAULT_CLOCK_SHIFT_SEC (S), the wall
 * clock (CLOCK_REALTIME) reads S seconds later than it is: a run whose clock was ahead of
 * the next one's. Test builds only: nothing in epdd knows of it. */
#include <dlfcn.h>
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define RECORD_HEADER 24u

static uint64_t le64(const uint8_t *p) {
        uint64_t v = 0;
        for (int i = 7; i >= 0; i--)
                v = v << 8 | p[i];
        return v;
}

static uint32_t le32(const uint8_t *p) {
        return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The path of fd when it is a regular file (into target), else false. */
static bool regular_file_path(int fd, char *target, size_t size) {
        struct stat st;
        char link[64];
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
                return false;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, size - 1);
        if (n < 0)
                return false;
        target[n] = 0;
        return true;
}

static bool is_wal_log(int fd) {
        char target[4096];
        if (!regular_file_path(fd, target, sizeof target))
                return false;
        size_t n = strlen(target);
        return n >= 8 && strcmp(target + n - 8, "/wal.log") == 0;
}

/* Whether buf (count bytes, whole records) holds a record of LSN `from` or later. */
static bool holds_record_from(const uint8_t *p, size_t count, uint64_t from) {
        for (size_t at = 0; at + RECORD_HEADER <= count;) {
                uint64_t lsn = le64(p + at + 8);
                if (lsn == 0)
                        return false; /* zeros written ahead */
                if (lsn >= from)
                        return true;
                at += RECORD_HEADER + (((size_t)le32(p + at) + 7) & ~(size_t)7);
        }
        return false;
}

/* Writes buf (count bytes, at off, or at the file position when off < 0) with the real
 * call; when it holds the record of $EPD_FAULT_WAL_LSN, only up to that record, then the
 * kill. */
static ssize_t faulty(int fd, const void *buf, size_t count, off_t off, bool positioned) {
        static ssize_t (*real_write)(int, const void *, size_t);
        static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
        if (!real_write)
                real_write = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
        if (!real_pwrite)
                real_pwrite = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
#define REAL(p, n, o) (positioned ? real_pwrite(fd, (p), (n), (o)) : real_write(fd, (p), (n)))
        const char *target = getenv("EPD_FAULT_WAL_LSN"), *full = getenv("EPD_FAULT_WAL_ENOSPC_LSN"),
                   *slow = getenv("EPD_FAULT_WAL_SLOW_LSN");
        if ((!target && !full && !slow) || count < RECORD_HEADER || !is_wal_log(fd))
                return REAL(buf, count, off);
        const uint8_t *p = buf;
        /* The writer writes whole records (a batch, or one); a file header starts with
         * the magic, not a record. */
        if (memcmp(p, "EPDWAL", 6) == 0)
                return REAL(buf, count, off);
        static unsigned long slowed;
        const char *writes = getenv("EPD_FAULT_WAL_SLOW_WRITES");
        if (slow && slowed < (writes ? strtoul(writes, NULL, 10) : 1) &&
            holds_record_from(p, count, strtoull(slow, NULL, 10))) {
                const char *ms = getenv("EPD_FAULT_WAL_SLOW_MS");
                slowed++;
                usleep((useconds_t)strtoul(ms ? ms : "300", NULL, 10) * 1000);
        }
        if (!target && !full)
                return REAL(buf, count, off);
        if (full) {
                /* A disk that is full from record N on: the write of a batch holding it
                 * fails, writing nothing. */
                if (holds_record_from(p, count, strtoull(full, NULL, 10))) {
                        static bool delayed;
                        const char *delay = getenv("EPD_FAULT_WAL_ENOSPC_DELAY_MS");
                        if (delay && !delayed) {
                                delayed = true;
                                usleep((useconds_t)strtoul(delay, NULL, 10) * 1000);
                        }
                        errno = ENOSPC;
                        return -1;
                }
                return REAL(buf, count, off);
        }
        uint64_t want = strtoull(target, NULL, 10);
        size_t at = 0;
        while (at + RECORD_HEADER <= count) {
                size_t size = RECORD_HEADER + (((size_t)le32(p + at) + 7) & ~(size_t)7);
                uint64_t lsn = le64(p + at + 8);
                if (lsn == 0)
                        break; /* zeros written ahead */
                if (lsn >= want) {
                        size_t end = lsn == want ? at + size : at;
                        for (size_t done = 0; done < end;) {
                                ssize_t k = REAL(p + done, end - done, off + (off_t)done);
                                if (k <= 0 && errno != EINTR)
                                        break;
                                done += k > 0 ? (size_t)k : 0;
                        }
                        (void)fdatasync(fd);
                        raise(SIGKILL);
                        _exit(137);
                }
                at += size;
        }
        return REAL(buf, count, off);
#undef REAL
}

/* $var ("MS:BYTES:SUBSTRING"): a read or write of BYTES or more on a regular file whose
 * path contains SUBSTRING takes MS milliseconds longer. */
static void slow_down(const char *var, int fd, size_t count) {
        const char *slow = getenv(var), *colon = slow ? strchr(slow, ':') : NULL,
                   *path = colon ? strchr(colon + 1, ':') : NULL;
        char target[4096];
        if (path && path[1] && count >= strtoull(colon + 1, NULL, 10) &&
            regular_file_path(fd, target, sizeof target) && strstr(target, path + 1))
                usleep((useconds_t)strtoul(slow, NULL, 10) * 1000);
}

ssize_t write(int fd, const void *buf, size_t count) {
        slow_down("EPD_FAULT_WRITE_SLOW", fd, count);
        return faulty(fd, buf, count, -1, false);
}

/* With _FILE_OFFSET_BITS=64 (as epdd is built) this is pwrite64, what epdd calls. */
ssize_t pwrite(int fd, const void *buf, size_t count, off_t off) {
        return faulty(fd, buf, count, off, true);
}

ssize_t read(int fd, void *buf, size_t count) {
        static ssize_t (*real_read)(int, void *, size_t);
        if (!real_read)
                real_read = (ssize_t (*)(int, void *, size_t))dlsym(RTLD_NEXT, "read");
        slow_down("EPD_FAULT_READ_SLOW", fd, count);
        return real_read(fd, buf, count);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
        static int (*real)(clockid_t, struct timespec *);
        static long long shift = -1;

        if (!real)
                real = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
        if (shift < 0) {
                const char *s = getenv("EPD_FAULT_CLOCK_SHIFT_SEC");
                shift = s ? atoll(s) : 0;
        }
        int r = real(id, ts);
        if (r == 0 && id == CLOCK_REALTIME)
                ts->tv_sec += shift;
        return r;
}
