/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* peer-node: one PeerManager with one host region, driven line by line on stdin, for
 * the multi-host integration tests and bench/bench-tcp.py (each node runs in its own
 * network namespace). It runs the daemon's real peer code (peer.c, transport/tcp.c,
 * auth, topology) without the rest of epdd.
 *
 *   peer-node --host-id ID [--listen ADDR] [--peer NAME=HOSTID@ADDR]... --key FILE
 *             [--heartbeat-ms N] [--streams N] [--slice-size BYTES] [--region-size BYTES]
 *
 * Commands (one per line; each answers one line, "ok ..." or "err ..."):
 *   fill SEED                       fill the region with a pattern
 *   zero                            zero the region
 *   hash OFF LEN                    FNV-1a 64 of a range
 *   post HOST COUNT SIZE SRC DST STRIDE    post COUNT writes (i-th at +i*STRIDE)
 *   validator accept|refuse         answer incoming writes
 *   heartbeat MS                    HeartbeatInterval changed, as a reload (SIGHUP) does
 *   stats                           counters
 *   peers                           one line per peer, then ok
 *   bench HOST SIZE TOTAL WINDOW    stream TOTAL bytes in SIZE writes, WINDOW in flight
 *   say-and-drop HOST N             send N test frames (held for the loop's idle point),
 *                                   then end the session in the same call (peer_down());
 *                                   the receiver counts them in stats' msgs_in, in order
 *   quit
 * Asynchronous lines: "state HOST up|down REASON @SECONDS" (SECONDS: CLOCK_MONOTONIC when
 * the change was seen, so that a test measures the detection, not its own reading of the
 * pipe), "bench-done ...". */

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "log.h"
#include "macro.h"
#include "parse-util.h"
#include "peer/peer-internal.h"
#include "peer/peer-manager.h"
#include "peer/topology.h"
#include "transport/tcp.h"

static struct {
        sd_event *event;
        PeerManager *pm;
        Topology *topo;
        Transport *t;
        TransportRegion region;
        bool refuse;
        uint64_t next_cookie;
        uint64_t out_ok, out_err, out_bytes, in_ok, in_err, in_validated;
        uint64_t msgs_in, msgs_out_of_order; /* test frames (say-and-drop) */
        char input[4096];
        size_t input_len;
        /* bench */
        Peer *b_peer;
        uint64_t b_size, b_total, b_posted, b_done, b_window, b_inflight, b_errors;
        usec_t b_start;
} S;

static void out(const char *fmt, ...) _printf_(1, 2);
static void out(const char *fmt, ...) {
        va_list ap;
        va_start(ap, fmt);
        vprintf(fmt, ap);
        va_end(ap);
        putchar('\n');
        fflush(stdout);
}

static void on_state(Peer *p, bool up, void *userdata) {
        usec_t t = now_usec(CLOCK_MONOTONIC);
        out("state %s %s %s @%" PRIu64 ".%06" PRIu64, peer_host_id(p), up ? "up" : "down",
            up ? "-" : peer_last_error(p), t / USEC_PER_SEC, t % USEC_PER_SEC);
}

static int validator(Peer *p, TransportIncoming *in, void *ud) {
        S.in_validated++;
        return S.refuse ? -EPERM : 0;
}

/* say-and-drop's frames: a sequence number each, counted in order. */
#define TEST_MSG 0x0f00
static int on_test_msg(Peer *p, uint16_t type, const void *payload, size_t len, void *ud) {
        uint64_t seq;
        if (len != sizeof seq)
                return -EBADMSG;
        memcpy(&seq, payload, sizeof seq);
        if (seq != S.msgs_in)
                S.msgs_out_of_order++;
        S.msgs_in = seq + 1;
        return 0;
}

static void incoming_done(Peer *p, const TransportIncoming *in, int error, void *ud) {
        if (error)
                S.in_err++;
        else
                S.in_ok++;
}

static void bench_pump(void) {
        uint64_t slots = S.region.size / S.b_size;

        while (S.b_peer && S.b_inflight < S.b_window && S.b_posted * S.b_size < S.b_total) {
                uint64_t off = (S.b_posted % slots) * S.b_size;
                TransportWrite w = {
                        .src_region = 0, .src_offset = off, .dst_region = 0, .dst_offset = off,
                        .length = S.b_size, .cookie = UINT64_C(1) << 63 | S.b_posted,
                };
                int r = S.t->ops->post(S.t, S.b_peer, &w, 1);
                if (r < 0) {
                        out("bench-done err %d", r);
                        S.b_peer = NULL;
                        return;
                }
                S.b_posted++;
                S.b_inflight++;
        }
}

static int on_completion(sd_event_source *s, int fd, uint32_t revents, void *ud) {
        TransportCompletion c[256];
        size_t n;

        while ((n = S.t->ops->poll(S.t, c, ELEMENTSOF(c))) > 0)
                for (size_t i = 0; i < n; i++) {
                        if (c[i].error) {
                                S.out_err++;
                        } else {
                                S.out_ok++;
                                S.out_bytes += c[i].bytes;
                        }
                        if (c[i].cookie >> 63) {
                                S.b_inflight--;
                                S.b_done++;
                                if (c[i].error)
                                        S.b_errors++;
                        }
                }
        if (S.b_peer) {
                if (S.b_done * S.b_size >= S.b_total) {
                        usec_t el = now_usec(CLOCK_MONOTONIC) - S.b_start;
                        out("bench-done size=%" PRIu64 " bytes=%" PRIu64 " usec=%" PRIu64 " errors=%" PRIu64
                            " MBps=%.1f",
                            S.b_size, S.b_done * S.b_size, el, S.b_errors,
                            (double)(S.b_done * S.b_size) / (double)MAX(el, (usec_t)1));
                        S.b_peer = NULL;
                } else
                        bench_pump();
        }
        return 0;
}

static uint64_t fnv(const uint8_t *p, uint64_t n) {
        uint64_t h = 1469598103934665603ULL;
        for (uint64_t i = 0; i < n; i++) {
                h ^= p[i];
                h *= 1099511628211ULL;
        }
        return h;
}

static void command(char *line) {
        char *argv[8] = {};
        int argc = 0;
        char *save = NULL;

        for (char *tok = strtok_r(line, " \t", &save); tok && argc < 8; tok = strtok_r(NULL, " \t", &save))
                argv[argc++] = tok;
        if (argc == 0)
                return;

        if (strcmp(argv[0], "fill") == 0 && argc == 2) {
                uint64_t x = strtoull(argv[1], NULL, 0) | 1;
                uint64_t *p = S.region.host_base;
                for (uint64_t i = 0; i < S.region.size / 8; i++) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        p[i] = x;
                }
                out("ok");
        } else if (strcmp(argv[0], "zero") == 0) {
                memset(S.region.host_base, 0, S.region.size);
                out("ok");
        } else if (strcmp(argv[0], "hash") == 0 && argc == 3) {
                uint64_t off = strtoull(argv[1], NULL, 0), len = strtoull(argv[2], NULL, 0);
                if (off > S.region.size || len > S.region.size - off)
                        out("err range");
                else
                        out("ok %016" PRIx64, fnv((uint8_t *)S.region.host_base + off, len));
        } else if (strcmp(argv[0], "post") == 0 && argc == 7) {
                Peer *p = peer_manager_find(S.pm, argv[1]);
                uint64_t count = strtoull(argv[2], NULL, 0), size = strtoull(argv[3], NULL, 0),
                         src = strtoull(argv[4], NULL, 0), dst = strtoull(argv[5], NULL, 0),
                         stride = strtoull(argv[6], NULL, 0);
                TransportWrite *w;
                int r;

                if (!p || count == 0 || count > 65536) {
                        out("err args");
                        return;
                }
                w = calloc(count, sizeof *w);
                if (!w) {
                        out("err nomem");
                        return;
                }
                for (uint64_t i = 0; i < count; i++)
                        w[i] = (TransportWrite){
                                .src_region = 0, .src_offset = src + i * stride, .dst_region = 0,
                                .dst_offset = dst + i * stride, .length = size, .cookie = S.next_cookie++,
                        };
                r = S.t->ops->post(S.t, p, w, count);
                free(w);
                if (r < 0)
                        out("err %s", strerror(-r));
                else
                        out("ok");
        } else if (strcmp(argv[0], "heartbeat") == 0 && argc == 2) {
                peer_manager_set_heartbeat(S.pm, strtoull(argv[1], NULL, 10) * USEC_PER_MSEC);
                out("ok");
        } else if (strcmp(argv[0], "validator") == 0 && argc == 2) {
                S.refuse = strcmp(argv[1], "refuse") == 0;
                out("ok");
        } else if (strcmp(argv[0], "stats") == 0) {
                uint64_t refused = 0, auth = 0, missed = 0;
                for (size_t i = 0; peer_manager_peer(S.pm, i); i++) {
                        const PeerStats *st = peer_stats(peer_manager_peer(S.pm, i));
                        refused += st->writes_refused;
                        auth += st->auth_failures;
                        missed += st->heartbeats_missed;
                }
                out("ok out_ok=%" PRIu64 " out_err=%" PRIu64 " out_bytes=%" PRIu64 " in_ok=%" PRIu64
                    " in_err=%" PRIu64 " in_validated=%" PRIu64 " refused=%" PRIu64 " auth_failures=%" PRIu64
                    " heartbeats_missed=%" PRIu64 " msgs_in=%" PRIu64 " msgs_out_of_order=%" PRIu64,
                    S.out_ok, S.out_err, S.out_bytes, S.in_ok, S.in_err, S.in_validated, refused, auth, missed,
                    S.msgs_in, S.msgs_out_of_order);
        } else if (strcmp(argv[0], "peers") == 0) {
                Peer *p;
                for (size_t i = 0; (p = peer_manager_peer(S.pm, i)); i++) {
                        uint64_t o = 0, in = 0;
                        const TopologyPath *path = S.topo ? topology_path(S.topo, peer_host_id(p)) : NULL;
                        tcp_transport_peer_inflight(S.t, p, &o, &in);
                        out("peer %s %s %s streams=%u out=%" PRIu64 " in=%" PRIu64 " iface=%s reason=\"%s\" err=\"%s\"",
                            peer_name(p), peer_host_id(p), peer_state_to_string(peer_state(p)), peer_n_streams_up(p),
                            o, in, path && path->ifname[0] ? path->ifname : "-", path ? path->reason : "-",
                            peer_last_error(p));
                }
                out("ok");
        } else if (strcmp(argv[0], "bench") == 0 && argc == 5) {
                Peer *p = peer_manager_find(S.pm, argv[1]);
                S.b_size = strtoull(argv[2], NULL, 0);
                S.b_total = strtoull(argv[3], NULL, 0);
                S.b_window = strtoull(argv[4], NULL, 0);
                if (!p || S.b_size == 0 || S.b_size > S.region.size || S.b_window == 0) {
                        out("err args");
                        return;
                }
                S.b_posted = S.b_done = S.b_inflight = S.b_errors = 0;
                S.b_peer = p;
                S.b_start = now_usec(CLOCK_MONOTONIC);
                out("ok");
                bench_pump();
        } else if (strcmp(argv[0], "say-and-drop") == 0 && argc == 3) {
                Peer *p = peer_manager_find(S.pm, argv[1]);
                uint64_t n = strtoull(argv[2], NULL, 0);
                int r = 0;
                if (!p || !peer_is_up(p)) {
                        out("err not up");
                        return;
                }
                for (uint64_t seq = 0; r >= 0 && seq < n; seq++)
                        r = peer_send(p, TEST_MSG, &seq, sizeof seq);
                if (r < 0) {
                        out("err %s", strerror(-r));
                        return;
                }
                peer_down(p, -ECONNRESET, "dropped by the test");
                out("ok");
        } else if (strcmp(argv[0], "quit") == 0) {
                out("ok");
                sd_event_exit(S.event, 0);
        } else
                out("err unknown command");
}

