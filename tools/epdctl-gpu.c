/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdctl gpus: the daemon's GPUs (PCI bus ids, VMM/fd/GPUDirect support) and the peer
 * access matrix, from org.epd1.Gpu. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "epd-internal.h"
#include "epdctl.h"
#include "macro.h"

typedef struct GpuRow {
        uint32_t ordinal;
        char *pci, *name;
        int vmm, fd, gdr;
        uint64_t mem;
} GpuRow;

int verb_gpus(epd_client *c, int argc, char **argv) {
        _cleanup_(sd_bus_message_unrefp) sd_bus_message *status = NULL, *gpus = NULL, *peers = NULL, *copies = NULL;
        const char *copy_name[64];
        uint64_t copy_value[64];
        size_t n_copies = 0;
        bool copies_cut = false;
        const char *st, *pci, *name;
        GpuRow rows[64];
        bool peer[64][64] = {};
        size_t n = 0;
        uint32_t a, b;
        int r;

        r = epdctl_get_property(c, "/org/epd1", "org.epd1.Gpu", "Status", "s", &status);
        if (r >= 0)
                r = epdctl_get_property(c, "/org/epd1", "org.epd1.Gpu", "Gpus", "a(ussbbbt)", &gpus);
        if (r >= 0)
                r = epdctl_get_property(c, "/org/epd1", "org.epd1.Gpu", "PeerAccess", "a(uu)", &peers);
        if (r < 0)
                return epdctl_fail(c, r, "gpus");
        /* Optional: a daemon before it has none (no counters shown then). */
        if (epdctl_get_property(c, "/org/epd1", "org.epd1.Gpu", "CopyCounters", "a{st}", &copies) < 0)
                copies = sd_bus_message_unref(copies);
        r = sd_bus_message_read(status, "s", &st);
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(gpus, 'a', "(ussbbbt)");
        while (r >= 0 && n < ELEMENTSOF(rows) &&
               (r = sd_bus_message_read(gpus, "(ussbbbt)", &rows[n].ordinal, &pci, &name, &rows[n].vmm,
                                        &rows[n].fd, &rows[n].gdr, &rows[n].mem)) > 0) {
                rows[n].pci = (char *)pci;
                rows[n].name = (char *)name;
                n++;
        }
        if (r < 0)
                return r;
        r = sd_bus_message_enter_container(peers, 'a', "(uu)");
        while (r >= 0 && (r = sd_bus_message_read(peers, "(uu)", &a, &b)) > 0)
                if (a < 64 && b < 64)
                        peer[a][b] = true;
        if (r < 0)
                return r;

        r = copies ? sd_bus_message_enter_container(copies, 'a', "{st}") : 0;
        const char *cn;
        uint64_t cv;
        while (copies && r >= 0 && (r = sd_bus_message_read(copies, "{st}", &cn, &cv)) > 0) {
                if (n_copies == ELEMENTSOF(copy_name)) {
                        copies_cut = true;
                        continue;
                }
                copy_name[n_copies] = cn;
                copy_value[n_copies++] = cv;
        }
        if (r < 0)
                return r;

        if (arg_json) {
                printf("{\"status\":");
                json_string(stdout, st);
                printf(",\"gpus\":[");
                for (size_t i = 0; i < n; i++) {
                        printf("%s{\"gpu\":%" PRIu32 ",\"pci_bus_id\":", i ? "," : "", rows[i].ordinal);
                        json_string(stdout, rows[i].pci);
                        printf(",\"name\":");
                        json_string(stdout, rows[i].name);
                        printf(",\"memory\":%" PRIu64 ",\"vmm\":%s,\"fd_export\":%s,\"gpudirect_rdma\":%s,\"peers\":[",
                               rows[i].mem, rows[i].vmm ? "true" : "false", rows[i].fd ? "true" : "false",
                               rows[i].gdr ? "true" : "false");
                        bool first = true;
                        for (size_t j = 0; j < n; j++)
                                if (rows[i].ordinal < 64 && rows[j].ordinal < 64 &&
                                    peer[rows[i].ordinal][rows[j].ordinal]) {
                                        printf("%s%" PRIu32, first ? "" : ",", rows[j].ordinal);
                                        first = false;
                                }
                        printf("]}");
                }
                printf("],\"copies\":{");
                for (size_t i = 0; i < n_copies; i++) {
                        printf("%s", i ? "," : "");
                        json_string(stdout, copy_name[i]);
                        printf(":%" PRIu64, copy_value[i]);
                }
                printf("}}\n");
                return 0;
        }

        printf("GPU domain: %s\n", st);
        if (n == 0)
                return 0;
        printf("%-4s %-14s %10s %-4s %-4s %-4s %s\n", "GPU", "PCI", "MEMORY", "VMM", "FD", "GDR", "NAME");
        for (size_t i = 0; i < n; i++)
                printf("%-4" PRIu32 " %-14s %6.1f GiB %-4s %-4s %-4s %s\n", rows[i].ordinal, rows[i].pci,
                       (double)rows[i].mem / (1ULL << 30), rows[i].vmm ? "yes" : "no",
                       rows[i].fd ? "yes" : "no", rows[i].gdr ? "yes" : "no", rows[i].name);
        if (n > 1) {
                printf("peer access (row reads/writes column):\n    ");
                for (size_t j = 0; j < n; j++)
                        printf(" %3" PRIu32, rows[j].ordinal);
                printf("\n");
                for (size_t i = 0; i < n; i++) {
                        printf("%3" PRIu32 " ", rows[i].ordinal);
                        for (size_t j = 0; j < n; j++)
                                printf(" %3s", i == j ? "-" :
                                       rows[i].ordinal < 64 && rows[j].ordinal < 64 &&
                                       peer[rows[i].ordinal][rows[j].ordinal] ? "yes" : "no");
                        printf("\n");
                }
        }
        if (n_copies > 0) {
                printf("copies:");
                for (size_t i = 0; i < n_copies; i++)
                        printf("%s %s %" PRIu64, i ? "," : "", copy_name[i], copy_value[i]);
                printf("%s\n", copies_cut ? " (more not shown)" : "");
        }
        return 0;
}
