/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* bench-tcp: the tcp transport between two network namespaces joined by a veth pair,
 * against iperf3 between the same namespaces in the same run.
 *
 *   bench-tcp [--streams 1,4] [--sizes 64K,1M,64M,1G] [--seconds 1.5] [--iperf-seconds 1.5] [--span BYTES] [--no-thp]
 *
 * For each stream count N, a receiver PeerManager
 * (a child process in namespace B) and a sender PeerManager (this process, in namespace
 * A) connect with N data streams; for each write size, iperf3 -P N measures the limit
 * right before and right after, and in between the sender keeps at least 64 MiB (and 2
 * writes) in flight for the given time. A write counts once the receiver
 * has acknowledged that every byte landed. Prints MB/s and the ratio to iperf3.
 * Needs root (ip netns) and iperf3; exits 77 otherwise. */

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "log.h"
#include "macro.h"
#include "parse-util.h"
#include "peer/peer-manager.h"

#define NS_A "epdbench-a"
#define NS_B "epdbench-b"
#define IP_A "10.231.0.1"
#define IP_B "10.231.0.2"
#define PORT 7400
#define MiB (UINT64_C(1) << 20)

static char key_path[] = "/tmp/epd-bench-key-XXXXXX";
static bool arg_thp = true;
static uint64_t arg_span = 0; /* bytes of the region the writes cycle through; 0: all */

static int run(const char *cmd) {
        int r = system(cmd);
        return r == 0 ? 0 : -EIO;
}

static void net_down(void) {
        (void)run("ip netns del " NS_A " 2>/dev/null");
        (void)run("ip netns del " NS_B " 2>/dev/null");
}

static int net_up(void) {
        net_down();
        if (run("ip netns add " NS_A) < 0 || run("ip netns add " NS_B) < 0 ||
            run("ip -n " NS_A " link add eth0 type veth peer name eth0 netns " NS_B) < 0 ||
            run("ip -n " NS_A " addr add " IP_A "/24 dev eth0") < 0 ||
            run("ip -n " NS_B " addr add " IP_B "/24 dev eth0") < 0 ||
            run("ip -n " NS_A " link set eth0 up") < 0 || run("ip -n " NS_B " link set eth0 up") < 0 ||
            run("ip -n " NS_A " link set lo up") < 0 || run("ip -n " NS_B " link set lo up") < 0)
                return -EIO;
        return 0;
}

static int enter_ns(const char *name) {
        char p[128];
        int fd, r;

        snprintf(p, sizeof p, "/run/netns/%s", name);
        fd = open(p, O_RDONLY | O_CLOEXEC);
        if (fd < 0)
                return -errno;
        r = setns(fd, CLONE_NEWNET);
        close(fd);
        return r < 0 ? -errno : 0;
}

/* iperf3 -P n for `seconds`; returns MB/s received, or < 0. */
static double iperf(unsigned n, double seconds) {
        char cmd[512], buf[65536];
        FILE *f;
        size_t len;
        const char *p;
        pid_t server;

        server = fork();
        if (server == 0) {
                int null = open("/dev/null", O_WRONLY | O_CLOEXEC);
                dup2(null, 1);
                dup2(null, 2);
                execlp("ip", "ip", "netns", "exec", NS_B, "iperf3", "-s", "-1", "-p", "7401", NULL);
                _exit(127);
        }
        usleep(300 * 1000);
        snprintf(cmd, sizeof cmd, "ip netns exec " NS_A " iperf3 -c " IP_B " -p 7401 -J -P %u -t %.1f", n, seconds);
        f = popen(cmd, "re");
        if (!f)
                return -1;
        len = fread(buf, 1, sizeof buf - 1, f);
        buf[len] = 0;
        pclose(f);
        waitpid(server, NULL, 0);
        p = strstr(buf, "\"sum_received\"");
        if (!p || !(p = strstr(p, "\"bits_per_second\":")))
                return -1;
        return strtod(p + strlen("\"bits_per_second\":"), NULL) / 8 / 1e6;
}

typedef struct Side {
        sd_event *e;
        PeerManager *pm;
        Transport *t;
        TransportRegion region;
        Peer *peer;
        uint64_t inflight, done_bytes, errors;
} Side;

static int accept_all(Peer *p, TransportIncoming *in, void *ud) {
        return 0;
}

