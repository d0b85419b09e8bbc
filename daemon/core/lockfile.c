/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/lockfile.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "macro.h"

/* The pid the holder wrote, for when F_GETLK cannot say (another pid namespace). */
static pid_t written_pid(int fd) {
        char buf[32] = { 0 };
        ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
        if (n <= 0)
                return 0;
        long v = strtol(buf, NULL, 10);
        return v > 0 && v < (1L << 30) ? (pid_t)v : 0;
}

int lockfile_take(const char *path, pid_t *ret_holder) {
        /* A process-associated (POSIX) lock: F_GETLK names the pid holding it. The
         * daemon opens this file once and never closes another fd of it, so the lock
         * lives exactly as long as the process. */
        _cleanup_(closep) int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
        if (fd < 0)
                return -errno;
        struct flock fl = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
        if (fcntl(fd, F_SETLK, &fl) < 0) {
                int r = -errno;
                if (r != -EAGAIN && r != -EACCES)
                        return r;
                struct flock q = { .l_type = F_WRLCK, .l_whence = SEEK_SET };
                pid_t holder = 0;
                if (fcntl(fd, F_GETLK, &q) == 0 && q.l_type != F_UNLCK)
                        holder = q.l_pid > 0 ? q.l_pid : 0;
                if (holder == 0)
                        holder = written_pid(fd);
                if (ret_holder)
                        *ret_holder = holder;
                return -EBUSY;
        }
        char buf[32];
        int n = snprintf(buf, sizeof buf, "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) < 0 || pwrite(fd, buf, (size_t)n, 0) != n)
                return negative_errno();
        return TAKE_FD(fd);
}
