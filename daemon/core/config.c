/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "core/config.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "copy.h"
#include "log.h"
#include "macro.h"
#include "parse-util.h"
#include "peer/peer-proto.h"
#include "sched/pool-select.h"
#include "transport/rdma-select.h"

/* Error collection: every problem in a file is reported, not just the first. */
typedef struct ParseState {
        Config *c;
        const char *file;
        unsigned line;
        char *errors;
        size_t errors_len;
        unsigned n_errors;
        char section[64];
        char section_arg[64];
        bool section_failed;
        ArenaConfig *arena;
        PeerConfig *peer;
        PoolConfig *pool;
        unsigned pools_seen; /* bit per TaskType: [Pool:NAME] given once */
} ParseState;

_printf_(2, 3) static void perr(ParseState *s, const char *fmt, ...) {
        char msg[512];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        char line[640];
        /* Line 0: a rule between keys or sections, or a key not given (check_complete()). */
        int n = s->line > 0 ? snprintf(line, sizeof line, "%s:%u: %s\n", s->file, s->line, msg)
                            : snprintf(line, sizeof line, "%s: %s\n", s->file, msg);
        if (n < 0)
                return;
        if ((size_t)n >= sizeof line) { /* cut short, still one line */
                n = (int)sizeof line - 1;
                line[n - 1] = '\n';
        }
        char *e = realloc(s->errors, s->errors_len + (size_t)n + 1);
        if (!e)
                return;
        memcpy(e + s->errors_len, line, (size_t)n + 1);
        s->errors = e;
        s->errors_len += (size_t)n;
        s->n_errors++;
}

static int set_string(char **dst, const char *v) {
        char *n = strdup(v);
        if (!n)
                return -ENOMEM;
        free(*dst);
        *dst = n;
        return 0;
}

/* ---- value parsers: each returns 0 or reports an error and returns -EINVAL ---- */

typedef int (*ValueParser)(ParseState *s, const char *key, const char *value, void *dst);

static int p_string(ParseState *s, const char *key, const char *value, void *dst) {
        if (!*value) {
                perr(s, "%s= must not be empty", key);
                return -EINVAL;
        }
        if (strlen(value) > 4096) {
                perr(s, "%s= is too long", key);
                return -EINVAL;
        }
        return set_string(dst, value);
}

static int p_path(ParseState *s, const char *key, const char *value, void *dst) {
        if (value[0] != '/') {
                perr(s, "%s=%s: expected an absolute path", key, value);
                return -EINVAL;
        }
        if (strlen(value) >= CONFIG_SOCKET_PATH_MAX && strcmp(key, "Socket") == 0) {
                perr(s, "%s=%s: a unix socket path must be shorter than %u bytes (it is bound as "
                     "<path>.<pid>, then renamed)", key, value, CONFIG_SOCKET_PATH_MAX);
                return -EINVAL;
        }
        return p_string(s, key, value, dst);
}

const char *config_host_id_problem(const char *value) {
        size_t n = strlen(value);
        if (n == 0 || n > 63)
                return "expected 1 to 63 characters";
        for (size_t i = 0; i < n; i++)
                if (!isalnum((unsigned char)value[i]) && !strchr("-_.", value[i]))
                        return "only letters, digits, '-', '_' and '.' are allowed";
        return NULL;
}

static int p_host_id(ParseState *s, const char *key, const char *value, void *dst) {
        const char *why = config_host_id_problem(value);
        if (why) {
                perr(s, "%s=%s: %s", key, value, why);
                return -EINVAL;
        }
        return set_string(dst, value);
}

/* A group name as useradd(8) takes it: a letter or '_', then letters, digits, '_', '-'
 * or '.' (a trailing '$' aside), at most 32 bytes. Whether it exists is start-up's
 * question (manager_verify()). */
static int p_group(ParseState *s, const char *key, const char *value, void *dst) {
        size_t n = strlen(value);
        bool ok = n > 0 && n <= 32 && (isalpha((unsigned char)value[0]) || value[0] == '_');
        for (size_t i = 1; ok && i < n; i++)
                ok = isalnum((unsigned char)value[i]) || strchr("_-.", value[i]) ||
                     (value[i] == '$' && i == n - 1);
        if (!ok) {
                perr(s, "%s=%s: expected a group name (a letter or '_', then letters, digits, '_', '-' or '.'; "
                     "at most 32 bytes)", key, value);
                return -EINVAL;
        }
        return set_string(dst, value);
}

static int p_bool(ParseState *s, const char *key, const char *value, void *dst) {
        if (parse_bool(value, dst) < 0) {
                perr(s, "%s=%s: expected a boolean (yes/no)", key, value);
                return -EINVAL;
        }
        return 0;
}

static int p_unsigned(ParseState *s, const char *key, const char *value, void *dst) {
        uint32_t v;
        if (parse_u32(value, &v) < 0 || v == 0 || v > 1000000) {
                perr(s, "%s=%s: expected a number from 1 to 1000000", key, value);
                return -EINVAL;
        }
        *(unsigned *)dst = v;
        return 0;
}

static int p_size(ParseState *s, const char *key, const char *value, void *dst) {
        int r = parse_size(value, dst);
        if (r < 0) {
                perr(s, "%s=%s: expected a size such as 4096, 64K, 256M or 2G%s", key, value,
                     r == -ERANGE ? " (value too large)" : "");
                return -EINVAL;
        }
        return 0;
}

/* No timeout, deadline or interval here means more than a day; larger values only
 * overflow (now + DefaultDeadline wraps, a heartbeat's milliseconds do not fit 32 bits). */
#define CONFIG_DURATION_MAX (24 * 3600 * USEC_PER_SEC)

static int p_duration(ParseState *s, const char *key, const char *value, void *dst) {
        usec_t u;
        if (parse_duration(value, &u) < 0 || u == 0) {
                perr(s, "%s=%s: expected a positive duration such as 2s or 500ms", key, value);
                return -EINVAL;
        }
        if (u > CONFIG_DURATION_MAX) {
                perr(s, "%s=%s: at most a day (24h)", key, value);
                return -EINVAL;
        }
        *(usec_t *)dst = u;
        return 0;
}