static int side_new(Side *s, const char *self, const char *listen, const char *peer_id, const char *peer_addr,
                    unsigned streams, uint64_t region_size) {
        PeerConfig pc = { .name = (char *)peer_id, .host_id = (char *)peer_id, .address = (char *)peer_addr };
        PeerManagerConfig c = {
                .host_id = self, .listen_address = listen, .peers = &pc, .n_peers = 1,
                .cluster_key_file = key_path, .n_streams = streams,
                /* The sender's loop stands still while iperf3 runs: no false alarms. */
                .heartbeat_usec = 120 * USEC_PER_SEC,
        };
        int r;

        *s = (Side){};
        r = sd_event_new(&s->e);
        if (r < 0)
                return r;
        s->region = (TransportRegion){ .id = 0, .domain = MEMORY_HOST, .size = region_size };
        /* Like an arena with HugePages=try: transparent huge pages where the kernel
         * gives them (madvise mode), so that a 1 GiB region is not 256k TLB entries. */
        s->region.host_base = mmap(NULL, region_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s->region.host_base == MAP_FAILED)
                return -errno;
        if (arg_thp)
                (void)madvise(s->region.host_base, region_size, MADV_HUGEPAGE);
        memset(s->region.host_base, 0x5a, region_size);
        r = peer_manager_new(&s->pm, s->e, &c);
        if (r < 0)
                return r;
        s->t = peer_manager_transport(s->pm);
        r = s->t->ops->register_region(s->t, &s->region);
        if (r < 0)
                return r;
        peer_manager_set_incoming_validator(s->pm, accept_all, NULL);
        s->peer = peer_manager_find(s->pm, peer_id);
        return peer_manager_start(s->pm);
}

static void receiver(unsigned streams, uint64_t region_size, int ctl) {
        Side s;
        char c;

        if (enter_ns(NS_B) < 0 || side_new(&s, "bench-b", IP_B ":7400", "bench-a", IP_A ":7400", streams,
                                           region_size) < 0)
                _exit(1);
        (void)write(ctl, "r", 1);
        /* Runs until the parent closes the pipe. */
        for (;;) {
                if (sd_event_run(s.e, 100 * 1000) < 0)
                        _exit(1);
                if (recv(ctl, &c, 1, MSG_DONTWAIT) == 0)
                        break;
        }
        peer_manager_free(s.pm);
        _exit(0);
}

static void drain(Side *s) {
        TransportCompletion c[512];
        size_t n;

        while ((n = s->t->ops->poll(s->t, c, ELEMENTSOF(c))) > 0)
                for (size_t i = 0; i < n; i++) {
                        s->inflight--;
                        if (c[i].error)
                                s->errors++;
                        else
                                s->done_bytes += c[i].bytes;
                }
}

