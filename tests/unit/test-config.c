/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/config.h"
#include "sched/pool-select.h"
#include "transport/rdma-select.h"
#include "../check-main.h"

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
        ck_assert_uint_eq(c.gpu_merge_groups, 8);
        ck_assert_uint_eq(c.gpu_batches_in_flight, 2);
        ck_assert_uint_eq(c.gpu_completion_spin_usec, 200);
        ck_assert(!c.gpu_strided_copies);
        config_done(&c);
}
END_TEST

START_TEST(test_good) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_string(&c,
                                             "# comment\n; another\n"
                                             "[Daemon]\nHostId = node-1\nSocket=/tmp/x/bus\nSocketGroup=_epd-work.1\nSystemBus=no\nLogLevel=debug\n"
                                             "[Limits]\nMaxWorkers=8\nMaxRequestSize=16M\nAttachGrace=90s\n"
                                             "[Arena:kv0]\nSize=1G\nHugePages=try\nNumaNode=0\nPrefault=yes\n"
                                             "[Arena:feat]\nUsage=feature\nSize=128M\nPageSize=64K\n"
                                             "[Arena:gpu0]\nDomain=gpu\nGpu=0\nSize=4G\n"
                                             "[Cluster]\nListen=0.0.0.0:7100\nClusterKeyFile=/etc/epd/key\nHeartbeatInterval=500ms\nTransport=rdma\n"
                                             "[Peer:b]\nAddress=10.0.0.2:7100\nHostId=node-2\n"
                                             "[Peer:c]\nAddress=[fd00::3]:7100\nHostId=node-3\n"
                                             "[Features]\nCacheSize=2G\n"
                                             "[Gpu]\nCopyKernel=never\nMergeGroups=8\nBatchesInFlight=6\nCompletionSpin=50us\nStridedCopies=yes\n",
                                             "good.conf", &errors),
                         0);
        ck_assert_ptr_null(errors);
        ck_assert_str_eq(c.host_id, "node-1");
        ck_assert_uint_eq(c.gpu_merge_groups, 8);
        ck_assert_uint_eq(c.gpu_batches_in_flight, 6);
        ck_assert_uint_eq(c.gpu_completion_spin_usec, 50);
        ck_assert(c.gpu_strided_copies);
        ck_assert_str_eq(c.socket_group, "_epd-work.1");
        ck_assert_uint_eq(c.attach_grace_usec, 90 * USEC_PER_SEC);
        ck_assert(!c.system_bus);
        ck_assert_int_eq(c.log_level, 7);
        ck_assert_uint_eq(c.max_workers, 8);
        ck_assert_uint_eq(c.max_request_bytes, 16ULL << 20);
        /* Arenas in the file replace the embedded ones. */
        ck_assert_uint_eq(c.n_arenas, 3);
        ck_assert_str_eq(c.arenas[0].name, "kv0");
        ck_assert_uint_eq(c.arenas[0].size, 1ULL << 30);
        ck_assert_int_eq(c.arenas[0].hugepages, HUGEPAGES_TRY);
        ck_assert(c.arenas[0].prefault);
        ck_assert(!c.arenas[1].prefault);
        ck_assert_int_eq(c.arenas[1].usage, ARENA_USAGE_FEATURE);
        ck_assert_uint_eq(c.arenas[1].page_size, 64 << 10);
        ck_assert_int_eq(c.arenas[2].domain, MEMORY_GPU);
        ck_assert_int_eq(c.arenas[2].gpu, 0);
        ck_assert_uint_eq(c.heartbeat_usec, 500000);
        ck_assert_int_eq(c.transport_policy, TRANSPORT_POLICY_RDMA);
        ck_assert_uint_eq(c.n_peers, 2);
        ck_assert_str_eq(c.peers[0].host_id, "node-2");
        ck_assert_uint_eq(c.feature_cache_bytes, 2ULL << 30);
        ck_assert_uint_eq(c.feature_read_back_timeout_usec, 20 * USEC_PER_SEC);
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
        /* 100 bytes: bound as <path>.<pid> (up to 8 more) it would not fit sun_path's 108. */
        { "[Daemon]\nSocket=/run/xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n",
          "a unix socket path must be shorter than 100 bytes" },
        { "[Daemon]\nHostId=has space\n", "HostId=has space: only letters" },
        { "[Limits]\nMaxWorkers=0\n", "MaxWorkers=0: expected a number from 1 to 1000000" },
        { "[Limits]\nMaxWorkers=-3\n", "MaxWorkers=-3: expected a number" },
        { "[Limits]\nMaxRequestSize=12 parsecs\n", "MaxRequestSize=12 parsecs: expected a size" },
        { "[Limits]\nMaxRequestSize=99999999999T\n", "(value too large)" },
        { "[Limits]\nAttachGrace=0\n", "AttachGrace=0: expected a positive duration" },
        { "[Limits]\nAttachGrace=100ms\n", "AttachGrace= must be at least 1s" },
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
        { "[Arena:a]\nSize=1G\nDomain=gpu\nGpu=0\nNumaNode=3\n", "NumaNode= applies to host arenas only" },
        { "[Arena:a]\nSize=1G\nPrefault=always\n", "Prefault=always: expected a boolean" },
        { "[Arena:a]\nSize=1G\nDomain=gpu\nGpu=0\nPrefault=yes\n", "Prefault= applies to host arenas only" },
        { "[Arena:a]\nSize=1G\nGpu=0\n", "Gpu= applies to GPU arenas only" },
        { "[Arena:a]\nSize=1G\nPageSize=3000\n", "PageSize= must be a power of two" },
        { "[Gpu]\nCopyKernel=maybe\n", "CopyKernel=maybe: expected never, small or always" },
        { "[Gpu]\nMergeGroups=17\n", "[Gpu] MergeGroups=17: expected 1 to 16" },
        { "[Gpu]\nMergeGroups=0\n", "MergeGroups=0: expected a number from 1 to 1000000" },
        { "[Gpu]\nBatchesInFlight=17\n", "[Gpu] BatchesInFlight=17: expected 1 to 16" },
        { "[Gpu]\nBatchesInFlight=0\n", "BatchesInFlight=0: expected a number from 1 to 1000000" },
        { "[Gpu]\nCompletionSpin=11ms\n", "[Gpu] CompletionSpin=: at most 10ms" },
        { "[Arena:a]\nSize=1G\nNumaNode=5000\n", "NumaNode=5000: expected a number from 0 to 1023" },
        { "[Cluster]\nListen=nowhere\n", "Listen=nowhere: expected a numeric IPv4 address and a port" },
        { "[Cluster]\nListen=10.0.0.1:70000\n", "Listen=10.0.0.1:70000: expected a numeric IPv4 address" },
        /* Host names: the peer layer never resolves them (peer_address_parse()). */
        { "[Cluster]\nListen=localhost:7199\n", "Listen=localhost:7199: expected a numeric IPv4 address and a port "
                                               "(10.0.0.1:7199) or [IPV6]:PORT, port 1 to 65535; host names are not resolved" },
        { "[Peer:b]\nAddress=db.example:7100\nHostId=b\n", "Address=db.example:7100: expected a numeric IPv4" },
        { "[Peer:b]\nAddress=fd00::1:7100\nHostId=b\n", "Address=fd00::1:7100: expected a numeric IPv4" },
        { "[Daemon]\nSocketGroup=9users\n", "SocketGroup=9users: expected a group name" },
        { "[Daemon]\nSocketGroup=a b\n", "SocketGroup=a b: expected a group name" },
        { "[Cluster]\nHeartbeatInterval=0\n", "HeartbeatInterval=0: expected a positive duration" },
        { "[Peer:b]\nAddress=10.0.0.2:7100\n", "[Peer:b] needs Address= and HostId=" },
        { "[Cluster]\nListen=0.0.0.0:1\n[Peer:b]\nAddress=h:1\nHostId=b\n", "ClusterKeyFile= is not set" },
        { "[Peer:b]\nAddress=h:1\nHostId=b\n[Peer:b]\n", "peer 'b' is defined twice" },
        { "[Pool:batch]\nPriority=1\n", "[Pool:batch]: expected a pool named thinking, interactive or hybrid" },
        { "[Pool]\nPriority=1\n", "[Pool:NAME] needs a NAME" },
        { "[Pool:hybrid]\n[Pool:hybrid]\n", "pool 'hybrid' is defined twice" },
        { "[Pool:hybrid]\nPriority=high\n", "Priority=high: expected an integer from -1000 to 1000" },
        { "[Pool:hybrid]\nPriority=5000\n", "Priority=5000: expected an integer" },
        { "[Pool:hybrid]\nDefaultDeadline=0\n", "DefaultDeadline=0: expected a positive duration" },
        { "[Pool:hybrid]\nQueueMax=0\n", "QueueMax=0: expected a number from 1 to 1000000" },
        { "[Pool:hybrid]\nHighWatermark=many\n", "HighWatermark=many: expected a number from 0" },
        { "[Pool:hybrid]\nQueueMax=10\nHighWatermark=20\n", "[Pool:hybrid] HighWatermark=20: expected 1 to QueueMax=10" },
        { "[Pool:thinking]\nHighWatermark=8\nLowWatermark=8\n", "[Pool:thinking] LowWatermark=8: expected below HighWatermark=8" },
        { "[Pool:thinking]\nWorkerShare=1.5\n", "WorkerShare=1.5: expected a fraction" },
        { "[Pool:thinking]\nWorkerShare=0\n", "WorkerShare=0: expected a fraction" },
        { "[Pool:thinking]\nRejectRho=0.5\n", "RejectRho=0.5: expected 0" },
        { "[Pool:thinking]\nDecodeEstimate=soon\n", "DecodeEstimate=soon: expected a positive duration" },
        { "[Pool:thinking]\nDecodeWorkers=gpu0\n", "DecodeWorkers=: selector 'gpu0': expected *, name:GLOB" },
        { "[Pool:thinking]\nPrefillWorkers=role:trainer\n", "PrefillWorkers=: selector 'role:trainer': role: expects" },
        { "[Pool:thinking]\nEncodeWorkers=colour:red\n", "EncodeWorkers=: selector 'colour:red': unknown selector kind" },
        { "[Pool:thinking]\nPreemption=yes\n", "unknown key Preemption= in section [Pool]" },
        { "[Cluster]\nEtcd=127.0.0.1:2379\n", "Etcd=127.0.0.1:2379: expected up to 16 URLs http://HOST:PORT" },
        { "[Cluster]\nEtcd=http://e:2379/v3\n", "Etcd=http://e:2379/v3: expected" },
        { "[Cluster]\nEtcd=http://u@e:2379\n", "Etcd=http://u@e:2379: expected" },
        { "[Cluster]\nEtcd=http://e:0\n", "Etcd=http://e:0: expected" },
        { "[Cluster]\nEtcd=http://e:2379\n", "Etcd= needs Listen=" },
        { "[Cluster]\nEtcdLeaseTTL=1s\n", "EtcdLeaseTTL= must be whole seconds from 2s to 300s" },
        { "[Cluster]\nEtcdLeaseTTL=2500ms\n", "EtcdLeaseTTL= must be whole seconds" },
        { "[Cluster]\nEtcdPrefix=epd\n", "EtcdPrefix=epd: expected a key prefix like /epd/" },
        { "[Cluster]\nEtcdPrefix=/e p/\n", "EtcdPrefix=/e p/: only printable characters" },
        { "[Cluster]\nEtcdCertFile=/c.pem\n", "EtcdCertFile= and EtcdKeyFile= go together" },
        { "[Cluster]\nMaxMembers=0\n", "MaxMembers=0: expected a number" },
        { "[Cluster]\nMaxMembers=5000\n", "MaxMembers=5000: expected 1 to 1023" },
        { "[Cluster]\nDirectoryCacheTime=2min\n", "DirectoryCacheTime= must be at most 60s" },
        { "[Cluster]\nDirectoryCacheTime=soon\n", "DirectoryCacheTime=soon: expected a duration" },
        /* Durations past a day only overflow (now + DefaultDeadline wrapped: every
         * Admit refused); a page larger than its arena; a request size of 0. */
        { "[Pool:thinking]\nDefaultDeadline=18446744073709551615us\n", "DefaultDeadline=18446744073709551615us: at most a day" },
        { "[Cluster]\nHeartbeatInterval=25h\n", "HeartbeatInterval=25h: at most a day" },
        { "[Arena:kv]\nSize=64M\nPageSize=1G\n", "PageSize=1073741824 is larger than the arena's Size=67108864" },
        /* A rule checked once the whole file is read has no line of its own: "file:
         * message", not "file:0: message"; a key's error has its line. */
        { "[Limits]\nMaxRequestSize=0\n", "bad.conf: [Limits] MaxRequestSize= must be at least 1 byte" },
        { "[Daemon]\nLogLevel=info\nColour=blue\n", "bad.conf:3: unknown key Colour=" },
        /* A budget of 0 refused every Reserve (and a reload to it evicted everything). */
        { "[Features]\nCacheSize=0\n", "bad.conf: [Features] CacheSize= must be more than 0" },
};