/* A duration where 0 means "off" (DirectoryCacheTime=0: nothing cached). */
static int p_duration_or_zero(ParseState *s, const char *key, const char *value, void *dst) {
        usec_t u;
        if (parse_duration(value, &u) < 0) {
                perr(s, "%s=%s: expected a duration such as 1s, 500ms or 0", key, value);
                return -EINVAL;
        }
        *(usec_t *)dst = u;
        return 0;
}

static int p_log_level(ParseState *s, const char *key, const char *value, void *dst) {
        int l = log_level_from_string(value);
        if (l < 0) {
                perr(s, "%s=%s: expected one of emerg, alert, crit, err, warning, notice, info, debug",
                     key, value);
                return -EINVAL;
        }
        *(int *)dst = l;
        return 0;
}

static int p_domain(ParseState *s, const char *key, const char *value, void *dst) {
        if (strcmp(value, "host") == 0)
                *(MemoryDomain *)dst = MEMORY_HOST;
        else if (strcmp(value, "gpu") == 0)
                *(MemoryDomain *)dst = MEMORY_GPU;
        else {
                perr(s, "%s=%s: expected host or gpu", key, value);
                return -EINVAL;
        }
        return 0;
}

static int p_usage(ParseState *s, const char *key, const char *value, void *dst) {
        int u = arena_usage_from_string(value);
        if (u < 0) {
                perr(s, "%s=%s: expected kv or feature", key, value);
                return -EINVAL;
        }
        *(ArenaUsage *)dst = (ArenaUsage)u;
        return 0;
}

static int p_hugepages(ParseState *s, const char *key, const char *value, void *dst) {
        bool b;
        if (strcmp(value, "try") == 0)
                *(HugePages *)dst = HUGEPAGES_TRY;
        else if (parse_bool(value, &b) == 0)
                *(HugePages *)dst = b ? HUGEPAGES_YES : HUGEPAGES_NO;
        else {
                perr(s, "%s=%s: expected yes, no or try", key, value);
                return -EINVAL;
        }
        return 0;
}

static int p_int_node(ParseState *s, const char *key, const char *value, void *dst) {
        uint32_t v;
        if (strcmp(value, "any") == 0) {
                *(int *)dst = -1;
                return 0;
        }
        if (parse_u32(value, &v) < 0 || v > 1023) {
                perr(s, "%s=%s: expected a number from 0 to 1023 or 'any'", key, value);
                return -EINVAL;
        }
        *(int *)dst = (int)v;
        return 0;
}

/* [Cluster] Listen= and [Peer:NAME] Address=: what the peer layer will bind or dial,
 * parsed by the very function it uses (peer_address_parse(): a numeric IPv4 address or
 * a bracketed IPv6 one, and a port; host names are not resolved), so that a file the
 * parser accepts is one the peer layer takes. */
static int p_address(ParseState *s, const char *key, const char *value, void *dst) {
        struct sockaddr_storage sa;
        unsigned sl;
        if (peer_address_parse(value, &sa, &sl) < 0) {
                perr(s, "%s=%s: expected a numeric IPv4 address and a port (10.0.0.1:7199) or [IPV6]:PORT, "
                     "port 1 to 65535; host names are not resolved", key, value);
                return -EINVAL;
        }
        return set_string(dst, value);
}

/* [Metrics] Listen=: HOST:PORT, where port 0 asks for a free port (Metrics.Address and
 * `epdctl status` say which). */
static int p_metrics_listen(ParseState *s, const char *key, const char *value, void *dst) {
        const char *colon = strrchr(value, ':');
        uint32_t port;
        if (!colon || colon == value || parse_u32(colon + 1, &port) < 0 || port > 65535) {
                perr(s, "%s=%s: expected HOST:PORT (such as 127.0.0.1:9464) with a port from 0 (any free one) to 65535",
                     key, value);
                return -EINVAL;
        }
        return set_string(dst, value);
}

static const char *startswith(const char *s, const char *prefix) {
        size_t n = strlen(prefix);
        return strncmp(s, prefix, n) == 0 ? s + n : NULL;
}

static void strv_free(char **l) {
        for (char **i = l; i && *i; i++)
                free(*i);
        free(l);
}

/* Etcd=URL[ URL...] (spaces or commas): http:// or https://, a host and a port, no path. */
static int p_etcd_endpoints(ParseState *s, const char *key, const char *value, void *dst) {
        char ***ret = dst, **l = NULL, *copy, *save = NULL;
        size_t n = 0;

        if (!(copy = strdup(value)))
                return -ENOMEM;
        for (char *w = strtok_r(copy, " \t,", &save); w; w = strtok_r(NULL, " \t,", &save)) {
                const char *hp = startswith(w, "http://") ?: startswith(w, "https://");
                const char *colon = hp ? strrchr(hp, ':') : NULL;
                uint32_t port;
                char **nl;

                if (!hp || !colon || colon == hp || strchr(hp, '/') || strchr(hp, '@') ||
                    parse_u32(colon + 1, &port) < 0 || port == 0 || port > 65535 || n >= 16) {
                        perr(s, "%s=%s: expected up to 16 URLs http://HOST:PORT or https://HOST:PORT", key, w);
                        free(copy);
                        strv_free(l);
                        return -EINVAL;
                }
                nl = reallocarray(l, n + 2, sizeof *l);
                if (!nl) {
                        strv_free(l);
                        free(copy);
                        return -ENOMEM;
                }
                l = nl;
                if (!(l[n] = strdup(w))) { /* l[n] NULL: the strings before it go too */
                        strv_free(l);
                        free(copy);
                        return -ENOMEM;
                }
                l[++n] = NULL;
        }
        free(copy);
        strv_free(*ret);
        *ret = l; /* NULL for an empty value: no etcd */
        return 0;
}

/* EtcdPrefix=: an absolute key prefix of printable characters, ending in '/'. */
static int p_etcd_prefix(ParseState *s, const char *key, const char *value, void *dst) {
        size_t n = strlen(value);
        if (n < 2 || n > 128 || value[0] != '/' || value[n - 1] != '/') {
                perr(s, "%s=%s: expected a key prefix like /epd/ (starting and ending with '/', at most 128 bytes)",
                     key, value);
                return -EINVAL;
        }
        for (size_t i = 0; i < n; i++)
                if (!isgraph((unsigned char)value[i])) {
                        perr(s, "%s=%s: only printable characters without spaces", key, value);
                        return -EINVAL;
                }
        return set_string(dst, value);
}