static int on_stdin(sd_event_source *s, int fd, uint32_t revents, void *ud) {
        ssize_t n = read(fd, S.input + S.input_len, sizeof S.input - 1 - S.input_len);
        char *nl;

        if (n <= 0) {
                sd_event_exit(S.event, 0);
                return 0;
        }
        S.input_len += (size_t)n;
        S.input[S.input_len] = 0;
        while ((nl = strchr(S.input, '\n'))) {
                *nl = 0;
                command(S.input);
                memmove(S.input, nl + 1, S.input_len - (size_t)(nl + 1 - S.input) + 1);
                S.input_len -= (size_t)(nl + 1 - S.input);
        }
        if (S.input_len == sizeof S.input - 1)
                S.input_len = 0;
        return 0;
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "host-id", required_argument, NULL, 'i' },
                { "listen", required_argument, NULL, 'l' },
                { "peer", required_argument, NULL, 'p' },
                { "key", required_argument, NULL, 'k' },
                { "heartbeat-ms", required_argument, NULL, 'h' },
                { "streams", required_argument, NULL, 's' },
                { "slice-size", required_argument, NULL, 'S' },
                { "region-size", required_argument, NULL, 'r' },
                { "verbose", no_argument, NULL, 'v' },
                {}
        };
        PeerManagerConfig c = {};
        PeerConfig peers[16] = {};
        uint64_t region_size = 64 << 20, slice = 0;
        int r, opt;

        log_set_max_level(LOG_NOTICE);
        while ((opt = getopt_long(argc, argv, "", opts, NULL)) >= 0) {
                switch (opt) {
                case 'i':
                        c.host_id = optarg;
                        break;
                case 'l':
                        c.listen_address = optarg;
                        break;
                case 'p': {
                        char *eq = strchr(optarg, '='), *at = strchr(optarg, '@');
                        if (!eq || !at || at < eq || c.n_peers >= ELEMENTSOF(peers))
                                return fprintf(stderr, "bad --peer %s\n", optarg), 2;
                        *eq = *at = 0;
                        peers[c.n_peers++] = (PeerConfig){ .name = optarg, .host_id = eq + 1, .address = at + 1 };
                        break;
                }
                case 'k':
                        c.cluster_key_file = optarg;
                        break;
                case 'h':
                        c.heartbeat_usec = strtoull(optarg, NULL, 10) * USEC_PER_MSEC;
                        break;
                case 's':
                        c.n_streams = (unsigned)strtoul(optarg, NULL, 10);
                        break;
                case 'S':
                        if (parse_size(optarg, &slice) < 0 || slice > UINT32_MAX)
                                return fprintf(stderr, "bad --slice-size\n"), 2;
                        c.slice_size = (uint32_t)slice;
                        break;
                case 'r':
                        if (parse_size(optarg, &region_size) < 0)
                                return fprintf(stderr, "bad --region-size\n"), 2;
                        break;
                case 'v':
                        log_set_max_level(LOG_DEBUG);
                        break;
                default:
                        return 2;
                }
        }
        c.peers = peers;

        r = sd_event_default(&S.event);
        if (r < 0)
                return 1;
        S.region = (TransportRegion){ .id = 0, .domain = MEMORY_HOST, .size = region_size };
        S.region.host_base = mmap(NULL, region_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
        if (S.region.host_base == MAP_FAILED)
                return 1;
        r = peer_manager_new(&S.pm, S.event, &c);
        if (r < 0) {
                log_error_errno(r, "peer manager: %m");
                return 1;
        }
        S.t = peer_manager_transport(S.pm);
        r = S.t->ops->register_region(S.t, &S.region);
        if (r < 0)
                return 1;
        peer_manager_add_state_handler(S.pm, on_state, NULL);
        peer_manager_set_incoming_validator(S.pm, validator, NULL);
        peer_manager_set_incoming_done(S.pm, incoming_done, NULL);
        r = peer_manager_register_handler(S.pm, TEST_MSG, TEST_MSG, on_test_msg, NULL);
        if (r < 0)
                return fprintf(stderr, "register handler: %s\n", strerror(-r)), 1;
        r = sd_event_add_io(S.event, NULL, S.t->ops->completion_fd(S.t), EPOLLIN, on_completion, NULL);
        if (r < 0)
                return 1;
        r = sd_event_add_io(S.event, NULL, STDIN_FILENO, EPOLLIN, on_stdin, NULL);
        if (r < 0)
                return 1;
        r = topology_new(&S.topo, S.event, S.pm);
        if (r < 0)
                log_warning_errno(r, "topology unavailable: %m");
        r = peer_manager_start(S.pm);
        if (r < 0)
                return 1;
        out("ready");
        r = sd_event_loop(S.event);
        topology_free(S.topo);
        peer_manager_free(S.pm);
        sd_event_unref(S.event);
        return r < 0 ? 1 : 0;
}