/* [Metrics] and the window keys of [Backpressure] (docs/telemetry.md), which the
 * section table once left out. */
START_TEST(test_metrics_and_window) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_ptr_null(c.metrics_listen); /* off by default */
        ck_assert_int_eq(config_parse_string(&c,
                                             "[Metrics]\nListen=127.0.0.1:9464\n"
                                             "[Backpressure]\nWindowHandoffs=1\nWindowBytes=1G\nWindowElevated=0.5\n",
                                             "m.conf", &errors),
                         0);
        ck_assert_ptr_null(errors);
        ck_assert_str_eq(c.metrics_listen, "127.0.0.1:9464");
        ck_assert_uint_eq(c.telemetry.backpressure.window_handoffs, 1);
        ck_assert_uint_eq(c.telemetry.backpressure.window_bytes, 1ULL << 30);
        ck_assert_int_eq(config_parse_string(&c, "[Metrics]\nListen=[::1]:0\n", "m.conf", &errors), 0);
        ck_assert_str_eq(c.metrics_listen, "[::1]:0");
        ck_assert_int_eq(config_parse_string(&c, "[Metrics]\nListen=9464\n", "m.conf", &errors), -EINVAL);
        ck_assert_ptr_nonnull(strstr(errors, "Listen=9464: expected HOST:PORT"));
        free(errors);
        config_done(&c);
}
END_TEST