/* [Telemetry] and [Backpressure]: the keys and their checks live in telemetry-config.c. */
static int p_telemetry(ParseState *s, const char *key, const char *value, void *dst) {
        int r = telemetry_config_set(dst, s->section, key, value);
        if (r == -ENOMEM)
                return r;
        if (r < 0) {
                perr(s, "%s=%s: invalid value (see docs/telemetry.md)", key, value);
                return -EINVAL;
        }
        return 0;
}

static int p_wal_sync(ParseState *s, const char *key, const char *value, void *dst) {
        /* The values of WalSyncPolicy (wal.h): always, batch, none. */
        static const char *const names[] = { "always", "batch", "none" };
        for (size_t i = 0; i < ELEMENTSOF(names); i++)
                if (strcmp(value, names[i]) == 0) {
                        *(int *)dst = (int)i;
                        return 0;
                }
        perr(s, "%s=%s: expected always, batch or none", key, value);
        return -EINVAL;
}

static int p_copy_kernel(ParseState *s, const char *key, const char *value, void *dst) {
        /* The values of GpuCopyKernelPolicy (gpu/copy.h): never, small, always. */
        static const char *const names[] = { "never", "small", "always" };
        for (size_t i = 0; i < ELEMENTSOF(names); i++)
                if (strcmp(value, names[i]) == 0) {
                        *(int *)dst = (int)i;
                        return 0;
                }
        perr(s, "%s=%s: expected never, small or always", key, value);
        return -EINVAL;
}

static int p_transport(ParseState *s, const char *key, const char *value, void *dst) {
        int p = transport_policy_from_string(value);
        if (p < 0) {
                perr(s, "%s=%s: expected auto, tcp or rdma", key, value);
                return -EINVAL;
        }
        *(int *)dst = p;
        return 0;
}

/* [Pool:NAME] values (docs/scheduler.md). */
static int p_priority(ParseState *s, const char *key, const char *value, void *dst) {
        char *end;
        errno = 0;
        long v = strtol(value, &end, 10);
        if (!*value || *end || errno != 0 || v < -1000 || v > 1000) {
                perr(s, "%s=%s: expected an integer from -1000 to 1000", key, value);
                return -EINVAL;
        }
        *(int *)dst = (int)v;
        return 0;
}

static int p_watermark(ParseState *s, const char *key, const char *value, void *dst) {
        uint32_t v;
        if (parse_u32(value, &v) < 0 || v > 1000000) {
                perr(s, "%s=%s: expected a number from 0 to 1000000", key, value);
                return -EINVAL;
        }
        *(unsigned *)dst = v;
        if (s->pool && strcmp(key, "HighWatermark") == 0)
                s->pool->high_set = true;
        else if (s->pool)
                s->pool->low_set = true;
        return 0;
}

static int parse_double(const char *value, double *ret) {
        char *end;
        errno = 0;
        double v = strtod(value, &end);
        if (!*value || *end || errno != 0 || !(v == v) || v > 1e9 || v < -1e9)
                return -EINVAL;
        *ret = v;
        return 0;
}

static int p_share(ParseState *s, const char *key, const char *value, void *dst) {
        double v;
        if (parse_double(value, &v) < 0 || !(v > 0 && v <= 1)) {
                perr(s, "%s=%s: expected a fraction above 0 and at most 1, such as 0.5", key, value);
                return -EINVAL;
        }
        *(double *)dst = v;
        return 0;
}

static int p_rho(ParseState *s, const char *key, const char *value, void *dst) {
        double v;
        if (parse_double(value, &v) < 0 || !(v == 0 || (v >= 1 && v <= 1000))) {
                perr(s, "%s=%s: expected 0 (never reject for load) or a number from 1 to 1000", key, value);
                return -EINVAL;
        }
        *(double *)dst = v;
        return 0;
}

static int p_selectors(ParseState *s, const char *key, const char *value, void *dst) {
        char bad[128];
        const char *why = NULL;
        if (pool_select_validate(value, bad, sizeof bad, &why) < 0) {
                if (bad[0])
                        perr(s, "%s=: selector '%s': %s", key, bad, why);
                else
                        perr(s, "%s=: %s", key, why);
                return -EINVAL;
        }
        /* Empty: every worker (the default). */
        if (strspn(value, " \t") == strlen(value)) {
                char **d = dst;
                free(*d);
                *d = NULL;
                return 0;
        }
        return set_string(dst, value);
}

typedef struct ConfigItem {
        const char *section; /* "Arena" and "Peer" take a name: [Arena:NAME] */
        const char *key;
        ValueParser parse;
        size_t offset;       /* in Config, ArenaConfig or PeerConfig */
} ConfigItem;

#define C(f) offsetof(Config, f)
#define A(f) offsetof(ArenaConfig, f)
#define P(f) offsetof(PeerConfig, f)
#define PL(f) offsetof(PoolConfig, f)

