/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* One epdd per socket and per state directory: a POSIX record lock on a file next to
 * each (<socket>.lock, <StateDirectory>/epdd.lock), held as long as the daemon runs and
 * released by the kernel however it ends (exit, crash, SIGKILL). A second daemon that
 * finds the lock taken refuses to start and names the pid that holds it; nothing of the
 * first one (its socket, its WAL) is touched. File I/O only (no bus): unit-tested. */

#include <sys/types.h>

/* Creates `path` if needed (mode 0644), locks it without waiting and writes our pid
 * into it. Returns the open fd (O_CLOEXEC; keep it open to keep the lock), or -EBUSY
 * with *ret_holder set to the pid holding the lock (0 when it cannot be known: a
 * holder in another pid namespace), or another negative errno. */
int lockfile_take(const char *path, pid_t *ret_holder);
