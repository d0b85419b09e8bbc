/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "config.h"
#include "rdma-select.h"

START_TEST(test_defaults) {
        Config c;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_uint_eq(c.n_arenas, 2);
        ck_assert_str_eq(c.arenas[0].name, "host0");
        ck_assert_int_eq(c.arenas[0].usage, ARENA_USAGE_KV);
        ck_assert_int_eq(c.arenas[1].usage, ARENA_USAGE_FEATURE);
        ck_assert_str_eq(c.socket_path, "/run/epd/bus");
        ck_assert(c.system_bus);
        ck_assert_int_eq(c.gpu_copy_kernel, 1); /* small */
        config_done(&c);
}
END_TEST

START_TEST(test_good) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_string(&c,
                                             "# comment\n; another\n"
                                             "[Daemon]\nHostId = node-1\nSocket=/tmp/x/bus\nSystemBus=no\nLogLevel=debug\n"
                                             "[Limits]\nMaxWorkers=8\nMaxRequestSize=16M\n"
                                             "[Arena:kv0]\nSize=1G\nHugePages=try\nNumaNode=0\n"
                                             "[Arena:feat]\nUsage=feature\nSize=128M\nPageSize=64K\n"
                                             "[Arena:gpu0]\nDomain=gpu\nGpu=0\nSize=4G\n"
                                             "[Cluster]\nListen=0.0.0.0:7100\nClusterKeyFile=/etc/epd/key\nHeartbeatInterval=500ms\nTransport=rdma\n"
                                             "[Peer:b]\nAddress=10.0.0.2:7100\nHostId=node-2\n"
                                             "[Features]\nCacheSize=2G\n"
                                             "[Gpu]\nCopyKernel=never\n",
                                             "good.conf", &errors),
                         0);
        ck_assert_ptr_null(errors);
        ck_assert_str_eq(c.host_id, "node-1");
        ck_assert(!c.system_bus);
        ck_assert_int_eq(c.log_level, 7);
        ck_assert_uint_eq(c.max_workers, 8);
        ck_assert_uint_eq(c.max_request_bytes, 16ULL << 20);
        /* Arenas in the file replace the embedded ones. */
        ck_assert_uint_eq(c.n_arenas, 3);
        ck_assert_str_eq(c.arenas[0].name, "kv0");
        ck_assert_uint_eq(c.arenas[0].size, 1ULL << 30);
        ck_assert_int_eq(c.arenas[0].hugepages, HUGEPAGES_TRY);
        ck_assert_int_eq(c.arenas[1].usage, ARENA_USAGE_FEATURE);
        ck_assert_uint_eq(c.arenas[1].page_size, 64 << 10);
        ck_assert_int_eq(c.arenas[2].domain, MEMORY_GPU);
        ck_assert_int_eq(c.arenas[2].gpu, 0);
        ck_assert_uint_eq(c.heartbeat_usec, 500000);
        ck_assert_int_eq(c.transport_policy, TRANSPORT_POLICY_RDMA);
        ck_assert_uint_eq(c.n_peers, 1);
        ck_assert_str_eq(c.peers[0].host_id, "node-2");
        ck_assert_uint_eq(c.feature_cache_bytes, 2ULL << 30);
        ck_assert_int_eq(c.gpu_copy_kernel, 0); /* never; the default is small (1) */
        config_done(&c);
}
END_TEST