static const ConfigItem items[] = {
        { "Daemon", "HostId", p_host_id, C(host_id) },
        { "Daemon", "Socket", p_path, C(socket_path) },
        { "Daemon", "SocketGroup", p_group, C(socket_group) },
        { "Daemon", "BusAddress", p_string, C(bus_address) },
        { "Daemon", "SystemBus", p_bool, C(system_bus) },
        { "Daemon", "LogLevel", p_log_level, C(log_level) },
        { "Daemon", "StateDirectory", p_path, C(state_dir) },
        { "Limits", "MaxClients", p_unsigned, C(max_clients) },
        { "Limits", "MaxWorkers", p_unsigned, C(max_workers) },
        { "Limits", "MaxObjectsPerClient", p_unsigned, C(max_objects_per_client) },
        { "Limits", "MaxRequestsPerClient", p_unsigned, C(max_requests_per_client) },
        { "Limits", "MaxRequestSize", p_size, C(max_request_bytes) },
        { "Limits", "AttachGrace", p_duration, C(attach_grace_usec) },
        { "Limits", "WorkflowTokenMemory", p_size, C(workflow_token_bytes) },
        { "Arena", "Domain", p_domain, A(domain) },
        { "Arena", "Usage", p_usage, A(usage) },
        { "Arena", "Size", p_size, A(size) },
        { "Arena", "HugePages", p_hugepages, A(hugepages) },
        { "Arena", "NumaNode", p_int_node, A(numa_node) },
        { "Arena", "Prefault", p_bool, A(prefault) },
        { "Arena", "Gpu", p_int_node, A(gpu) },
        { "Arena", "PageSize", p_size, A(page_size) },
        { "Cluster", "Listen", p_address, C(listen_address) },
        { "Cluster", "ClusterKeyFile", p_path, C(cluster_key_file) },
        { "Cluster", "HeartbeatInterval", p_duration, C(heartbeat_usec) },
        { "Cluster", "HandoffTimeout", p_duration, C(handoff_timeout_usec) },
        { "Cluster", "DataStreams", p_unsigned, C(peer_streams) },
        { "Cluster", "SliceSize", p_size, C(peer_slice_size) },
        { "Cluster", "PipelineBytes", p_size, C(handoff_pipeline_bytes) },
        { "Cluster", "Transport", p_transport, C(transport_policy) },
        { "Cluster", "Etcd", p_etcd_endpoints, C(etcd_endpoints) },
        { "Cluster", "EtcdPrefix", p_etcd_prefix, C(etcd_prefix) },
        { "Cluster", "EtcdLeaseTTL", p_duration, C(etcd_lease_ttl_usec) },
        { "Cluster", "EtcdCAFile", p_path, C(etcd_ca_file) },
        { "Cluster", "EtcdCertFile", p_path, C(etcd_cert_file) },
        { "Cluster", "EtcdKeyFile", p_path, C(etcd_key_file) },
        { "Cluster", "MaxMembers", p_unsigned, C(max_members) },
        { "Cluster", "DirectoryCacheTime", p_duration_or_zero, C(directory_cache_usec) },
        { "Peer", "Address", p_address, P(address) },
        { "Peer", "HostId", p_host_id, P(host_id) },
        { "Features", "CacheSize", p_size, C(feature_cache_bytes) },
        { "Features", "StoreDirectory", p_path, C(feature_store_dir) },
        { "Features", "StoreMaxSize", p_size, C(feature_store_max_bytes) },
        { "Features", "ReadBackTimeout", p_duration_or_zero, C(feature_read_back_timeout_usec) },
        { "Features", "ProduceTimeout", p_duration_or_zero, C(feature_produce_timeout_usec) },
        { "Telemetry", "BPF", p_telemetry, C(telemetry) },
        { "Telemetry", "PinDirectory", p_telemetry, C(telemetry) },
        { "Telemetry", "SampleInterval", p_telemetry, C(telemetry) },
        { "Telemetry", "WakeupBytes", p_telemetry, C(telemetry) },
        { "Telemetry", "TraceRequests", p_telemetry, C(telemetry) },
        { "Telemetry", "TraceEvents", p_telemetry, C(telemetry) },
        { "Telemetry", "MaxPeers", p_telemetry, C(telemetry) },
        { "Backpressure", "Enabled", p_telemetry, C(telemetry) },
        { "Backpressure", "Interval", p_telemetry, C(telemetry) },
        { "Backpressure", "RTTInflationElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "RTTInflationHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "RTTFloor", p_telemetry, C(telemetry) },
        { "Backpressure", "RTTMinBytes", p_telemetry, C(telemetry) },
        { "Backpressure", "RetransmitRateElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "RetransmitRateHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "SendQueueElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "SendQueueHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "SendQueueGrowthElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "SendQueueGrowthHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "HandoffsElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "HandoffsHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "DestinationFreeElevated", p_telemetry, C(telemetry) },
        { "Backpressure", "DestinationFreeHigh", p_telemetry, C(telemetry) },
        { "Backpressure", "StallTimeout", p_telemetry, C(telemetry) },
        { "Backpressure", "Hold", p_telemetry, C(telemetry) },
        { "Backpressure", "Release", p_telemetry, C(telemetry) },
        { "Backpressure", "WindowHandoffs", p_telemetry, C(telemetry) },
        { "Backpressure", "WindowBytes", p_telemetry, C(telemetry) },
        { "Backpressure", "WindowElevated", p_telemetry, C(telemetry) },
        { "Wal", "Sync", p_wal_sync, C(wal_sync) },
        { "Wal", "CompactSize", p_size, C(wal_compact_bytes) },
        { "Gpu", "CopyKernel", p_copy_kernel, C(gpu_copy_kernel) },
        { "Gpu", "MergeGroups", p_unsigned, C(gpu_merge_groups) },
        { "Gpu", "BatchesInFlight", p_unsigned, C(gpu_batches_in_flight) },
        { "Gpu", "CompletionSpin", p_duration_or_zero, C(gpu_completion_spin_usec) },
        { "Gpu", "StridedCopies", p_bool, C(gpu_strided_copies) },
        { "Metrics", "Listen", p_metrics_listen, C(metrics_listen) },
        { "Pool", "Priority", p_priority, PL(policy.priority) },
        { "Pool", "DefaultDeadline", p_duration, PL(policy.default_deadline) },
        { "Pool", "QueueMax", p_unsigned, PL(policy.queue_max) },
        { "Pool", "HighWatermark", p_watermark, PL(policy.high_watermark) },
        { "Pool", "LowWatermark", p_watermark, PL(policy.low_watermark) },
        { "Pool", "WorkerShare", p_share, PL(policy.worker_share) },
        { "Pool", "RejectRho", p_rho, PL(policy.reject_rho) },
        { "Pool", "EncodeEstimate", p_duration, PL(policy.service_estimate[SCHED_STAGE_ENCODE]) },
        { "Pool", "PrefillEstimate", p_duration, PL(policy.service_estimate[SCHED_STAGE_PREFILL]) },
        { "Pool", "DecodeEstimate", p_duration, PL(policy.service_estimate[SCHED_STAGE_DECODE]) },
        { "Pool", "EncodeWorkers", p_selectors, PL(workers[SCHED_STAGE_ENCODE]) },
        { "Pool", "PrefillWorkers", p_selectors, PL(workers[SCHED_STAGE_PREFILL]) },
        { "Pool", "DecodeWorkers", p_selectors, PL(workers[SCHED_STAGE_DECODE]) },
};

