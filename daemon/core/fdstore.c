/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <systemd/sd-daemon.h>

#include "core/fdstore.h"
#include "log.h"

bool fdstore_name_valid(const char *name) {
        size_t n = name ? strlen(name) : 0;
        if (n == 0 || n > FDSTORE_NAME_MAX)
                return false;
        /* systemd refuses ':' (the LISTEN_FDNAMES separator) and control characters. */
        for (size_t i = 0; i < n; i++)
                if (name[i] == ':' || name[i] <= ' ' || name[i] >= 0x7f)
                        return false;
        return true;
}

int fdstore_collect(FdStore **ret) {
        FdStore *s;
        char **names = NULL;
        int n;

        s = calloc(1, sizeof *s);
        if (!s)
                return -ENOMEM;
        n = sd_listen_fds_with_names(true, &names);
        if (n < 0) {
                log_warning_errno(n, "Cannot take the stored file descriptors: %m");
                n = 0;
        }
        if (n > 0) {
                s->fds = calloc((size_t)n, sizeof *s->fds);
                s->again = calloc((size_t)n, sizeof *s->again);
                s->shared = calloc((size_t)n, sizeof *s->shared);
                if (!s->fds || !s->again || !s->shared) {
                        free(s->again);
                        free(s->shared);
                        for (int i = 0; i < n; i++) {
                                safe_close(SD_LISTEN_FDS_START + i);
                                free(names ? names[i] : NULL);
                        }
                        free(names);
                        free(s);
                        return -ENOMEM;
                }
                for (int i = 0; i < n; i++) {
                        s->again[i] = -EBADF;
                        s->fds[i] = SD_LISTEN_FDS_START + i;
                        /* Close-on-exec, like every other fd of epdd. */
                        int flags = fcntl(s->fds[i], F_GETFD);
                        if (flags < 0 || fcntl(s->fds[i], F_SETFD, flags | FD_CLOEXEC) < 0)
                                log_debug_errno(errno, "Cannot set FD_CLOEXEC on a stored fd: %m");
                }
                s->names = names;
                s->n = (size_t)n;
                log_info("Got %d file descriptor(s) back from the fd store.", n);
        } else
                free(names);
        *ret = s;
        return 0;
}

static bool same_name(const FdStore *s, size_t i, const char *name) {
        return s->names && s->names[i] && strcmp(s->names[i], name) == 0;
}

int fdstore_take(FdStore *s, const char *name) {
        for (size_t i = 0; s && i < s->n; i++) {
                if (s->fds[i] < 0 || !same_name(s, i, name))
                        continue;
                s->last = i;
                for (size_t j = 0; j < s->n; j++)
                        if (j != i && same_name(s, j, name)) { /* taken and refused, or not yet */
                                /* Another copy under this name: dropping it (by name) would
                                 * drop this one too, so it is pushed again after. */
                                s->shared[i] = true;
                                s->again[i] = fcntl(s->fds[i], F_DUPFD_CLOEXEC, 3);
                                if (s->again[i] < 0)
                                        log_warning_errno(errno, "Stored fd '%s': cannot copy it (%m); its older "
                                                                 "copies stay in the store.",
                                                          name);
                                break;
                        }
                return TAKE_FD(s->fds[i]);
        }
        return -ENOENT;
}

void fdstore_refuse(FdStore *s) {
        if (!s || s->last >= s->n)
                return;
        s->shared[s->last] = false;
        s->again[s->last] = safe_close(s->again[s->last]);
}

void fdstore_drop(FdStore *s, const char *name) {
        if (fdstore_name_valid(name))
                (void)fdstore_remove(name);
}

/* Whether name's fd was taken while older copies of it are stored too. */
static bool taken_shared(const FdStore *s, const char *name) {
        for (size_t i = 0; i < s->n; i++)
                if (s->shared[i] && same_name(s, i, name))
                        return true;
        return false;
}

FdStore *fdstore_free(FdStore *s) {
        if (!s)
                return NULL;
        for (size_t i = 0; i < s->n; i++) {
                if (s->fds[i] >= 0) {
                        const char *name = s->names && s->names[i] ? s->names[i] : "unknown";
                        bool dup = taken_shared(s, name);
                        if (dup)
                                log_notice("Stored fd '%s' is an older copy of one taken back; dropping it.", name);
                        else
                                log_notice("Stored fd '%s' is not used by this configuration; dropping it.", name);
                        safe_close(s->fds[i]);
                        if (!dup && fdstore_name_valid(name))
                                (void)fdstore_remove(name);
                }
        }
        /* Names stored more than once: every copy goes, then the one taken back is
         * stored again, alone. */
        for (size_t i = 0; i < s->n; i++) {
                if (!s->shared[i] || s->again[i] < 0)
                        continue; /* (no copy: every copy of the name stays stored) */
                if (fdstore_remove(s->names[i]) >= 0)
                        (void)fdstore_push(s->names[i], s->again[i]);
                s->again[i] = safe_close(s->again[i]);
        }
        for (size_t i = 0; s->names && i < s->n; i++)
                free(s->names[i]);
        free(s->names);
        free(s->fds);
        free(s->again);
        free(s->shared);
        free(s);
        return NULL;
}

FdStore *fdstore_close(FdStore *s) {
        if (!s)
                return NULL;
        for (size_t i = 0; i < s->n; i++) {
                s->fds[i] = safe_close(s->fds[i]);
                s->again[i] = safe_close(s->again[i]); /* systemd's store left as it is */
                s->shared[i] = false;
        }
        return fdstore_free(s);
}

int fdstore_push(const char *name, int fd) {
        char msg[64 + FDSTORE_NAME_MAX];
        int r;

        if (!fdstore_name_valid(name) || fd < 0)
                return -EINVAL;
        if (!getenv("NOTIFY_SOCKET"))
                return -ENOTCONN;
        snprintf(msg, sizeof msg, "FDSTORE=1\nFDNAME=%s", name);
        r = sd_pid_notify_with_fds(0, false, msg, &fd, 1);
        if (r < 0)
                return log_warning_errno(r, "Cannot store fd '%s' with the service manager: %m", name);
        if (r == 0)
                return -ENOTCONN;
        return 0;
}

int fdstore_remove(const char *name) {
        char msg[64 + FDSTORE_NAME_MAX];
        int r;

        if (!fdstore_name_valid(name))
                return -EINVAL;
        if (!getenv("NOTIFY_SOCKET"))
                return -ENOTCONN;
        snprintf(msg, sizeof msg, "FDSTOREREMOVE=1\nFDNAME=%s", name);
        r = sd_notify(false, msg);
        return r < 0 ? r : r == 0 ? -ENOTCONN : 0;
}
