/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "transport/rdma-select.h"
#include "../check-main.h"

static char root[PATH_MAX];

/* mkdir -p ROOT/class/infiniband/DEV[/ports/PORT/LEAF] */
static void mkdirs(const char *dev, unsigned port, const char *leaf) {
        char cmd[PATH_MAX * 2];
        if (port)
                ck_assert_int_lt(snprintf(cmd, sizeof cmd, "mkdir -p '%s/class/infiniband/%s/ports/%u/%s'", root,
                                          dev, port, leaf),
                                 (int)sizeof cmd);
        else
                ck_assert_int_lt(snprintf(cmd, sizeof cmd, "mkdir -p '%s/class/infiniband/%s'", root, dev),
                                 (int)sizeof cmd);
        ck_assert_int_eq(system(cmd), 0);
}

static void put(const char *dev, unsigned port, const char *leaf, const char *text) {
        char p[PATH_MAX * 2];
        FILE *f;
        ck_assert_int_lt(snprintf(p, sizeof p, "%s/class/infiniband/%s/ports/%u/%s", root, dev, port, leaf),
                         (int)sizeof p);
        f = fopen(p, "we");
        ck_assert_ptr_nonnull(f);
        fputs(text, f);
        fclose(f);
}

static void add_port(const char *dev, unsigned port, const char *state, const char *const *ndevs, int n) {
        mkdirs(dev, port, "gid_attrs/ndevs");
        put(dev, port, "state", state);
        for (int i = 0; i < n; i++) {
                char leaf[64];
                snprintf(leaf, sizeof leaf, "gid_attrs/ndevs/%d", i);
                if (ndevs[i])
                        put(dev, port, leaf, ndevs[i]);
        }
}