/* A reload that turns an arena's Prefault= on is named as needing a restart (the arena
 * was made at start), like any other arena key; the same file again is no change. */
START_TEST(test_prefault_reload) {
        Config c, n;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_defaults(&n), 0);
        ck_assert_int_eq(config_parse_string(&c, "[Arena:kv]\nSize=16M\n", "a.conf", &errors), 0);
        ck_assert_int_eq(config_parse_string(&n, "[Arena:kv]\nSize=16M\n", "a.conf", &errors), 0);
        ck_assert_uint_eq(config_restart_notices(&c, &n), 0);
        config_done(&n);
        ck_assert_int_eq(config_defaults(&n), 0);
        ck_assert_int_eq(config_parse_string(&n, "[Arena:kv]\nSize=16M\nPrefault=yes\n", "a.conf", &errors), 0);
        ck_assert_ptr_null(errors);
        ck_assert_uint_ge(config_restart_notices(&c, &n), 1);
        config_done(&n);
        config_done(&c);
}
END_TEST

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

START_TEST(test_etcd) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_ptr_null(c.etcd_endpoints);
        ck_assert_str_eq(c.etcd_prefix, "/epd/");
        ck_assert_uint_eq(c.etcd_lease_ttl_usec, 10 * USEC_PER_SEC);
        ck_assert_uint_eq(c.max_members, 256);
        ck_assert_int_eq(config_parse_string(&c,
                                             "[Cluster]\nListen=10.0.0.1:7100\nClusterKeyFile=/k\n"
                                             "Etcd=http://10.0.0.9:2379, https://etcd-b:2379\nEtcdPrefix=/prod/epd/\n"
                                             "EtcdLeaseTTL=3s\nEtcdCAFile=/ca.pem\nEtcdCertFile=/c.pem\nEtcdKeyFile=/k.pem\n"
                                             "MaxMembers=64\nDirectoryCacheTime=250ms\n",
                                             "good.conf", &errors),
                         0);
        ck_assert_str_eq(c.etcd_endpoints[0], "http://10.0.0.9:2379");
        ck_assert_str_eq(c.etcd_endpoints[1], "https://etcd-b:2379");
        ck_assert_ptr_null(c.etcd_endpoints[2]);
        ck_assert_str_eq(c.etcd_prefix, "/prod/epd/");
        ck_assert_uint_eq(c.etcd_lease_ttl_usec, 3 * USEC_PER_SEC);
        ck_assert_str_eq(c.etcd_key_file, "/k.pem");
        ck_assert_uint_eq(c.max_members, 64);
        ck_assert_uint_eq(c.directory_cache_usec, 250 * USEC_PER_MSEC);
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