static const char *const named_sections[] = { "Arena", "Peer", "Pool" };
static const char *const plain_sections[] = { "Daemon", "Limits", "Cluster", "Features",
                                               "Telemetry", "Backpressure", "Wal", "Gpu", "Metrics" };

static void arena_config_done(ArenaConfig *a) {
        free(a->name);
}

static void peer_config_done(PeerConfig *p) {
        free(p->name);
        free(p->address);
        free(p->host_id);
}

static int add_default_arena(Config *c, const char *name, ArenaUsage usage, uint64_t size,
                             uint64_t page_size) {
        ArenaConfig *n = realloc(c->arenas, (c->n_arenas + 1) * sizeof *n);
        if (!n)
                return -ENOMEM;
        c->arenas = n;
        c->arenas[c->n_arenas] = (ArenaConfig){
                .name = strdup(name),
                .domain = MEMORY_HOST,
                .usage = usage,
                .size = size,
                .hugepages = HUGEPAGES_NO,
                .numa_node = -1,
                .gpu = -1,
                .page_size = page_size,
        };
        if (!c->arenas[c->n_arenas].name)
                return -ENOMEM;
        c->n_arenas++;
        return 0;
}

static void pool_config_done(PoolConfig *p) {
        for (int st = 0; st < _SCHED_STAGE_MAX; st++)
        {
                free(p->workers[st]);
                p->workers[st] = NULL;
        }
}

int config_defaults(Config *c) {
        *c = (Config){
                .system_bus = true,
                .log_level = LOG_INFO,
                .max_clients = 256,
                .max_workers = 64,
                .max_objects_per_client = 4096,
                .max_requests_per_client = 1024,
                .max_request_bytes = 1ULL << 30,
                .attach_grace_usec = 300 * USEC_PER_SEC,
                .workflow_token_bytes = 512ULL << 20,
                .heartbeat_usec = 2 * USEC_PER_SEC,
                .peer_streams = 2,
                .peer_slice_size = 1024 * 1024,
                .handoff_pipeline_bytes = 1024 * 1024,
                .handoff_timeout_usec = 30 * USEC_PER_SEC,
                .etcd_lease_ttl_usec = 10 * USEC_PER_SEC,
                .max_members = 256,
                .directory_cache_usec = USEC_PER_SEC,
                .feature_cache_bytes = 48ULL << 20,
                .feature_store_max_bytes = 1ULL << 30,
                /* Under the 25 s a D-Bus call waits by default: an answer the caller still
                 * hears, not a handle it never learns of. */
                .feature_read_back_timeout_usec = 20 * USEC_PER_SEC,
                .feature_produce_timeout_usec = 120 * USEC_PER_SEC,
                .wal_sync = 1, /* batch: group commit */
                .wal_compact_bytes = 64ULL << 20,
                .gpu_copy_kernel = 1, /* small: scattered pages through the batched copy kernel */
                .gpu_merge_groups = 8,
                .gpu_batches_in_flight = 2,
                .gpu_completion_spin_usec = GPU_COPY_SPIN_USEC,
        };
        SchedConfig sc;
        sched_config_defaults(&sc);
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                c->pools[t].policy = sc.pools[t];
        if (!(c->socket_path = strdup(EPD_SOCKET_PATH)) || !(c->state_dir = strdup(EPD_STATE_DIR)) ||
            !(c->etcd_prefix = strdup("/epd/")))
                return -ENOMEM;
        if (telemetry_config_defaults(&c->telemetry) < 0)
                return -ENOMEM;
        /* Embedded defaults: one host KV arena and one feature arena. */
        int r = add_default_arena(c, "host0", ARENA_USAGE_KV, 256ULL << 20, 0);
        if (r < 0)
                return r;
        return add_default_arena(c, "feat0", ARENA_USAGE_FEATURE, 64ULL << 20, 64ULL << 10);
}

void config_done(Config *c) {
        free(c->host_id);
        free(c->socket_path);
        free(c->socket_group);
        free(c->bus_address);
        free(c->state_dir);
        for (size_t i = 0; i < c->n_arenas; i++)
                arena_config_done(&c->arenas[i]);
        free(c->arenas);
        for (size_t i = 0; i < c->n_peers; i++)
                peer_config_done(&c->peers[i]);
        free(c->peers);
        free(c->listen_address);
        free(c->cluster_key_file);
        strv_free(c->etcd_endpoints);
        free(c->etcd_prefix);
        free(c->etcd_ca_file);
        free(c->etcd_cert_file);
        free(c->etcd_key_file);
        free(c->feature_store_dir);
        free(c->metrics_listen);
        telemetry_config_done(&c->telemetry);
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                pool_config_done(&c->pools[t]);
        *c = (Config){ 0 };
}

static bool valid_object_name(const char *s) {
        size_t n = strlen(s);
        if (n == 0 || n > 31)
                return false;
        for (size_t i = 0; i < n; i++)
                if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-')
                        return false;
        return true;
}