/* Every bad input is named in the error, with its line. */
static const struct {
        const char *text;
        const char *error;
} bad[] = {
        { "[Nonsense]\n", "unknown section [Nonsense]" },
        { "[Daemon]\nColour=blue\n", "unknown key Colour= in section [Daemon]" },
        { "Socket=/x\n", "Socket= outside of a known section" },
        { "[Daemon]\njust words\n", "expected KEY=VALUE" },
        { "[Daemon\n", "malformed section header" },
        { "[Daemon]\nSystemBus=perhaps\n", "SystemBus=perhaps: expected a boolean" },
        { "[Cluster]\nTransport=infiniband\n", "Transport=infiniband: expected auto, tcp or rdma" },
        { "[Daemon]\nLogLevel=loud\n", "LogLevel=loud: expected one of" },
        { "[Daemon]\nSocket=relative/bus\n", "Socket=relative/bus: expected an absolute path" },
        { "[Daemon]\nHostId=has space\n", "HostId=has space: only letters" },
        { "[Limits]\nMaxWorkers=0\n", "MaxWorkers=0: expected a number from 1 to 1000000" },
        { "[Limits]\nMaxWorkers=-3\n", "MaxWorkers=-3: expected a number" },
        { "[Limits]\nMaxRequestSize=12 parsecs\n", "MaxRequestSize=12 parsecs: expected a size" },
        { "[Limits]\nMaxRequestSize=99999999999T\n", "(value too large)" },
        { "[Arena]\nSize=1G\n", "[Arena:NAME] needs a NAME" },
        { "[Arena:a/b]\nSize=1G\n", "[Arena:NAME] needs a NAME" },
        { "[Daemon:x]\n", "section [Daemon] takes no name" },
        { "[Arena:a]\n", "[Arena:a] needs Size=" },
        { "[Arena:a]\nSize=1G\n[Arena:a]\nSize=1G\n", "arena 'a' is defined twice" },
        { "[Arena:a]\nSize=1G\nDomain=tape\n", "Domain=tape: expected host or gpu" },
        { "[Arena:a]\nSize=1G\nUsage=everything\n", "Usage=everything: expected kv or feature" },
        { "[Arena:a]\nSize=1G\nHugePages=lots\n", "HugePages=lots: expected yes, no or try" },
        { "[Arena:a]\nSize=1G\nDomain=gpu\n", "[Arena:a] Domain=gpu needs Gpu=N" },
        { "[Arena:a]\nSize=1G\nDomain=gpu\nGpu=0\nHugePages=yes\n", "HugePages= applies to host arenas only" },
        { "[Arena:a]\nSize=1G\nPageSize=3000\n", "PageSize= must be a power of two" },
        { "[Gpu]\nCopyKernel=maybe\n", "CopyKernel=maybe: expected never, small or always" },
        { "[Arena:a]\nSize=1G\nNumaNode=5000\n", "NumaNode=5000: expected a number from 0 to 1023" },
        { "[Cluster]\nListen=nowhere\n", "Listen=nowhere: expected HOST:PORT" },
        { "[Cluster]\nListen=h:70000\n", "Listen=h:70000: expected HOST:PORT" },
        { "[Cluster]\nHeartbeatInterval=0\n", "HeartbeatInterval=0: expected a positive duration" },
        { "[Peer:b]\nAddress=10.0.0.2:7100\n", "[Peer:b] needs Address= and HostId=" },
        { "[Cluster]\nListen=0.0.0.0:1\n[Peer:b]\nAddress=h:1\nHostId=b\n", "ClusterKeyFile= is not set" },
        { "[Peer:b]\nAddress=h:1\nHostId=b\n[Peer:b]\n", "peer 'b' is defined twice" },
};

START_TEST(test_bad) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        int r = config_parse_string(&c, bad[_i].text, "bad.conf", &errors);
        ck_assert_int_eq(r, -EINVAL);
        ck_assert_ptr_nonnull(errors);
        ck_assert_msg(strstr(errors, bad[_i].error), "input %d: expected '%s' in: %s", _i,
                      bad[_i].error, errors);
        ck_assert_msg(strncmp(errors, "bad.conf:", 9) == 0, "no file name: %s", errors);
        /* Nothing of a bad file is applied. */
        ck_assert_uint_eq(c.n_arenas, 2);
        ck_assert_str_eq(c.arenas[0].name, "host0");
        free(errors);
        config_done(&c);
}
END_TEST

START_TEST(test_all_errors_reported) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_string(&c, "[Daemon]\nSystemBus=x\nLogLevel=y\n[Foo]\n", "f", &errors),
                         -EINVAL);
        ck_assert_ptr_nonnull(strstr(errors, "f:2: SystemBus=x"));
        ck_assert_ptr_nonnull(strstr(errors, "f:3: LogLevel=y"));
        ck_assert_ptr_nonnull(strstr(errors, "f:4: unknown section [Foo]"));
        free(errors);
        config_done(&c);
}
END_TEST

START_TEST(test_file) {
        char path[] = "/tmp/epd-config-XXXXXX";
        int fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        const char *text = "[Daemon]\nHostId=from-file\n";
        ck_assert_int_eq(write(fd, text, strlen(text)), (int)strlen(text));
        close(fd);
        Config c;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_file(&c, path, NULL), 0);
        ck_assert_str_eq(c.host_id, "from-file");
        config_done(&c);
        unlink(path);
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_file(&c, "/nonexistent/epd.conf", NULL), -ENOENT);
        config_done(&c);
}
END_TEST

int main(void) {
        Suite *s = suite_create("config");
        TCase *tc = tcase_create("config");
        tcase_add_test(tc, test_defaults);
        tcase_add_test(tc, test_good);
        tcase_add_loop_test(tc, test_bad, 0, (int)(sizeof bad / sizeof bad[0]));
        tcase_add_test(tc, test_all_errors_reported);
        tcase_add_test(tc, test_file);
        suite_add_tcase(s, tc);
        SRunner *sr = srunner_create(s);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
