/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fault injection for test-handoff-peers, preloaded into every epdd of the test. The file
 * named by $EPD_FAULT_PEER_FILE, when it exists, holds "PID TYPE SYNC_MS": in the
 * process PID, a send() whose buffer starts with a peer frame of TYPE (hex; 0: none)
 * fails with EPIPE, as when the peer's reset already arrived unread; and every
 * fdatasync() takes SYNC_MS milliseconds longer (a slow disk). Any other process, or
 * without the file, the calls are the real ones. Test builds only: nothing in epdd
 * knows of it. */
#include <dlfcn.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define PEER_FRAME_HEADER 16u

/* This process's line of the file: 1 when it names this process. */
static int my_faults(unsigned *type, unsigned *sync_ms) {
        const char *path = getenv("EPD_FAULT_PEER_FILE");
        FILE *f;
        int pid = 0, ok;

        if (!path || !(f = fopen(path, "re")))
                return 0;
        *type = 0;
        *sync_ms = 0;
        ok = fscanf(f, "%d %x %u", &pid, type, sync_ms) >= 2 && pid == (int)getpid();
        fclose(f);
        return ok;
}

ssize_t send(int fd, const void *buf, size_t len, int flags) {
        static ssize_t (*real)(int, const void *, size_t, int);
        unsigned type, sync_ms;

        if (!real)
                real = (ssize_t (*)(int, const void *, size_t, int))dlsym(RTLD_NEXT, "send");
        if (len >= PEER_FRAME_HEADER && my_faults(&type, &sync_ms) && type != 0) {
                const uint8_t *b = buf;
                if (b[0] == 'E' && b[1] == 'P' && b[2] == 'D' && b[3] == 'P' &&
                    (unsigned)(b[6] << 8 | b[7]) == type) {
                        errno = EPIPE;
                        return -1;
                }
        }
        return real(fd, buf, len, flags);
}

int fdatasync(int fd) {
        static int (*real)(int);
        unsigned type, sync_ms;

        if (!real)
                real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
        if (my_faults(&type, &sync_ms) && sync_ms > 0)
                usleep(sync_ms * 1000u);
        return real(fd);
}