START_TEST(test_pools) {
        Config c;
        char *errors = NULL;
        ck_assert_int_eq(config_defaults(&c), 0);
        /* Embedded defaults: those of the scheduler. */
        SchedConfig sc;
        sched_config_defaults(&sc);
        for (int t = 0; t < _TASK_TYPE_MAX; t++) {
                ck_assert_int_eq(c.pools[t].policy.priority, sc.pools[t].priority);
                ck_assert_uint_eq(c.pools[t].policy.queue_max, sc.pools[t].queue_max);
                ck_assert_ptr_null(c.pools[t].workers[SCHED_STAGE_DECODE]);
        }
        ck_assert_int_eq(config_parse_string(&c,
                                             "[Pool:interactive]\nPriority=7\nDefaultDeadline=750ms\nQueueMax=100\n"
                                             "WorkerShare=1\nRejectRho=0\nPrefillEstimate=20ms\n"
                                             "DecodeWorkers=label:fast  name:dec-*\nPrefillWorkers=role:colocated\n"
                                             "[Pool:thinking]\nPriority=-2\nQueueMax=50\nHighWatermark=40\nLowWatermark=0\n"
                                             "WorkerShare=0.25\nRejectRho=3.5\nDecodeWorkers= \n",
                                             "pools.conf", &errors),
                         0);
        ck_assert_ptr_null(errors);
        /* A pool the file leaves alone keeps the default watermarks (before, any file
         * moved the low one from 2048 to 1536). */
        ck_assert_uint_eq(c.pools[TASK_HYBRID].policy.high_watermark, sc.pools[TASK_HYBRID].high_watermark);
        ck_assert_uint_eq(c.pools[TASK_HYBRID].policy.low_watermark, sc.pools[TASK_HYBRID].low_watermark);
        const SchedPoolPolicy *i = &c.pools[TASK_INTERACTIVE].policy, *th = &c.pools[TASK_THINKING].policy;
        ck_assert_int_eq(i->priority, 7);
        ck_assert_uint_eq(i->default_deadline, 750 * USEC_PER_MSEC);
        ck_assert_uint_eq(i->queue_max, 100);
        /* Watermarks not given follow QueueMax. */
        ck_assert_uint_eq(i->high_watermark, 75);
        ck_assert_uint_eq(i->low_watermark, 37);
        ck_assert(i->reject_rho == 0);
        ck_assert_uint_eq(i->service_estimate[SCHED_STAGE_PREFILL], 20 * USEC_PER_MSEC);
        ck_assert_uint_eq(i->service_estimate[SCHED_STAGE_DECODE], sc.pools[TASK_INTERACTIVE].service_estimate[SCHED_STAGE_DECODE]);
        ck_assert_str_eq(c.pools[TASK_INTERACTIVE].workers[SCHED_STAGE_DECODE], "label:fast  name:dec-*");
        ck_assert_str_eq(c.pools[TASK_INTERACTIVE].workers[SCHED_STAGE_PREFILL], "role:colocated");
        ck_assert_int_eq(th->priority, -2);
        ck_assert_uint_eq(th->high_watermark, 40);
        ck_assert_uint_eq(th->low_watermark, 0);
        ck_assert(th->worker_share == 0.25);
        ck_assert(th->reject_rho == 3.5);
        ck_assert_ptr_null(c.pools[TASK_THINKING].workers[SCHED_STAGE_DECODE]);
        /* The hybrid pool, not named, keeps its defaults. */
        ck_assert_int_eq(c.pools[TASK_HYBRID].policy.priority, sc.pools[TASK_HYBRID].priority);
        /* What the parser accepts, the scheduler accepts. */
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                sc.pools[t] = c.pools[t].policy;
        ck_assert_int_eq(sched_config_validate(&sc, NULL), 0);
        config_done(&c);

        /* The default watermarks under a smaller QueueMax= (docs/config.md): high is ¾
         * of it, low half of high (⅜ of QueueMax=); a HighWatermark= alone halves too. */
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_string(&c, "[Pool:hybrid]\nQueueMax=512\n[Pool:thinking]\nHighWatermark=300\n",
                                             "watermarks.conf", &errors),
                         0);
        ck_assert_ptr_null(errors);
        ck_assert_uint_eq(c.pools[TASK_HYBRID].policy.high_watermark, 384);
        ck_assert_uint_eq(c.pools[TASK_HYBRID].policy.low_watermark, 192);
        ck_assert_uint_eq(c.pools[TASK_THINKING].policy.high_watermark, 300);
        ck_assert_uint_eq(c.pools[TASK_THINKING].policy.low_watermark, 150);
        config_done(&c);
}
END_TEST

