/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* topology-pci.c (the nearest NIC of a GPU, pure), and topology.c's paths per peer on a
 * PeerManager that is never started (nothing dialed; the kernel is only asked routes). */
#include <check.h>
#include <errno.h>
#include <net/if.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <systemd/sd-event.h>
#include <unistd.h>

#include "peer/peer-manager.h"
#include "peer/topology-pci.h"
#include "peer/topology.h"
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

/* Members that left are never resolved again, however many a daemon saw: a refresh asks
 * the kernel about the live peers alone (before, every peer ever known, on the event
 * loop at every route change), a member that comes back is resolved again, and every
 * path is found by host id, after the path array grew and moved too. */
#define ROUNDS 4       /* 3600 members ever known, in rounds: at most PEER_MEMBERS_MAX at once */
#define PER_ROUND 900
#define LIVE_EVERY 40  /* of each round, these stay (23 per round) */

static void member_id(char *buf, size_t n, unsigned round, unsigned i) {
        snprintf(buf, n, "m%u-%u", round, i);
}

static bool stays(unsigned i) {
        return i % LIVE_EVERY == 0;
}

static void assert_left(Topology *t, const char *id) {
        const TopologyPath *path = topology_path(t, id);
        ck_assert_msg(path, "no path for %s", id);
        ck_assert_str_eq(path->host_id, id);
        ck_assert(path->retired);
        ck_assert_str_eq(path->ifname, "");
        ck_assert(!path->link_up);
        ck_assert_ptr_nonnull(strstr(path->reason, "left the cluster membership"));
}

static bool loopback_up(void) {
        struct ifreq ifr = { .ifr_name = "lo" };
        int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        bool up = fd >= 0 && ioctl(fd, SIOCGIFFLAGS, &ifr) == 0 && (ifr.ifr_flags & IFF_UP);
        if (fd >= 0)
                close(fd);
        return up;
}

static void assert_resolved(Topology *t, const char *id) {
        const TopologyPath *path = topology_path(t, id);
        ck_assert_msg(path, "no path for %s", id);
        ck_assert_str_eq(path->host_id, id);
        ck_assert_msg(!path->retired, "%s: %s", id, path->reason);
        ck_assert(path->reason[0]);
        ck_assert_ptr_null(strstr(path->reason, "left the cluster membership"));
}

START_TEST(test_retired_members_not_resolved) {
        sd_event *e;
        PeerManager *pm;
        Topology *t;
        char id[64];
        size_t live = 0;
        int r;

        ck_assert_int_ge(sd_event_new(&e), 0);
        PeerManagerConfig c = { .host_id = "self" };
        ck_assert_int_eq(peer_manager_new(&pm, e, &c), 0);
        r = topology_new(&t, e, pm);
        if (r == -EOPNOTSUPP) {
                /* Built without libnl: topology-nolibnl.c has no paths at all. */
                ck_assert_ptr_null(topology_path(NULL, "x"));
                ck_assert_uint_eq(topology_paths_resolved(NULL), 0);
                peer_manager_free(pm);
                sd_event_unref(e);
                return;
        }
        ck_assert_int_eq(r, 0);
        ck_assert_uint_eq(topology_paths_resolved(t), 0); /* no peer yet */

        /* ROUNDS x PER_ROUND members join; all but every LIVE_EVERY-th leave again. */
        for (unsigned k = 0; k < ROUNDS; k++) {
                for (unsigned i = 0; i < PER_ROUND; i++) {
                        member_id(id, sizeof id, k, i);
                        ck_assert_int_eq(peer_manager_add_member(pm, id, "127.0.0.1:9", NULL), 0);
                }
                for (unsigned i = 0; i < PER_ROUND; i++) {
                        member_id(id, sizeof id, k, i);
                        if (stays(i))
                                live++;
                        else
                                ck_assert_int_eq(peer_manager_retire_member(pm, id), 0);
                }
                if (k == 0) {
                        /* A refresh halfway: the array grows (and moves) afterwards. */
                        ck_assert_int_eq(topology_refresh(t), 0);
                        ck_assert_uint_eq(topology_paths_resolved(t), live);
                }
        }
        ck_assert_uint_eq(peer_manager_n_peers(pm), ROUNDS * PER_ROUND);
        ck_assert_int_eq(topology_refresh(t), 0);
        ck_assert_uint_eq(topology_paths_resolved(t), live);
        for (unsigned k = 0; k < ROUNDS; k++)
                for (unsigned i = 0; i < PER_ROUND; i++) {
                        member_id(id, sizeof id, k, i);
                        if (stays(i))
                                assert_resolved(t, id);
                        else
                                assert_left(t, id);
                }
        ck_assert_ptr_null(topology_path(t, "never-seen"));
        ck_assert_ptr_null(topology_path(t, "self"));

        /* One comes back: resolved again at the next refresh, the one the cluster asks
         * for when a member joins (topology_refresh_soon(): a timer on the loop). */
        member_id(id, sizeof id, 1, 7);
        ck_assert_int_eq(peer_manager_add_member(pm, id, "127.0.0.1:9", NULL), 0);
        topology_refresh_soon(t);
        for (int i = 0; i < 200 && topology_path(t, id)->retired; i++)
                ck_assert_int_ge(sd_event_run(e, 10 * USEC_PER_MSEC), 0);
        assert_resolved(t, id);
        /* Through lo, where it is up (not so in a bare network namespace: then no route). */
        ck_assert_msg(strstr(topology_path(t, id)->reason, loopback_up() ? "loopback" : "no route to"), "%s",
                      topology_path(t, id)->reason);
        ck_assert_uint_eq(topology_paths_resolved(t), live + 1);

        /* A live one leaves: its path says so from the next refresh on, unresolved. */
        member_id(id, sizeof id, 2, 40);
        ck_assert_int_eq(peer_manager_retire_member(pm, id), 0);
        ck_assert_int_eq(topology_refresh(t), 0);
        assert_left(t, id);
        ck_assert_uint_eq(topology_paths_resolved(t), live);

        /* Changes that keep coming every 5 ms (each asks for a refresh 20 ms on) do not
         * hold the refresh off for as long as they come: it runs within 200 ms of the
         * first. It never ran in the 1 s of such changes before. */
        ck_assert_int_eq(peer_manager_add_member(pm, id, "127.0.0.1:9", NULL), 0);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        while (topology_path(t, id)->retired && now_usec(CLOCK_MONOTONIC) - t0 < USEC_PER_SEC) {
                topology_refresh_soon(t);
                ck_assert_int_ge(sd_event_run(e, 5 * USEC_PER_MSEC), 0);
        }
        assert_resolved(t, id);
        ck_assert_uint_lt(now_usec(CLOCK_MONOTONIC) - t0, 600 * USEC_PER_MSEC);

        topology_free(t);
        peer_manager_free(pm);
        sd_event_unref(e);
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
        tc = tcase_create("paths");
        tcase_add_test(tc, test_retired_members_not_resolved);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
