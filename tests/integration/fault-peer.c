/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-handoff-peers, preloaded into every epdd of the test. The file
 * named by $EPD_FAULT_PEER_FILE, when it exists, holds "PID TYPE SYNC_MS [OFFSET MASK]":
 * in the process PID, a send() whose buffer starts with a peer frame of TYPE (hex; 0:
 * none) fails with EPIPE, as when the peer's reset already arrived unread; and every
 * fdatasync() takes SYNC_MS milliseconds longer (a slow disk). With OFFSET and MASK
 * (hex), the frames of TYPE are sent instead, with payload byte OFFSET XORed with MASK
 * (a peer of another version, a corrupted message), wherever they lie in the buffer.
 * With a sixth field WAL_FULL of 1, every write() or pwrite() of a record to a file named
 * wal.log fails with ENOSPC, writing nothing (a full disk, from a chosen moment on; the
 * zeros the log writes ahead still go). Any other process, or without the file, the calls
 * are the real ones. Also, in any process, with $EPD_FAULT_LISTEN_SLOW_MS: a listen() on
 * a Unix socket takes that much longer before it listens (a daemon slow between bind()
 * and listen(): test-single-daemon's direct socket case). Test builds only: nothing in
 * epdd knows of it. */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define PEER_FRAME_HEADER 16u

typedef struct Faults {
        unsigned type, sync_ms;
        unsigned flip_offset, flip_mask; /* flip_mask 0: fail the send instead */
        unsigned wal_full;
} Faults;

/* This process's line of the file: 1 when it names this process. */
static int my_faults(Faults *ft) {
        const char *path = getenv("EPD_FAULT_PEER_FILE");
        FILE *f;
        int pid = 0, ok;

        if (!path || !(f = fopen(path, "re")))
                return 0;
        *ft = (Faults) {};
        ok = fscanf(f, "%d %x %u %x %x %u", &pid, &ft->type, &ft->sync_ms, &ft->flip_offset, &ft->flip_mask,
                    &ft->wal_full) >= 2 &&
             pid == (int)getpid();
        fclose(f);
        return ok;
}

static int is_frame(const uint8_t *b, size_t left) {
        return left >= PEER_FRAME_HEADER && b[0] == 'E' && b[1] == 'P' && b[2] == 'D' && b[3] == 'P';
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
        static ssize_t (*real)(int, const void *, size_t, int);
        Faults ft;

        if (!real)
                real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
        if (len < PEER_FRAME_HEADER || !my_faults(&ft) || ft.type == 0)
                return real(fd, buf, len, flags);
        const uint8_t *b = buf;
        if (ft.flip_mask == 0) {
                if (is_frame(b, len) && (unsigned)(b[6] << 8 | b[7]) == ft.type) {
                        errno = EPIPE;
                        return -1;
                }
                return real(fd, buf, len, flags);
        }
        uint8_t *copy = NULL;
        for (size_t i = 0; is_frame(b + i, len - i);) {
                size_t flen = (size_t)b[i + 8] << 24 | (size_t)b[i + 9] << 16 | (size_t)b[i + 10] << 8 | b[i + 11];
                if ((unsigned)(b[i + 6] << 8 | b[i + 7]) == ft.type && ft.flip_offset < flen &&
                    i + PEER_FRAME_HEADER + ft.flip_offset < len) {
                        if (!copy && !(copy = malloc(len)))
                                break;
                        if (copy && b != copy) {
                                memcpy(copy, buf, len);
                                b = copy;
                        }
                        copy[i + PEER_FRAME_HEADER + ft.flip_offset] ^= (uint8_t)ft.flip_mask;
                }
                if (flen > len - i - PEER_FRAME_HEADER)
                        break;
                i += PEER_FRAME_HEADER + flen;
        }
        ssize_t n = real(fd, b, len, flags);
        int e = errno;
        free(copy);
        errno = e;
        return n;
}

int fdatasync(int fd) {
        static int (*real)(int);
        Faults ft;

        if (!real)
                real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
        if (my_faults(&ft) && ft.sync_ms > 0)
                usleep(ft.sync_ms * 1000u);
        return real(fd);
}

/* Whether fd is a regular file named wal.log. */
static int is_wal_log(int fd) {
        struct stat st;
        char link[64], target[4096];
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))
                return 0;
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, target, sizeof target - 1);
        if (n < 8)
                return 0;
        target[n] = 0;
        return strcmp(target + n - 8, "/wal.log") == 0;
}

/* A write of anything but zeros to wal.log, refused while WAL_FULL says so. */
static int wal_refused(int fd, const void *buf, size_t count) {
        const uint8_t *b = buf;
        Faults ft;
        size_t i = 0;
        while (i < count && b[i] == 0)
                i++;
        if (i == count || !is_wal_log(fd) || !my_faults(&ft) || !ft.wal_full)
                return 0;
        errno = ENOSPC;
        return 1;
}

ssize_t write(int fd, const void *buf, size_t count) {
        static ssize_t (*real)(int, const void *, size_t);
        if (!real)
                real = (ssize_t (*)(int, const void *, size_t))dlsym(RTLD_NEXT, "write");
        return wal_refused(fd, buf, count) ? -1 : real(fd, buf, count);
}

/* With _FILE_OFFSET_BITS=64 (as epdd is built) this is pwrite64, what epdd calls. */
ssize_t pwrite(int fd, const void *buf, size_t count, off_t off) {
        static ssize_t (*real)(int, const void *, size_t, off_t);
        if (!real)
                real = (ssize_t (*)(int, const void *, size_t, off_t))dlsym(RTLD_NEXT, "pwrite64");
        return wal_refused(fd, buf, count) ? -1 : real(fd, buf, count, off);
}

int listen(int fd, int backlog) {
        static int (*real)(int, int);
        if (!real)
                real = (int (*)(int, int))dlsym(RTLD_NEXT, "listen");
        const char *ms = getenv("EPD_FAULT_LISTEN_SLOW_MS");
        struct sockaddr_un sa;
        socklen_t len = sizeof sa;
        if (ms && getsockname(fd, (struct sockaddr *)&sa, &len) == 0 && sa.sun_family == AF_UNIX) {
                long v = strtol(ms, NULL, 10);
                struct timespec ts = { .tv_sec = v / 1000, .tv_nsec = v % 1000 * 1000000L };
                (void)nanosleep(&ts, NULL);
        }
        return real(fd, backlog);
}
