/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Pure helpers of the topology: how close two PCI devices are, judged from their sysfs
 * paths (/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0/...) and NUMA nodes, and
 * which NIC to use for a GPU. topology.c feeds them what it reads from sysfs. */

#include <stdbool.h>
#include <stddef.h>

#define TOPO_NAME_MAX 64
#define TOPO_PATH_MAX 512

typedef struct TopoDevice {
        char name[TOPO_NAME_MAX];  /* interface name, or the GPU's PCI address */
        char path[TOPO_PATH_MAX];  /* resolved sysfs device path; "" if virtual */
        int numa_node;             /* -1: unknown */
        bool rdma;                 /* a NIC with an RDMA device on it */
        char rdma_name[TOPO_NAME_MAX];
} TopoDevice;

/* True for "DDDD:BB:DD.F" (a PCI function address). */
bool topology_is_pci_address(const char *s, size_t n);

/* How many PCI functions (bridges, switch ports) two device paths share below their
 * root bus: >= 1 means they sit under the same root port or switch; 0 means the same
 * root complex only; -1 different root complexes, or a path that is not PCI. */
int topology_pci_common_depth(const char *a, const char *b);

/* Last PCI address of a path into buf ("" if none). */
const char *topology_pci_address(const char *path, char *buf, size_t n);

/* Picks the NIC nearest the GPU: deepest shared PCIe path, then same NUMA node, then an
 * RDMA-capable one, then the first. Returns its index and writes why into reason, or
 * -ENOENT when there is no NIC. */
int topology_pick_nic(const TopoDevice *gpu, const TopoDevice *nics, size_t n, char *reason,
                      size_t reason_len);
