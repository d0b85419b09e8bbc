/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "transport/rdma-select.h"

static const char *const policy_names[_TRANSPORT_POLICY_MAX] = {
        [TRANSPORT_POLICY_AUTO] = "auto",
        [TRANSPORT_POLICY_TCP] = "tcp",
        [TRANSPORT_POLICY_RDMA] = "rdma",
};

const char *transport_policy_to_string(TransportPolicy p) {
        return p >= 0 && p < _TRANSPORT_POLICY_MAX ? policy_names[p] : NULL;
}

int transport_policy_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (int i = 0; i < _TRANSPORT_POLICY_MAX; i++)
                if (strcmp(s, policy_names[i]) == 0)
                        return i;
        return -EINVAL;
}

static void copy_str(char *dst, size_t n, const char *src) {
        size_t l = strnlen(src, n - 1);
        memcpy(dst, src, l);
        dst[l] = 0;
}

/* Reads the first line of a small sysfs file, without the newline. */
static int read_line(const char *path, char *buf, size_t n) {
        FILE *f = fopen(path, "re");
        size_t l;

        buf[0] = 0;
        if (!f)
                return -errno;
        if (!fgets(buf, (int)n, f))
                buf[0] = 0;
        fclose(f);
        l = strlen(buf);
        while (l > 0 && (buf[l - 1] == '\n' || buf[l - 1] == ' '))
                buf[--l] = 0;
        return 0;
}

bool rdma_parse_port_state(const char *line, char *state, size_t n) {
        const char *p = line ? strchr(line, ':') : NULL;

        if (n > 0)
                state[0] = 0;
        if (!line)
                return false;
        /* "4: ACTIVE"; tolerate a bare name. */
        p = p ? p + 1 : line;
        while (*p && isspace((unsigned char)*p))
                p++;
        if (n > 0)
                copy_str(state, n, p);
        return strcmp(p, "ACTIVE") == 0;
}

static bool valid_name(const char *s, size_t max) {
        size_t l = strnlen(s, max);
        if (l == 0 || l >= max || s[0] == '.')
                return false;
        for (size_t i = 0; i < l; i++)
                if (s[i] == '/' || !isprint((unsigned char)s[i]))
                        return false;
        return true;
}

static int cmp_link(const void *a, const void *b) {
        const RdmaLink *x = a, *y = b;
        int c = strcmp(x->device, y->device);
        if (c)
                return c;
        if (x->port != y->port)
                return x->port < y->port ? -1 : 1;
        return strcmp(x->netdev, y->netdev);
}

int rdma_links_from_sysfs(const char *root, RdmaLink *links, size_t max) {
        char p[PATH_MAX];
        DIR *devs;
        struct dirent *de;
        size_t n = 0;

        if (!root || (!links && max > 0))
                return -EINVAL;
        snprintf(p, sizeof p, "%s/class/infiniband", root);
        devs = opendir(p);
        if (!devs)
                return errno == ENOENT ? 0 : -errno;
        while ((de = readdir(devs))) {
                DIR *ports;
                struct dirent *pe;

                if (!valid_name(de->d_name, RDMA_NAME_MAX))
                        continue;
                snprintf(p, sizeof p, "%s/class/infiniband/%s/ports", root, de->d_name);
                ports = opendir(p);
                if (!ports)
                        continue;
                while ((pe = readdir(ports))) {
                        char line[64], state[24];
                        unsigned long port;
                        char *end;
                        bool active;

                        errno = 0;
                        port = strtoul(pe->d_name, &end, 10);
                        if (errno || *end || end == pe->d_name || port == 0 || port > 255)
                                continue;
                        snprintf(p, sizeof p, "%s/class/infiniband/%s/ports/%lu/state", root, de->d_name, port);
                        (void)read_line(p, line, sizeof line);
                        active = rdma_parse_port_state(line, state, sizeof state);
                        for (int g = 0; g < RDMA_MAX_GID_INDEX; g++) {
                                char nd[IF_NAMESIZE + 8];
                                bool dup = false;

                                snprintf(p, sizeof p, "%s/class/infiniband/%s/ports/%lu/gid_attrs/ndevs/%d", root,
                                         de->d_name, port, g);
                                /* An unused GID slot reads as EINVAL in sysfs. */
                                if (read_line(p, nd, sizeof nd) < 0 || !valid_name(nd, IF_NAMESIZE))
                                        continue;
                                for (size_t k = 0; k < n; k++)
                                        if (strcmp(links[k].device, de->d_name) == 0 && links[k].port == port &&
                                            strcmp(links[k].netdev, nd) == 0)
                                                dup = true;
                                if (dup)
                                        continue;
                                if (n >= max) {
                                        closedir(ports);
                                        closedir(devs);
                                        return -ENOBUFS;
                                }
                                links[n] = (RdmaLink){ .port = (uint8_t)port, .gid_index = g, .active = active };
                                copy_str(links[n].device, sizeof links[n].device, de->d_name);
                                copy_str(links[n].netdev, sizeof links[n].netdev, nd);
                                copy_str(links[n].state, sizeof links[n].state, state);
                                n++;
                        }
                }
                closedir(ports);
        }
        closedir(devs);
        if (n > 1)
                qsort(links, n, sizeof *links, cmp_link);
        return (int)n;
}