static void start_section(ParseState *s, bool *arenas_replaced, char *line) {
        char *end = strchr(line, ']');
        s->arena = NULL;
        s->peer = NULL;
        s->pool = NULL;
        s->section[0] = s->section_arg[0] = 0;
        s->section_failed = true; /* until the header is accepted */
        if (!end || end[1] != 0) {
                perr(s, "malformed section header");
                return;
        }
        *end = 0;
        char *name = line + 1, *arg = strchr(name, ':');
        if (arg)
                *arg++ = 0;
        bool named = false, known = false;
        for (size_t i = 0; i < ELEMENTSOF(named_sections); i++)
                if (strcmp(name, named_sections[i]) == 0)
                        named = known = true;
        for (size_t i = 0; i < ELEMENTSOF(plain_sections); i++)
                if (strcmp(name, plain_sections[i]) == 0)
                        known = true;
        if (!known) {
                perr(s, "unknown section [%s]", name);
                return;
        }
        if (named && (!arg || !valid_object_name(arg))) {
                perr(s, "[%s:NAME] needs a NAME of 1 to 31 letters, digits, '-' or '_'", name);
                return;
        }
        if (!named && arg) {
                perr(s, "section [%s] takes no name", name);
                return;
        }
        s->section_failed = false;
        snprintf(s->section, sizeof s->section, "%s", name);
        if (arg)
                snprintf(s->section_arg, sizeof s->section_arg, "%s", arg);

        Config *c = s->c;
        if (strcmp(name, "Arena") == 0) {
                if (!*arenas_replaced) {
                        /* A file that defines arenas replaces the embedded ones. */
                        for (size_t i = 0; i < c->n_arenas; i++)
                                arena_config_done(&c->arenas[i]);
                        c->n_arenas = 0;
                        *arenas_replaced = true;
                }
                for (size_t i = 0; i < c->n_arenas; i++)
                        if (strcmp(c->arenas[i].name, arg) == 0) {
                                perr(s, "arena '%s' is defined twice", arg);
                                s->section[0] = 0;
                                s->section_failed = true;
                                return;
                        }
                if (c->n_arenas >= 64) {
                        perr(s, "too many arenas (at most 64)");
                        s->section[0] = 0;
                                s->section_failed = true;
                        return;
                }
                if (add_default_arena(c, arg, ARENA_USAGE_KV, 0, 0) < 0) {
                        perr(s, "out of memory");
                        s->section[0] = 0;
                                s->section_failed = true;
                        return;
                }
                s->arena = &c->arenas[c->n_arenas - 1];
        } else if (strcmp(name, "Peer") == 0) {
                for (size_t i = 0; i < c->n_peers; i++)
                        if (strcmp(c->peers[i].name, arg) == 0) {
                                perr(s, "peer '%s' is defined twice", arg);
                                s->section[0] = 0;
                                s->section_failed = true;
                                return;
                        }
                if (c->n_peers >= 256) {
                        perr(s, "too many peers (at most 256)");
                        s->section[0] = 0;
                                s->section_failed = true;
                        return;
                }
                PeerConfig *n = realloc(c->peers, (c->n_peers + 1) * sizeof *n);
                if (!n) {
                        perr(s, "out of memory");
                        s->section[0] = 0;
                                s->section_failed = true;
                        return;
                }
                c->peers = n;
                c->peers[c->n_peers] = (PeerConfig){ .name = strdup(arg) };
                if (!c->peers[c->n_peers].name) {
                        perr(s, "out of memory");
                        s->section[0] = 0;
                        s->section_failed = true;
                        return;
                }
                s->peer = &c->peers[c->n_peers++];
        } else if (strcmp(name, "Pool") == 0) {
                TaskType t = task_type_from_string(arg);
                if (t < 0) {
                        perr(s, "[Pool:%s]: expected a pool named thinking, interactive or hybrid", arg);
                        s->section[0] = 0;
                        s->section_failed = true;
                        return;
                }
                if (s->pools_seen & (1u << t)) {
                        perr(s, "pool '%s' is defined twice", arg);
                        s->section[0] = 0;
                        s->section_failed = true;
                        return;
                }
                s->pools_seen |= 1u << t;
                s->pool = &c->pools[t];
        }
}

static char *strip(char *s) {
        while (isspace((unsigned char)*s))
                s++;
        char *e = s + strlen(s);
        while (e > s && isspace((unsigned char)e[-1]))
                *--e = 0;
        return s;
}