START_TEST(test_pool_select) {
        const char *labels[] = { "fast", "h200" };
        PoolSelectWorker w = { .name = "dec-3", .role = "decode", .model = "Qwen/Qwen2.5-VL-7B",
                               .device = "cuda:1", .labels = labels, .n_labels = 2 };
        PoolSelectWorker bare = { .role = "prefill", .model = "m", .device = "cpu" };
        ck_assert(pool_select_match(NULL, &w));
        ck_assert(pool_select_match("", &w));
        ck_assert(pool_select_match("*", &bare));
        ck_assert(pool_select_match("label:fast", &w));
        ck_assert(!pool_select_match("label:fas", &w));
        ck_assert(!pool_select_match("label:fast", &bare));
        ck_assert(pool_select_match("name:dec-*", &w));
        ck_assert(!pool_select_match("name:dec-*", &bare));
        ck_assert(pool_select_match("role:prefill", &bare));
        ck_assert(!pool_select_match("role:prefill", &w));
        ck_assert(pool_select_match("model:Qwen/*", &w));
        ck_assert(pool_select_match("device:cuda:[01]", &w));
        ck_assert(!pool_select_match("device:cuda:[23]", &w));
        /* Any of the list. */
        ck_assert(pool_select_match("role:encoder\tlabel:h200", &w));
        ck_assert(!pool_select_match("role:encoder label:a100", &w));

        char badsel[64];
        const char *why;
        ck_assert_int_eq(pool_select_validate("* role:decode label:x name:a* model:b device:c", badsel, sizeof badsel, &why), 0);
        ck_assert_int_eq(pool_select_validate("role:decode label:", badsel, sizeof badsel, &why), -EINVAL);
        ck_assert_str_eq(badsel, "label:");
        ck_assert(pool_select_label_valid("fast"));
        ck_assert(!pool_select_label_valid(""));
        ck_assert(!pool_select_label_valid("a b"));
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

        /* A NUL byte is an error of its file and line, as any other. */
        char nulpath[] = "/tmp/epd-config-XXXXXX";
        fd = mkstemp(nulpath);
        ck_assert_int_ge(fd, 0);
        static const char nultext[] = "[Daemon]\nHostId=a\nLog\0Level=info\n";
        ck_assert_int_eq(write(fd, nultext, sizeof nultext - 1), (int)sizeof nultext - 1);
        close(fd);
        char *errors = NULL, want[128];
        ck_assert_int_eq(config_defaults(&c), 0);
        ck_assert_int_eq(config_parse_file(&c, nulpath, &errors), -EINVAL);
        snprintf(want, sizeof want, "%s:3: a NUL byte: the file is not text\n", nulpath);
        ck_assert_ptr_nonnull(errors);
        ck_assert_str_eq(errors, want);
        ck_assert_str_eq(c.host_id ?: "(default)", "(default)");
        free(errors);
        config_done(&c);
        unlink(nulpath);
}
END_TEST

int main(void) {
        Suite *s = suite_create("config");
        TCase *tc = tcase_create("config");
        tcase_add_test(tc, test_defaults);
        tcase_add_test(tc, test_good);
        tcase_add_test(tc, test_metrics_and_window);
        tcase_add_loop_test(tc, test_bad, 0, (int)(sizeof bad / sizeof bad[0]));
        tcase_add_test(tc, test_all_errors_reported);
        tcase_add_test(tc, test_etcd);
        tcase_add_test(tc, test_file);
        tcase_add_test(tc, test_prefault_reload);
        tcase_add_test(tc, test_pools);
        tcase_add_test(tc, test_pool_select);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