const RdmaLink *rdma_link_for_netdev(const RdmaLink *links, size_t n, const char *ifname) {
        const RdmaLink *found = NULL;

        if (!links || !ifname || !ifname[0])
                return NULL;
        for (size_t i = 0; i < n; i++)
                if (strcmp(links[i].netdev, ifname) == 0) {
                        if (links[i].active)
                                return links + i;
                        if (!found)
                                found = links + i;
                }
        return found;
}

TransportKind rdma_select(const RdmaSelectInput *in, char *reason, size_t n, bool *warn) {
        const char *forced = in->policy == TRANSPORT_POLICY_RDMA ? " (Transport=rdma is forced)" : "";
        bool w = in->policy == TRANSPORT_POLICY_RDMA;
        TransportKind k = TRANSPORT_TCP;

        if (in->policy == TRANSPORT_POLICY_TCP) {
                snprintf(reason, n, "tcp: Transport=tcp in [Cluster]");
                w = false;
        } else if (in->n_links == 0)
                snprintf(reason, n, "tcp: no RDMA devices on this host%s", forced);
        else if (!in->ifname || !in->ifname[0])
                snprintf(reason, n, "tcp: no route to the peer, so no RDMA device on it%s", forced);
        else if (!in->local)
                snprintf(reason, n, "tcp: no RDMA device carries %s%s", in->ifname, forced);
        else if (!in->local->active)
                snprintf(reason, n, "tcp: RDMA device %s port %u on %s is %s, not ACTIVE%s", in->local->device,
                         in->local->port, in->ifname, in->local->state[0] ? in->local->state : "down", forced);
        else if (in->failure)
                snprintf(reason, n, "tcp: RDMA via %s port %u failed: %s%s", in->local->device, in->local->port,
                         in->failure, forced);
        else if (!in->rdma_built)
                snprintf(reason, n, "tcp: RDMA device %s port %u on %s, but this build has no RDMA data path%s",
                         in->local->device, in->local->port, in->ifname, forced);
        else if (!in->peer_announced)
                snprintf(reason, n, "tcp: RDMA device %s port %u on %s; waiting for the peer to announce its side%s",
                         in->local->device, in->local->port, in->ifname, forced);
        else if (!in->peer_rdma)
                snprintf(reason, n, "tcp: RDMA device %s port %u on %s, but the peer has none on its route back%s",
                         in->local->device, in->local->port, in->ifname, forced);
        else {
                snprintf(reason, n, "rdma: %s port %u on %s here, %s on the peer%s", in->local->device,
                         in->local->port, in->ifname,
                         in->peer_device && in->peer_device[0] ? in->peer_device : "an RDMA device",
                         in->policy == TRANSPORT_POLICY_RDMA ? " (Transport=rdma)" : " (Transport=auto)");
                k = TRANSPORT_RDMA;
                w = false;
        }
        /* A device that went away also changes the branch: keep what happened visible. */
        if (in->failure && in->policy != TRANSPORT_POLICY_TCP &&
            (in->n_links == 0 || !in->ifname || !in->ifname[0] || !in->local || !in->local->active)) {
                size_t l = strnlen(reason, n);
                if (l + 1 < n)
                        snprintf(reason + l, n - l, "; RDMA failed: %s", in->failure);
        }
        if (warn)
                *warn = w;
        return k;
}