static void check_complete(ParseState *s) {
        Config *c = s->c;
        s->line = 0;
        for (size_t i = 0; i < c->n_arenas; i++) {
                ArenaConfig *a = &c->arenas[i];
                if (a->size == 0)
                        perr(s, "[Arena:%s] needs Size=", a->name);
                if (a->domain == MEMORY_GPU && a->gpu < 0)
                        perr(s, "[Arena:%s] Domain=gpu needs Gpu=N", a->name);
                if (a->domain == MEMORY_GPU && a->hugepages != HUGEPAGES_NO)
                        perr(s, "[Arena:%s] HugePages= applies to host arenas only", a->name);
                if (a->domain == MEMORY_GPU && a->prefault)
                        perr(s, "[Arena:%s] Prefault= applies to host arenas only (a GPU arena's memory is allocated at start)",
                             a->name);
                if (a->domain == MEMORY_GPU && a->numa_node >= 0)
                        perr(s, "[Arena:%s] NumaNode= applies to host arenas only (a GPU arena lives on its GPU)",
                             a->name);
                if (a->domain != MEMORY_GPU && a->gpu >= 0)
                        perr(s, "[Arena:%s] Gpu= applies to GPU arenas only (Domain=gpu)", a->name);
                if (a->page_size && (!IS_POWER_OF_2(a->page_size) || a->page_size < 4096))
                        perr(s, "[Arena:%s] PageSize= must be a power of two of at least 4K",
                             a->name);
                else if (a->page_size && a->size && a->page_size > a->size)
                        perr(s, "[Arena:%s] PageSize=%" PRIu64 " is larger than the arena's Size=%" PRIu64
                                ": not one page would fit",
                             a->name, a->page_size, a->size);
        }
        for (size_t i = 0; i < c->n_peers; i++)
                if (!c->peers[i].address || !c->peers[i].host_id)
                        perr(s, "[Peer:%s] needs Address= and HostId=", c->peers[i].name);
        if (c->n_peers > 0 && !c->cluster_key_file)
                perr(s, "peers are configured but [Cluster] ClusterKeyFile= is not set");
        if (c->heartbeat_usec < 100 * USEC_PER_MSEC)
                perr(s, "[Cluster] HeartbeatInterval= must be at least 100ms");
        if (c->feature_cache_bytes == 0)
                perr(s, "[Features] CacheSize= must be more than 0 (0 would refuse every feature's Reserve, and a "
                        "reload to it evict every feature)");
        if (c->max_request_bytes == 0)
                perr(s, "[Limits] MaxRequestSize= must be at least 1 byte (0 would refuse every sized request)");
        if (c->wal_compact_bytes < 4096)
                perr(s, "[Wal] CompactSize= must be at least 4K (a log as small as its own header would be "
                        "compacted again and again, whatever was written)");
        if (c->attach_grace_usec < USEC_PER_SEC)
                perr(s, "[Limits] AttachGrace= must be at least 1s (restored objects need time to be attached)");
        if (c->peer_streams > 16)
                perr(s, "[Cluster] DataStreams=%u: expected 1 to 16", c->peer_streams);
        if (c->gpu_merge_groups > 16)
                perr(s, "[Gpu] MergeGroups=%u: expected 1 to 16", c->gpu_merge_groups);
        if (c->gpu_batches_in_flight > CONFIG_GPU_BATCHES_MAX)
                perr(s, "[Gpu] BatchesInFlight=%u: expected 1 to %u", c->gpu_batches_in_flight,
                     CONFIG_GPU_BATCHES_MAX);
        if (c->gpu_completion_spin_usec > 10 * USEC_PER_MSEC)
                perr(s, "[Gpu] CompletionSpin=: at most 10ms (the completion thread polls a CPU that long)");
        if (c->peer_slice_size < 4096 || c->peer_slice_size > 16 * 1024 * 1024)
                perr(s, "[Cluster] SliceSize=%llu: expected 4K to 16M", (unsigned long long)c->peer_slice_size);
        if (c->etcd_endpoints && (!c->listen_address || !c->cluster_key_file))
                perr(s, "[Cluster] Etcd= needs Listen= (the address members dial) and ClusterKeyFile=");
        if (c->etcd_lease_ttl_usec < 2 * USEC_PER_SEC || c->etcd_lease_ttl_usec > 300 * USEC_PER_SEC ||
            c->etcd_lease_ttl_usec % USEC_PER_SEC)
                perr(s, "[Cluster] EtcdLeaseTTL= must be whole seconds from 2s to 300s");
        if (c->max_members < 1 || c->max_members > 1023)
                perr(s, "[Cluster] MaxMembers=%u: expected 1 to 1023", c->max_members);
        if (c->directory_cache_usec > 60 * USEC_PER_SEC)
                perr(s, "[Cluster] DirectoryCacheTime= must be at most 60s");
        if (c->feature_read_back_timeout_usec > CONFIG_DURATION_MAX)
                perr(s, "[Features] ReadBackTimeout=: at most a day (24h)");
        if (c->feature_produce_timeout_usec > CONFIG_DURATION_MAX)
                perr(s, "[Features] ProduceTimeout=: at most a day (24h)");
        if (!!c->etcd_cert_file != !!c->etcd_key_file)
                perr(s, "[Cluster] EtcdCertFile= and EtcdKeyFile= go together");
        for (int t = 0; t < _TASK_TYPE_MAX; t++) {
                PoolConfig *p = &c->pools[t];
                SchedPoolPolicy *pp = &p->policy;
                const char *name = task_type_to_string((TaskType)t);
                /* Watermarks not given follow QueueMax= (and a low one not given, a high
                 * one that moved): a pool a file does not change keeps the defaults. */
                unsigned high_before = pp->high_watermark;
                if (!p->high_set)
                        pp->high_watermark = MIN(pp->high_watermark, MAX(pp->queue_max * 3 / 4, 1u));
                if (!p->low_set && (p->high_set || pp->high_watermark != high_before))
                        pp->low_watermark = MIN(pp->low_watermark, pp->high_watermark / 2);
                if (pp->high_watermark == 0 || pp->high_watermark > pp->queue_max)
                        perr(s, "[Pool:%s] HighWatermark=%u: expected 1 to QueueMax=%u", name,
                             pp->high_watermark, pp->queue_max);
                else if (pp->low_watermark >= pp->high_watermark)
                        perr(s, "[Pool:%s] LowWatermark=%u: expected below HighWatermark=%u", name,
                             pp->low_watermark, pp->high_watermark);
        }
        const char *problem;
        if (telemetry_config_verify(&c->telemetry, &problem) < 0)
                perr(s, "[Backpressure] %s", problem);
}

int config_parse_string(Config *c, const char *text, const char *name, char **errors) {
        /* A file applies over the embedded defaults; it is parsed into a new Config so
         * that a file with errors changes nothing. */
        Config n;
        int r = config_defaults(&n);
        if (r < 0)
                return r;
        ParseState s = { .c = &n, .file = name ? name : "<string>" };
        bool arenas_replaced = false;
        char *buf = strdup(text);
        if (!buf) {
                config_done(&n);
                return -ENOMEM;
        }
        for (char *p = buf, *nl; p; p = nl) {
                nl = strchr(p, '\n');
                if (nl)
                        *nl++ = 0;
                s.line++;
                char *line = strip(p);
                if (!*line || *line == '#' || *line == ';')
                        continue;
                if (strlen(line) > 8192) {
                        perr(&s, "line too long");
                        continue;
                }
                if (*line == '[') {
                        start_section(&s, &arenas_replaced, line);
                        continue;
                }
                char *eq = strchr(line, '=');
                if (!eq) {
                        perr(&s, "expected KEY=VALUE");
                        continue;
                }
                *eq = 0;
                char *key = strip(line), *value = strip(eq + 1);
                if (!s.section[0]) {
                        /* Keys of a section that was itself in error were reported there. */
                        if (!s.section_failed)
                                perr(&s, "%s= outside of a known section", key);
                        continue;
                }
                const ConfigItem *it = NULL;
                for (size_t i = 0; i < ELEMENTSOF(items); i++)
                        if (strcmp(items[i].section, s.section) == 0 &&
                            strcmp(items[i].key, key) == 0)
                                it = &items[i];
                if (!it) {
                        perr(&s, "unknown key %s= in section [%s]", key, s.section);
                        continue;
                }
                void *base = &n;
                if (strcmp(it->section, "Arena") == 0)
                        base = s.arena;
                else if (strcmp(it->section, "Peer") == 0)
                        base = s.peer;
                else if (strcmp(it->section, "Pool") == 0)
                        base = s.pool;
                if (!base)
                        continue;
                if (it->parse(&s, key, value, (char *)base + it->offset) == -ENOMEM)
                        perr(&s, "out of memory");
        }
        free(buf);
        check_complete(&s);

        if (s.n_errors > 0) {
                config_done(&n);
                if (errors)
                        *errors = s.errors;
                else
                        free(s.errors);
                return -EINVAL;
        }
        free(s.errors);
        config_done(c);
        *c = n;
        return 0;
}

