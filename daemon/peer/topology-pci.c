/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "macro.h"
#include "peer/topology-pci.h"

static bool is_hex(char c) {
        return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F');
}

bool topology_is_pci_address(const char *s, size_t n) {
        /* DDDD:BB:DD.F */
        static const char pattern[] = "hhhh:hh:hh.h";

        if (!s || n != sizeof pattern - 1)
                return false;
        for (size_t i = 0; i < n; i++)
                if (pattern[i] == 'h' ? !is_hex(s[i]) : s[i] != pattern[i])
                        return false;
        return true;
}

/* Splits the next '/'-separated component. */
static bool next_component(const char **p, const char **c, size_t *n) {
        while (**p == '/')
                (*p)++;
        if (!**p)
                return false;
        *c = *p;
        while (**p && **p != '/')
                (*p)++;
        *n = (size_t)(*p - *c);
        return true;
}

/* Finds the "pciDDDD:BB" root component; leaves *p after it. */
static bool find_root(const char **p, const char **root, size_t *root_n) {
        const char *c;
        size_t n;

        while (next_component(p, &c, &n))
                if (n > 3 && strncmp(c, "pci", 3) == 0 && n == 10 && c[7] == ':') {
                        *root = c;
                        *root_n = n;
                        return true;
                }
        return false;
}

int topology_pci_common_depth(const char *a, const char *b) {
        const char *pa = a, *pb = b, *ra, *rb, *ca, *cb;
        size_t na, nb;
        int depth = 0;

        if (!a || !b || !find_root(&pa, &ra, &na) || !find_root(&pb, &rb, &nb))
                return -1;
        if (na != nb || strncmp(ra, rb, na) != 0)
                return -1;
        for (;;) {
                bool ha = next_component(&pa, &ca, &na), hb = next_component(&pb, &cb, &nb);
                if (!ha || !hb || !topology_is_pci_address(ca, na) || !topology_is_pci_address(cb, nb) ||
                    na != nb || strncmp(ca, cb, na) != 0)
                        break;
                /* A shared component that is the device itself on one side does not
                 * count as a bridge above both. */
                const char *la = pa, *lb = pb, *xa, *xb;
                size_t ma, mb;
                bool more_a = next_component(&la, &xa, &ma) && topology_is_pci_address(xa, ma);
                bool more_b = next_component(&lb, &xb, &mb) && topology_is_pci_address(xb, mb);
                if (!more_a || !more_b)
                        break;
                depth++;
        }
        return depth;
}

const char *topology_pci_address(const char *path, char *buf, size_t n) {
        const char *p = path, *c, *last = NULL;
        size_t cn, last_n = 0;

        if (n == 0)
                return buf;
        buf[0] = 0;
        if (!path)
                return buf;
        while (next_component(&p, &c, &cn))
                if (topology_is_pci_address(c, cn)) {
                        last = c;
                        last_n = cn;
                }
        if (last && last_n < n) {
                memcpy(buf, last, last_n);
                buf[last_n] = 0;
        }
        return buf;
}

int topology_pick_nic(const TopoDevice *gpu, const TopoDevice *nics, size_t n, char *reason,
                      size_t reason_len) {
        int best = -1;
        long best_score = -1;
        int best_depth = -1;

        for (size_t i = 0; i < n; i++) {
                int depth = topology_pci_common_depth(gpu->path, nics[i].path);
                bool numa = gpu->numa_node >= 0 && gpu->numa_node == nics[i].numa_node;
                /* depth dominates, then NUMA, then RDMA. */
                long score = (long)(depth + 1) * 4 + (numa ? 2 : 0) + (nics[i].rdma ? 1 : 0);
                if (score > best_score) {
                        best = (int)i;
                        best_score = score;
                        best_depth = depth;
                }
        }
        if (best < 0)
                return -ENOENT;
        if (reason && reason_len > 0) {
                const TopoDevice *nic = nics + best;
                char bdf[32];
                if (best_depth >= 1)
                        snprintf(reason, reason_len, "%s shares a PCIe switch/root port with GPU %s (%d common level%s)",
                                 nic->name, gpu->name, best_depth, best_depth == 1 ? "" : "s");
                else if (best_depth == 0)
                        snprintf(reason, reason_len, "%s is on the same PCIe root complex as GPU %s", nic->name,
                                 gpu->name);
                else if (gpu->numa_node >= 0 && gpu->numa_node == nic->numa_node)
                        snprintf(reason, reason_len, "%s is on GPU %s's NUMA node %d", nic->name, gpu->name,
                                 gpu->numa_node);
                else
                        snprintf(reason, reason_len, "no NIC near GPU %s; %s (%s) is the best available",
                                 gpu->name, nic->name,
                                 topology_pci_address(nic->path, bdf, sizeof bdf)[0] ? bdf : "virtual");
        }
        return best;
}