/* MB/s for writes of `size` over about `seconds`. */
static double measure(Side *s, uint64_t size, double seconds) {
        uint64_t span = arg_span ? MAX(MIN(arg_span, s->region.size), size) : s->region.size;
        uint64_t window = MAX((uint64_t)2, 64 * MiB / size), slots = span / size, posted = 0;
        usec_t start = now_usec(CLOCK_MONOTONIC), stop = start + (usec_t)(seconds * 1e6), end;

        s->done_bytes = s->errors = 0;
        for (;;) {
                usec_t now = now_usec(CLOCK_MONOTONIC);
                while (now < stop && s->inflight < window) {
                        TransportWrite w = {
                                .src_region = 0, .src_offset = (posted % slots) * size, .dst_region = 0,
                                .dst_offset = (posted % slots) * size, .length = size, .cookie = posted,
                        };
                        if (s->t->ops->post(s->t, s->peer, &w, 1) < 0)
                                return -1;
                        posted++;
                        s->inflight++;
                }
                if (now >= stop && s->inflight == 0)
                        break;
                if (sd_event_run(s->e, 1000 * 1000) < 0)
                        return -1;
                drain(s);
                if (!peer_is_up(s->peer))
                        return -1;
        }
        end = now_usec(CLOCK_MONOTONIC);
        if (s->errors)
                return -1;
        return (double)s->done_bytes / (double)(end - start);
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "streams", required_argument, NULL, 's' },
                { "sizes", required_argument, NULL, 'z' },
                { "seconds", required_argument, NULL, 't' },
                { "iperf-seconds", required_argument, NULL, 'i' },
                { "span", required_argument, NULL, 'S' },
                { "no-thp", no_argument, NULL, 'N' },
                {}
        };
        char streams_arg[64] = "1,4", sizes_arg[128] = "64K,1M,64M,1G";
        double seconds = 1.5, iperf_seconds = 1.5;
        uint64_t sizes[16], max_size = 0;
        size_t n_sizes = 0;
        int opt, fd;

        while ((opt = getopt_long(argc, argv, "", opts, NULL)) >= 0)
                switch (opt) {
                case 's':
                        snprintf(streams_arg, sizeof streams_arg, "%s", optarg);
                        break;
                case 'z':
                        snprintf(sizes_arg, sizeof sizes_arg, "%s", optarg);
                        break;
                case 't':
                        seconds = strtod(optarg, NULL);
                        break;
                case 'i':
                        iperf_seconds = strtod(optarg, NULL);
                        break;
                case 'N':
                        arg_thp = false;
                        break;
                case 'S':
                        if (parse_size(optarg, &arg_span) < 0)
                                return 2;
                        break;
                default:
                        return 2;
                }
        for (char *save = NULL, *t = strtok_r(sizes_arg, ",", &save); t && n_sizes < 16;
             t = strtok_r(NULL, ",", &save)) {
                if (parse_size(t, &sizes[n_sizes]) < 0 || sizes[n_sizes] == 0)
                        return fprintf(stderr, "bad size %s\n", t), 2;
                max_size = MAX(max_size, sizes[n_sizes]);
                n_sizes++;
        }
        if (geteuid() != 0) {
                printf("SKIP: needs root for network namespaces\n");
                return 77;
        }
        if (system("command -v iperf3 >/dev/null") != 0) {
                printf("SKIP: iperf3 is not installed\n");
                return 77;
        }
        log_set_max_level(LOG_WARNING);
        signal(SIGPIPE, SIG_IGN);
        fd = mkstemp(key_path);
        if (fd < 0 || write(fd, "bench-key-0123456789abcdef0123456789", 36) != 36)
                return 1;
        close(fd);
        if (net_up() < 0) {
                unlink(key_path);
                printf("SKIP: cannot create network namespaces\n");
                return 77;
        }

        printf("%-8s %-10s %12s %12s %8s\n", "streams", "size", "tcp MB/s", "iperf3 MB/s", "ratio");
        for (char *save = NULL, *t = strtok_r(streams_arg, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
                unsigned streams = (unsigned)strtoul(t, NULL, 10);
                uint64_t region = MAX(max_size, 256 * MiB);
                int sv[2];
                pid_t child;
                Side s;
                char c;

                if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
                        return 1;
                child = fork();
                if (child == 0) {
                        close(sv[0]);
                        receiver(streams, region, sv[1]);
                }
                close(sv[1]);
                if (read(sv[0], &c, 1) != 1 || enter_ns(NS_A) < 0 ||
                    side_new(&s, "bench-a", IP_A ":7400", "bench-b", IP_B ":7400", streams, region) < 0)
                        return 1;
                while (!peer_is_up(s.peer) || peer_n_streams_up(s.peer) < streams)
                        if (sd_event_run(s.e, 100 * 1000) < 0)
                                return 1;
                (void)measure(&s, 1 * MiB, 0.3); /* warm up: slow start, page cache */
                for (size_t i = 0; i < n_sizes; i++) {
                        char sz[32];
                        /* The limit is measured right before and right after, and
                         * averaged: on a shared machine it drifts. */
                        double before = iperf(streams, iperf_seconds);
                        double mbps = measure(&s, sizes[i], seconds);
                        double after = iperf(streams, iperf_seconds);
                        double limit = (before + after) / 2;
                        printf("%-8u %-10s %12.1f %12.1f %8.2f   (iperf3 before %.1f, after %.1f)\n", streams,
                               format_size(sz, sizeof sz, sizes[i]), mbps, limit, limit > 0 ? mbps / limit : 0,
                               before, after);
                        fflush(stdout);
                }
                peer_manager_free(s.pm);
                sd_event_unref(s.e);
                munmap(s.region.host_base, s.region.size);
                close(sv[0]);
                waitpid(child, NULL, 0);
        }
        net_down();
        unlink(key_path);
        return 0;
}