int config_parse_file(Config *c, const char *path, char **errors) {
        _cleanup_(freep) char *text = NULL;
        FILE *f = fopen(path, "re");
        if (!f)
                return -errno;
        size_t cap = 0, len = 0;
        char chunk[4096];
        size_t n;
        while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) {
                if (len + n + 1 > cap) {
                        if (len + n > (1u << 20)) {
                                fclose(f);
                                return -EFBIG;
                        }
                        cap = (len + n + 1) * 2;
                        char *t = realloc(text, cap);
                        if (!t) {
                                fclose(f);
                                return -ENOMEM;
                        }
                        text = t;
                }
                memcpy(text + len, chunk, n);
                len += n;
        }
        bool err = ferror(f);
        fclose(f);
        if (err)
                return -EIO;
        if (!text)
                text = strdup("");
        else
                text[len] = 0;
        if (!text)
                return -ENOMEM;
        size_t nul = strlen(text);
        if (nul != len) {
                /* Reported as any other error, with its file and line. */
                unsigned line = 1;
                for (size_t i = 0; i < nul; i++)
                        line += text[i] == '\n';
                if (errors && asprintf(errors, "%s:%u: a NUL byte: the file is not text\n", path, line) < 0) {
                        *errors = NULL;
                        return -ENOMEM;
                }
                return -EINVAL;
        }
        return config_parse_string(c, text, path, errors);
}

static bool str_same(const char *a, const char *b) {
        return a == b || (a && b && strcmp(a, b) == 0);
}

/* What a reload cannot apply, said rather than ignored: how many there were. */
unsigned config_restart_notices(const Config *c, const Config *n) {
        unsigned k = 0;
        bool arenas_same = n->n_arenas == c->n_arenas;
        for (size_t i = 0; arenas_same && i < n->n_arenas; i++)
                arenas_same = strcmp(n->arenas[i].name, c->arenas[i].name) == 0 && n->arenas[i].size == c->arenas[i].size &&
                              n->arenas[i].domain == c->arenas[i].domain && n->arenas[i].usage == c->arenas[i].usage &&
                              n->arenas[i].hugepages == c->arenas[i].hugepages &&
                              n->arenas[i].prefault == c->arenas[i].prefault &&
                              n->arenas[i].numa_node == c->arenas[i].numa_node && n->arenas[i].gpu == c->arenas[i].gpu &&
                              n->arenas[i].page_size == c->arenas[i].page_size;
        bool etcd_same = n->etcd_lease_ttl_usec == c->etcd_lease_ttl_usec && n->max_members == c->max_members &&
                         str_same(n->etcd_prefix, c->etcd_prefix) && str_same(n->etcd_ca_file, c->etcd_ca_file) &&
                         str_same(n->etcd_cert_file, c->etcd_cert_file) &&
                         str_same(n->etcd_key_file, c->etcd_key_file) && !n->etcd_endpoints == !c->etcd_endpoints;
        for (size_t i = 0; etcd_same && n->etcd_endpoints && (n->etcd_endpoints[i] || c->etcd_endpoints[i]); i++)
                etcd_same = str_same(n->etcd_endpoints[i], c->etcd_endpoints[i]);
        bool peers_same = n->n_peers == c->n_peers && str_same(n->listen_address, c->listen_address) &&
                          n->peer_streams == c->peer_streams && n->peer_slice_size == c->peer_slice_size;
        for (size_t i = 0; peers_same && i < n->n_peers; i++)
                peers_same = str_same(n->peers[i].name, c->peers[i].name) &&
                             str_same(n->peers[i].address, c->peers[i].address) &&
                             str_same(n->peers[i].host_id, c->peers[i].host_id);
        struct {
                bool changed;
                const char *what;
        } fixed[] = {
                { !arenas_same, "Arena configuration" },
                { !str_same(n->socket_path, c->socket_path), "Socket=" },
                { !str_same(n->socket_group, c->socket_group), "SocketGroup=" },
                { !str_same(n->host_id, c->host_id), "HostId=" },
                { !str_same(n->state_dir, c->state_dir), "StateDirectory=" },
                { !peers_same, "[Cluster] Listen=, DataStreams=, SliceSize= or the [Peer:] sections" },
                { !str_same(n->cluster_key_file, c->cluster_key_file), "ClusterKeyFile=" },
                { n->transport_policy != c->transport_policy, "[Cluster] Transport=" },
                { !etcd_same, "[Cluster] Etcd=, EtcdPrefix=, EtcdLeaseTTL=, MaxMembers= or the etcd TLS files" },
                { n->gpu_copy_kernel != c->gpu_copy_kernel, "[Gpu] CopyKernel=" },
                { n->feature_store_max_bytes != c->feature_store_max_bytes, "[Features] StoreMaxSize=" },
                { !str_same(n->feature_store_dir, c->feature_store_dir), "[Features] StoreDirectory=" },
                { !str_same(n->metrics_listen, c->metrics_listen), "[Metrics] Listen=" },
                { n->attach_grace_usec != c->attach_grace_usec, "[Limits] AttachGrace=" },
                { n->telemetry.trace_requests != c->telemetry.trace_requests ||
                          n->telemetry.trace_events != c->telemetry.trace_events,
                  "[Telemetry] TraceRequests= or TraceEvents=" },
                { !str_same(n->bus_address, c->bus_address) || n->system_bus != c->system_bus,
                  "BusAddress= or SystemBus=" },
        };
        for (size_t i = 0; i < ELEMENTSOF(fixed); i++)
                if (fixed[i].changed) {
                        log_notice("%s changed: it takes effect at the next restart.", fixed[i].what);
                        k++;
                }
        return k;
}

int config_secret_file_open(const char *path, const char **ret_why) {
        const char *why_dummy;
        struct stat st;

        if (!ret_why)
                ret_why = &why_dummy;
        *ret_why = NULL;
        if (!path)
                return -EINVAL;
        /* O_NONBLOCK: a FIFO given as the key opens at once and is refused below. */
        _cleanup_(closep) int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
        if (fd < 0)
                return -errno;
        if (fstat(fd, &st) < 0)
                return -errno;
        if (!S_ISREG(st.st_mode)) {
                *ret_why = S_ISDIR(st.st_mode) ? "it is a directory, not a file"
                                               : "it is not a regular file (a device, FIFO or socket)";
                return -EINVAL;
        }
        if (st.st_mode & 0077) {
                *ret_why = "it is readable or writable by group or others; chmod 600 it";
                return -EPERM;
        }
        return TAKE_FD(fd);
}
