/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* systemd's file descriptor store (docs/wal.md#restart): epdd keeps every host arena's
 * memfd there (FDSTORE=1, FDNAME=arena-<name>), so that a restarted or upgraded epdd
 * gets the same memory back (LISTEN_FDS / LISTEN_FDNAMES, sd_listen_fds_with_names),
 * maps it again and, with the WAL, loses nothing. Outside systemd (no NOTIFY_SOCKET)
 * pushing is a no-op and nothing comes back. The service needs FileDescriptorStoreMax=. */

#include <stdbool.h>
#include <stddef.h>

#include "macro.h"

#define FDSTORE_NAME_MAX 255

typedef struct FdStore {
        char **names;
        int *fds;      /* -EBADF once taken */
        /* A taken fd whose name came more than once (an older copy stored too): shared
         * is set, and again holds a copy of it, pushed again once the name is removed
         * (systemd removes by name: every copy). Without the copy, the name's copies
         * all stay in systemd's store. */
        bool *shared;
        int *again;
        size_t n;
        size_t last; /* the index fdstore_take() took last */
} FdStore;

/* Takes the fds passed at start (LISTEN_FDS), with their names; unsets the variables.
 * An empty store when there are none. */
int fdstore_collect(FdStore **ret);
/* The fd stored under name, now the caller's; -ENOENT if none. Under a name stored more
 * than once, the first (systemd passes the newest first), then on the next call the next
 * (after fdstore_refuse()); fdstore_free() drops the others and keeps the one taken
 * stored, alone. */
int fdstore_take(FdStore *s, const char *name);
/* The fd fdstore_take() gave last was refused (not that arena's memory): it is not
 * stored again. */
void fdstore_refuse(FdStore *s);
/* Every copy taken under name was refused (fdstore_refuse() after each): systemd is
 * asked to forget the name, every copy. */
void fdstore_drop(FdStore *s, const char *name);
/* Closes what nobody took (and asks systemd to forget those names). */
FdStore *fdstore_free(FdStore *s);
DEFINE_TRIVIAL_CLEANUP_FUNC(FdStore *, fdstore_free);
/* Closes what nobody took and leaves it in systemd's store, for a start that failed part
 * way: the next start may still want it. */
FdStore *fdstore_close(FdStore *s);

/* Hands a copy of fd to the service manager under name. 0 when stored, -ENOTCONN
 * outside systemd, or the error. */
int fdstore_push(const char *name, int fd);
/* FDSTOREREMOVE=1 for name. */
int fdstore_remove(const char *name);
bool fdstore_name_valid(const char *name);