static void setup(void) {
        snprintf(root, sizeof root, "/tmp/test-rdma-select.XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(root));
}

static void teardown(void) {
        char cmd[PATH_MAX + 16];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
        (void)system(cmd);
}

START_TEST(test_policy_strings) {
        ck_assert_int_eq(transport_policy_from_string("auto"), TRANSPORT_POLICY_AUTO);
        ck_assert_int_eq(transport_policy_from_string("tcp"), TRANSPORT_POLICY_TCP);
        ck_assert_int_eq(transport_policy_from_string("rdma"), TRANSPORT_POLICY_RDMA);
        ck_assert_int_eq(transport_policy_from_string("RDMA"), -EINVAL);
        ck_assert_int_eq(transport_policy_from_string(""), -EINVAL);
        ck_assert_int_eq(transport_policy_from_string(NULL), -EINVAL);
        ck_assert_str_eq(transport_policy_to_string(TRANSPORT_POLICY_RDMA), "rdma");
        ck_assert_ptr_null(transport_policy_to_string(_TRANSPORT_POLICY_MAX));
}
END_TEST

START_TEST(test_port_state) {
        char st[24];
        ck_assert(rdma_parse_port_state("4: ACTIVE", st, sizeof st));
        ck_assert_str_eq(st, "ACTIVE");
        ck_assert(!rdma_parse_port_state("1: DOWN", st, sizeof st));
        ck_assert_str_eq(st, "DOWN");
        ck_assert(rdma_parse_port_state("ACTIVE", st, sizeof st));
        ck_assert(!rdma_parse_port_state("", st, sizeof st));
        ck_assert(!rdma_parse_port_state(NULL, st, sizeof st));
        ck_assert_str_eq(st, "");
        ck_assert(!rdma_parse_port_state("4: ACTIVE_DEFER", st, sizeof st));
}
END_TEST

START_TEST(test_sysfs_none) {
        RdmaLink l[4];
        /* No class/infiniband at all: no devices, not an error. */
        ck_assert_int_eq(rdma_links_from_sysfs(root, l, 4), 0);
        mkdirs("", 0, NULL);
        ck_assert_int_eq(rdma_links_from_sysfs(root, l, 4), 0);
        ck_assert_int_eq(rdma_links_from_sysfs(NULL, l, 4), -EINVAL);
}
END_TEST

START_TEST(test_sysfs_links) {
        RdmaLink l[8];
        static const char *const rxe0[] = { "veth0\n", "veth0\n", NULL, "veth0\n" };
        static const char *const rxe1[] = { "veth1\n" };
        static const char *const mlx[] = { "\n", "ib0\n", "ib0.8001\n" };
        int n;

        add_port("rxe0", 1, "4: ACTIVE\n", rxe0, 4);
        add_port("rxe1", 1, "1: DOWN\n", rxe1, 1);
        add_port("mlx5_0", 1, "4: ACTIVE\n", mlx, 3);
        /* Not a port number: ignored. */
        mkdirs("mlx5_0/ports/x1", 0, NULL);

        n = rdma_links_from_sysfs(root, l, 8);
        ck_assert_int_eq(n, 4);
        /* Sorted by device, port, netdev; duplicates of a netdev on one port collapse. */
        ck_assert_str_eq(l[0].device, "mlx5_0");
        ck_assert_str_eq(l[0].netdev, "ib0");
        ck_assert_int_eq(l[0].gid_index, 1);
        ck_assert_str_eq(l[1].netdev, "ib0.8001");
        ck_assert_str_eq(l[2].device, "rxe0");
        ck_assert_str_eq(l[2].netdev, "veth0");
        ck_assert_int_eq(l[2].gid_index, 0);
        ck_assert_uint_eq(l[2].port, 1);
        ck_assert(l[2].active);
        ck_assert_str_eq(l[3].device, "rxe1");
        ck_assert(!l[3].active);
        ck_assert_str_eq(l[3].state, "DOWN");

        ck_assert_ptr_eq(rdma_link_for_netdev(l, n, "veth0"), l + 2);
        ck_assert_ptr_eq(rdma_link_for_netdev(l, n, "veth1"), l + 3);
        ck_assert_ptr_null(rdma_link_for_netdev(l, n, "eth0"));
        ck_assert_ptr_null(rdma_link_for_netdev(l, n, ""));
        ck_assert_ptr_null(rdma_link_for_netdev(l, n, NULL));

        /* Too many for the buffer: an error, never an overflow. */
        ck_assert_int_eq(rdma_links_from_sysfs(root, l, 2), -ENOBUFS);
}
END_TEST

START_TEST(test_link_prefers_active) {
        RdmaLink l[2] = {
                { .device = "a", .port = 1, .netdev = "eth0", .active = false },
                { .device = "b", .port = 1, .netdev = "eth0", .active = true },
        };
        ck_assert_ptr_eq(rdma_link_for_netdev(l, 2, "eth0"), l + 1);
        l[1].active = false;
        ck_assert_ptr_eq(rdma_link_for_netdev(l, 2, "eth0"), l);
}
END_TEST

static TransportKind sel(const RdmaSelectInput *in, char *reason, bool *warn) {
        return rdma_select(in, reason, 384, warn);
}

START_TEST(test_select) {
        RdmaLink up = { .device = "rxe0", .port = 1, .netdev = "veth0", .active = true, .state = "ACTIVE" };
        RdmaLink down = { .device = "rxe0", .port = 1, .netdev = "veth0", .active = false, .state = "DOWN" };
        RdmaSelectInput in = {
                .policy = TRANSPORT_POLICY_AUTO, .rdma_built = true, .n_links = 1, .ifname = "veth0",
                .local = &up, .peer_announced = true, .peer_rdma = true, .peer_device = "rxe1",
        };
        char reason[384];
        bool warn = true;

        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_RDMA);
        ck_assert(!warn);
        ck_assert_str_eq(reason, "rdma: rxe0 port 1 on veth0 here, rxe1 on the peer (Transport=auto)");

        in.policy = TRANSPORT_POLICY_TCP;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert(!warn);
        ck_assert_str_eq(reason, "tcp: Transport=tcp in [Cluster]");

        in.policy = TRANSPORT_POLICY_RDMA;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_RDMA);
        ck_assert(!warn);

        /* Each missing condition in turn. */
        in.policy = TRANSPORT_POLICY_AUTO;
        in.n_links = 0;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert(!warn);
        ck_assert_str_eq(reason, "tcp: no RDMA devices on this host");
        in.policy = TRANSPORT_POLICY_RDMA;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert(warn);
        ck_assert_str_eq(reason, "tcp: no RDMA devices on this host (Transport=rdma is forced)");
        in.policy = TRANSPORT_POLICY_AUTO;
        in.n_links = 1;

        in.ifname = "";
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_ptr_nonnull(strstr(reason, "no route"));
        in.ifname = NULL;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        in.ifname = "eth0";
        in.local = NULL;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_str_eq(reason, "tcp: no RDMA device carries eth0");
        in.ifname = "veth0";
        in.local = &down;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_str_eq(reason, "tcp: RDMA device rxe0 port 1 on veth0 is DOWN, not ACTIVE");
        in.local = &up;

        in.failure = "device fatal event";
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_str_eq(reason, "tcp: RDMA via rxe0 port 1 failed: device fatal event");
        /* The device went away with the failure: both stay visible. */
        in.local = NULL;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_str_eq(reason, "tcp: no RDMA device carries veth0; RDMA failed: device fatal event");
        in.local = &up;
        in.failure = NULL;

        in.rdma_built = false;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_ptr_nonnull(strstr(reason, "no RDMA data path"));
        in.rdma_built = true;

        in.peer_announced = false;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_ptr_nonnull(strstr(reason, "waiting for the peer"));
        in.peer_announced = true;
        in.peer_rdma = false;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert_ptr_nonnull(strstr(reason, "the peer has none"));
        in.policy = TRANSPORT_POLICY_RDMA;
        ck_assert_int_eq(sel(&in, reason, &warn), TRANSPORT_TCP);
        ck_assert(warn);
        ck_assert_ptr_nonnull(strstr(reason, "forced"));

        /* A short reason buffer truncates, never overflows. */
        in.peer_rdma = true;
        char small[8];
        ck_assert_int_eq(rdma_select(&in, small, sizeof small, NULL), TRANSPORT_RDMA);
        ck_assert_str_eq(small, "rdma: r");
}
END_TEST

int main(void) {
        Suite *s = suite_create("rdma-select");
        TCase *tc = tcase_create("rdma-select");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_policy_strings);
        tcase_add_test(tc, test_port_state);
        tcase_add_test(tc, test_sysfs_none);
        tcase_add_test(tc, test_sysfs_links);
        tcase_add_test(tc, test_link_prefers_active);
        tcase_add_test(tc, test_select);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
