/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "peer/topology-pci.h"
#include "../check-main.h"

#define ROOT "/sys/devices/pci0000:00"
/* A switch below root port 00:01.0 with a GPU and a NIC on two of its ports. */
#define SW ROOT "/0000:00:01.0/0000:01:00.0"
#define GPU0 SW "/0000:02:00.0/0000:03:00.0"
#define NIC_SW SW "/0000:02:01.0/0000:04:00.0"
/* Another root port, same root complex. */
#define NIC_RC ROOT "/0000:00:02.0/0000:05:00.0"
/* Another root complex. */
#define NIC_OTHER "/sys/devices/pci0000:80/0000:80:01.0/0000:81:00.0"

START_TEST(test_pci_address) {
        ck_assert(topology_is_pci_address("0000:00:01.0", 12));
        ck_assert(topology_is_pci_address("abcd:ef:1f.7", 12));
        ck_assert(!topology_is_pci_address("0000:00:01.0", 11));
        ck_assert(!topology_is_pci_address("0000-00:01.0", 12));
        ck_assert(!topology_is_pci_address("0000:0g:01.0", 12));
        ck_assert(!topology_is_pci_address("virtio2", 7));
        ck_assert(!topology_is_pci_address(NULL, 12));
}
END_TEST

START_TEST(test_common_depth) {
        ck_assert_int_eq(topology_pci_common_depth(GPU0, NIC_SW), 2);
        ck_assert_int_eq(topology_pci_common_depth(GPU0, NIC_RC), 0);
        ck_assert_int_eq(topology_pci_common_depth(GPU0, NIC_OTHER), -1);
        /* Symmetric. */
        ck_assert_int_eq(topology_pci_common_depth(NIC_SW, GPU0), 2);
        /* A device and a function below it: the device itself is no bridge above both. */
        ck_assert_int_eq(topology_pci_common_depth(SW, GPU0), 1);
        ck_assert_int_eq(topology_pci_common_depth(GPU0, GPU0), 3);
        /* Non-PCI components after the device (virtio, net) do not count. */
        ck_assert_int_eq(topology_pci_common_depth(ROOT "/0000:00:03.0/virtio2/net/eth0",
                                                   ROOT "/0000:00:03.0/virtio3"), 0);
        ck_assert_int_eq(topology_pci_common_depth("/sys/devices/virtual/net/veth0", GPU0), -1);
        ck_assert_int_eq(topology_pci_common_depth("", GPU0), -1);
        ck_assert_int_eq(topology_pci_common_depth(NULL, GPU0), -1);
        ck_assert_int_eq(topology_pci_common_depth("/sys/devices/pciXXXX", "/sys/devices/pciXXXX"), -1);
}
END_TEST

START_TEST(test_address_of_path) {
        char b[32];
        ck_assert_str_eq(topology_pci_address(GPU0, b, sizeof b), "0000:03:00.0");
        ck_assert_str_eq(topology_pci_address(ROOT "/0000:00:03.0/virtio2", b, sizeof b), "0000:00:03.0");
        ck_assert_str_eq(topology_pci_address("/sys/devices/virtual/net/lo", b, sizeof b), "");
        ck_assert_str_eq(topology_pci_address(NULL, b, sizeof b), "");
        ck_assert_str_eq(topology_pci_address(GPU0, b, 5), ""); /* too small: nothing */
}
END_TEST

static TopoDevice dev(const char *name, const char *path, int numa, bool rdma) {
        TopoDevice d = { .numa_node = numa, .rdma = rdma };
        strncpy(d.name, name, sizeof d.name - 1);
        strncpy(d.path, path, sizeof d.path - 1);
        return d;
}

START_TEST(test_pick_nic) {
        TopoDevice gpu = dev("0000:03:00.0", GPU0, 0, false);
        TopoDevice nics[4];
        char reason[256];
        int k;

        /* The one behind the same switch wins over a closer NUMA match and over RDMA. */
        nics[0] = dev("eth-other", NIC_OTHER, 0, true);
        nics[1] = dev("eth-rc", NIC_RC, 0, true);
        nics[2] = dev("eth-sw", NIC_SW, 0, false);
        k = topology_pick_nic(&gpu, nics, 3, reason, sizeof reason);
        ck_assert_int_eq(k, 2);
        ck_assert_ptr_nonnull(strstr(reason, "PCIe switch"));

        /* Without it: the same root complex. */
        k = topology_pick_nic(&gpu, nics, 2, reason, sizeof reason);
        ck_assert_int_eq(k, 1);
        ck_assert_ptr_nonnull(strstr(reason, "root complex"));

        /* Only other root complexes: the NUMA node decides, then RDMA. */
        nics[0] = dev("far-node1", NIC_OTHER, 1, true);
        nics[1] = dev("far-node0", "/sys/devices/pci0000:40/0000:40:01.0", 0, false);
        k = topology_pick_nic(&gpu, nics, 2, reason, sizeof reason);
        ck_assert_int_eq(k, 1);
        ck_assert_ptr_nonnull(strstr(reason, "NUMA node 0"));
        nics[1].numa_node = 1;
        k = topology_pick_nic(&gpu, nics, 2, reason, sizeof reason);
        ck_assert_int_eq(k, 0); /* RDMA breaks the tie */
        ck_assert_ptr_nonnull(strstr(reason, "no NIC near"));

        ck_assert_int_eq(topology_pick_nic(&gpu, nics, 0, reason, sizeof reason), -ENOENT);
        /* No reason buffer is fine. */
        ck_assert_int_eq(topology_pick_nic(&gpu, nics, 2, NULL, 0), 0);
}
END_TEST

int main(void) {
        Suite *s = suite_create("topology");
        TCase *tc = tcase_create("pci");
        tcase_add_test(tc, test_pci_address);
        tcase_add_test(tc, test_common_depth);
        tcase_add_test(tc, test_address_of_path);
        tcase_add_test(tc, test_pick_nic);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
