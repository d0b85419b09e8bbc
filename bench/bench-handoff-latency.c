/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* bench-handoff-latency: small handoffs end to end through libepd, as workers make
 * them: a prefill client on one epdd and a decode client on another (or the same) epdd,
 * both in this process. Per handoff:
 *
 *   decode   ring ACCEPT(request)           (the decode worker waits without polling)
 *   prefill  Prepare(request, dest, seq, groups, ready=all | then ring LayerGroupReady)
 *   decode   ring: ACCEPTED, progress ... groups [0, G) landed   -> first, all landed
 *   decode   ring COMMIT with release (answered once durable: the decode sequence),
 *            release the decode sequence
 *            (--bus-commit: Accept, for the offsets and path, then CommitAndRelease on
 *            the bus, as before 2026-12-04)
 *   prefill  ring: committed (prepared with release_on_commit: no Release call)
 *
 * Latency is from the Prepare call to the decode worker's ring record saying the first
 * group, and every group, landed (both clients in one process: one clock; the decode
 * worker waits on its ring in a thread of its own while the prefill calls Prepare);
 * prepare_* is the Prepare call itself. With
 * --inflight K, K threads (each a prefill and a decode client) run the loop at once
 * and the figure is handoffs per second. bench-handoff-netns.py runs it between two
 * network namespaces beside the bare TCP ping-pong and iperf3 limits.
 *
 *   bench-handoff-latency --prefill ADDR --decode ADDR [--dest HOST] [--arena A]
 *       [--dest-arena A] [--pages P] [--layers L] [--groups G] [--layer-bytes B]
 *       [--count N] [--inflight K] [--warmup W] [--ring-ready] [--bus-commit]
 *
 * Prints "RESULT key=value ..." (latencies in microseconds). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "epd/epd.h"
#include "epd/handoff.h"

static const char *arg_prefill, *arg_decode, *arg_dest = "", *arg_arena = "kv0", *arg_dest_arena;
static unsigned arg_pages = 1, arg_layers = 8, arg_groups = 4, arg_count = 1000, arg_inflight = 1, arg_warmup = 50;
static uint64_t arg_layer_bytes = 8192; /* K and V of one layer of one page */
static bool arg_ring_ready, arg_bus_commit;

static uint64_t now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void die(epd_client *c, int r, const char *what) {
        fprintf(stderr, "bench-handoff-latency: %s: %s %s\n", what,
                c && epd_last_error_name(c) ? epd_last_error_name(c) : strerror(-r),
                c && epd_last_error_message(c) ? epd_last_error_message(c) : "");
        exit(1);
}

typedef struct Worker {
        unsigned id;
        unsigned count;
        uint64_t *first_ns, *all_ns, *prepare_ns; /* per handoff, after the warmup */
        unsigned done;
        pthread_t thread;
        /* The decode worker: its own thread, waiting on its ring while the prefill
         * thread calls Prepare (two processes in a real deployment). */
        pthread_t decode_thread;
        pthread_barrier_t accepted, landed;
        epd_ring_client *dr;
        const char *rid;
        struct DecodeWait *dw;
} Worker;

static pthread_barrier_t start;

/* Each maps one arena (an arena holds pages of one size): the prefill the source's,
 * the decode worker the one the pages land in. */
static epd_client *connect_as(const char *address, const char *role, const char *arena) {
        const char *arenas[] = { arena, NULL };
        epd_client *c = NULL;
        /* tokens_per_block 16, K and V: layer_bytes / 32 bytes per token each */
        epd_kv_layout kv = { .layers = arg_layers, .tokens_per_block = 16,
                             .k_bytes_per_token = (uint32_t)(arg_layer_bytes / 32),
                             .v_bytes_per_token = (uint32_t)(arg_layer_bytes / 32), .dtype = "bfloat16" };
        int r = epd_connect(address, &c);
        if (r < 0)
                die(NULL, r, "connect");
        r = epd_register(c, role, "bench", "cpu", &kv, arenas);
        if (r < 0)
                die(c, r, "register");
        return c;
}

/* Takes ring records until fn says done; returns the time of the record that did it. */
typedef bool (*RecordFn)(const struct epd_ring_record *rec, void *userdata);

static void ring_until(epd_ring_client *r, RecordFn fn, void *userdata, const char *what) {
        for (;;) {
                struct epd_ring_record rec;
                int k = epd_ring_next(r, &rec, 10 * 1000000ULL);
                if (k == -EAGAIN) {
                        fprintf(stderr, "bench-handoff-latency: no %s within 10 s\n", what);
                        exit(1);
                }
                if (k < 0)
                        die(NULL, k, "ring");
                if (fn(&rec, userdata))
                        return;
        }
}

struct DecodeWait;
typedef struct DecodeWait {
        uint64_t token;
        uint32_t groups;
        bool accepted;
        uint64_t first_ns, all_ns;
} DecodeWait;

static bool decode_record(const struct epd_ring_record *rec, void *userdata) {
        DecodeWait *w = userdata;
        uint64_t t = now_ns();
        uint32_t done = 0;
        if (rec->opcode == EPD_RING_EV_COMPLETION && rec->result < 0) {
                fprintf(stderr, "bench-handoff-latency: ring accept failed: %s\n", strerror(-rec->result));
                exit(1);
        }
        if (rec->opcode == EPD_RING_EV_HANDOFF_ACCEPTED) {
                w->accepted = true;
                w->token = rec->token;
                done = rec->group;
        } else if (rec->opcode == EPD_RING_EV_GROUP_PROGRESS && w->accepted && rec->token == w->token)
                done = rec->group;
        else if (rec->opcode == EPD_RING_EV_HANDOFF_STATE && w->accepted && rec->token == w->token &&
                 rec->arg0 == EPD_HANDOFF_STATE_ROLLED_BACK) {
                fprintf(stderr, "bench-handoff-latency: handoff rolled back (cause %" PRIu64 ")\n", rec->arg1);
                exit(1);
        }
        if (done >= 1 && !w->first_ns)
                w->first_ns = t;
        if (done >= w->groups && !w->all_ns)
                w->all_ns = t;
        return w->all_ns != 0;
}

typedef struct CommitWait {
        uint64_t user_data;
        int result;
        char sequence[EPD_RING_SEQUENCE_PATH_MAX];
} CommitWait;

static bool commit_record(const struct epd_ring_record *rec, void *userdata) {
        CommitWait *w = userdata;
        if (rec->opcode != EPD_RING_EV_COMPLETION || rec->user_data != w->user_data)
                return false; /* this handoff's later progress or state: not needed */
        w->result = rec->result;
        if (rec->result >= 0)
                (void)epd_ring_record_sequence_path(rec, w->sequence, sizeof w->sequence);
        return true;
}

typedef struct SourceWait {
        uint64_t token;
} SourceWait;

static bool source_record(const struct epd_ring_record *rec, void *userdata) {
        SourceWait *w = userdata;
        if (rec->opcode != EPD_RING_EV_HANDOFF_STATE || rec->token != w->token)
                return false;
        if (rec->arg0 == EPD_HANDOFF_STATE_ROLLED_BACK) {
                fprintf(stderr, "bench-handoff-latency: source rolled back (cause %" PRIu64 ")\n", rec->arg1);
                exit(1);
        }
        return rec->arg0 == EPD_HANDOFF_STATE_COMMITTED;
}

static void *decode_worker(void *userdata) {
        Worker *w = userdata;
        for (unsigned i = 0; i < arg_warmup + w->count; i++) {
                /* The ring ACCEPT is queued before the prefill prepares. */
                pthread_barrier_wait(&w->accepted);
                ring_until(w->dr, decode_record, w->dw, "progress");
                pthread_barrier_wait(&w->landed);
        }
        return NULL;
}

static void *worker(void *userdata) {
        Worker *w = userdata;
        epd_client *p = connect_as(arg_prefill, "prefill", arg_arena),
                   *d = connect_as(arg_decode, "decode", arg_dest_arena ? arg_dest_arena : arg_arena);
        epd_ring_client *pr, *dr;
        int r;
        if ((r = epd_ring_open(p, 64, 1024, &pr)) < 0)
                die(p, r, "open ring");
        if ((r = epd_ring_open(d, 64, 1024, &dr)) < 0)
                die(d, r, "open ring");
        w->dr = dr;
        pthread_barrier_init(&w->accepted, NULL, 2);
        pthread_barrier_init(&w->landed, NULL, 2);
        if (pthread_create(&w->decode_thread, NULL, decode_worker, w) != 0)
                die(NULL, -errno, "thread");
        char *seq = NULL;
        uint32_t *pages = NULL;
        size_t n;
        if ((r = epd_sequence_create(p, arg_arena, arg_pages, &seq, &pages, &n)) < 0)
                die(p, r, "create sequence");
        uint32_t groups[1024];
        for (unsigned g = 0; g < arg_groups; g++)
                groups[g] = arg_layers / arg_groups + (g < arg_layers % arg_groups);
        epd_handoff_options o = { .arena = arg_dest_arena, .ready = arg_ring_ready ? 0 : arg_groups,
                                  .release_on_commit = true };
        pthread_barrier_wait(&start);

        for (unsigned i = 0; i < arg_warmup + w->count; i++) {
                char rid[33];
                snprintf(rid, sizeof rid, "%08x%08x%016x", (unsigned)getpid(), w->id, i + 1);
                DecodeWait dw = { .groups = arg_groups };
                if ((r = epd_ring_accept(dr, rid, 10 * 1000000ULL, i)) < 0)
                        die(d, r, "ring accept");
                w->dw = &dw;
                pthread_barrier_wait(&w->accepted);
                char *path = NULL;
                uint64_t token, t0 = now_ns();
                for (;;) {
                        r = epd_handoff_prepare(p, rid, arg_dest, seq, groups, arg_groups, &o, &path, &token);
                        if (r >= 0 || !epd_last_error_name(p) ||
                            strcmp(epd_last_error_name(p), "org.epd1.Error.Backpressure") != 0)
                                break;
                        /* A full window: retry after what the daemon asks, as workers do. */
                        uint64_t retry = epd_last_error_retry_after_usec(p);
                        usleep((useconds_t)(retry ? (retry < 100000 ? retry : 100000) : 100));
                        t0 = now_ns();
                }
                if (r < 0)
                        die(p, r, "prepare");
                uint64_t t_prepared = now_ns();
                if (arg_ring_ready)
                        for (unsigned g = 0; g < arg_groups; g++)
                                if ((r = epd_ring_layer_group_ready(pr, rid, token, g, 0)) < 0)
                                        die(p, r, "ring layer group ready");
                pthread_barrier_wait(&w->landed);
                /* The decode thread takes no record until the next ACCEPT: this thread
                 * may wait on its ring meanwhile. */
                epd_handoff_accepted acc = {};
                char *dseq = NULL;
                if (arg_bus_commit) {
                        if ((r = epd_handoff_accept(d, rid, &acc)) < 0)
                                die(d, r, "accept");
                        if ((r = epd_handoff_commit_and_release(d, acc.path, &dseq)) < 0)
                                die(d, r, "commit");
                } else {
                        CommitWait cw = { .user_data = UINT64_C(1) << 63 | i };
                        if ((r = epd_ring_commit(dr, rid, dw.token, 1, cw.user_data)) < 0)
                                die(d, r, "ring commit");
                        ring_until(dr, commit_record, &cw, "the commit's answer");
                        if (cw.result < 0)
                                die(NULL, cw.result, "ring commit");
                        dseq = strdup(cw.sequence);
                }
                if ((r = epd_sequence_release(d, dseq)) < 0)
                        die(d, r, "release (decode sequence)");
                SourceWait sw = { token };
                ring_until(pr, source_record, &sw, "commit at the source");
                if (i >= arg_warmup) {
                        w->first_ns[w->done] = dw.first_ns - t0;
                        w->all_ns[w->done] = dw.all_ns - t0;
                        w->prepare_ns[w->done] = t_prepared - t0;
                        w->done++;
                }
                free(dseq);
                free(path);
                epd_handoff_accepted_done(&acc);
        }
        pthread_join(w->decode_thread, NULL);
        epd_sequence_release(p, seq);
        free(seq);
        free(pages);
        epd_ring_close(pr);
        epd_ring_close(dr);
        epd_disconnect(p);
        epd_disconnect(d);
        return NULL;
}

static int cmp_u64(const void *a, const void *b) {
        uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
        return x < y ? -1 : x > y;
}

static void stats(const char *name, uint64_t *v, size_t n) {
        double sum = 0;
        qsort(v, n, sizeof *v, cmp_u64);
        for (size_t i = 0; i < n; i++)
                sum += (double)v[i];
        printf(" %s_mean=%.1f %s_p50=%.1f %s_p99=%.1f", name, sum / (double)n / 1e3, name, (double)v[n / 2] / 1e3,
               name, (double)v[(n * 99) / 100 < n ? (n * 99) / 100 : n - 1] / 1e3);
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "prefill", required_argument, NULL, 'p' },   { "decode", required_argument, NULL, 'd' },
                { "dest", required_argument, NULL, 'D' },      { "arena", required_argument, NULL, 'a' },
                { "dest-arena", required_argument, NULL, 'A' }, { "pages", required_argument, NULL, 'P' },
                { "layers", required_argument, NULL, 'L' },    { "groups", required_argument, NULL, 'G' },
                { "layer-bytes", required_argument, NULL, 'B' }, { "count", required_argument, NULL, 'n' },
                { "inflight", required_argument, NULL, 'k' },  { "warmup", required_argument, NULL, 'w' },
                { "ring-ready", no_argument, NULL, 'r' },      { "bus-commit", no_argument, NULL, 'b' },
                {},
        };
        int c;
        while ((c = getopt_long(argc, argv, "", opts, NULL)) >= 0)
                switch (c) {
                case 'p': arg_prefill = optarg; break;
                case 'd': arg_decode = optarg; break;
                case 'D': arg_dest = optarg; break;
                case 'a': arg_arena = optarg; break;
                case 'A': arg_dest_arena = optarg; break;
                case 'P': arg_pages = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'L': arg_layers = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'G': arg_groups = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'B': arg_layer_bytes = strtoull(optarg, NULL, 0); break;
                case 'n': arg_count = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'k': arg_inflight = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'w': arg_warmup = (unsigned)strtoul(optarg, NULL, 0); break;
                case 'r': arg_ring_ready = true; break;
                case 'b': arg_bus_commit = true; break;
                default: return 2;
                }
        if (!arg_prefill || !arg_decode || arg_groups == 0 || arg_groups > arg_layers || arg_groups > 1024 ||
            arg_inflight == 0 || arg_count < arg_inflight || arg_layer_bytes % 64 != 0) {
                fprintf(stderr, "usage: see the comment at the top of bench/bench-handoff-latency.c\n");
                return 2;
        }
        Worker *w = calloc(arg_inflight, sizeof *w);
        pthread_barrier_init(&start, NULL, arg_inflight + 1);
        for (unsigned i = 0; i < arg_inflight; i++) {
                w[i].id = i;
                w[i].count = arg_count / arg_inflight;
                w[i].first_ns = calloc(w[i].count, sizeof(uint64_t));
                w[i].all_ns = calloc(w[i].count, sizeof(uint64_t));
                w[i].prepare_ns = calloc(w[i].count, sizeof(uint64_t));
                if (pthread_create(&w[i].thread, NULL, worker, &w[i]) != 0)
                        return 1;
        }
        pthread_barrier_wait(&start);
        uint64_t t0 = now_ns();
        for (unsigned i = 0; i < arg_inflight; i++)
                pthread_join(w[i].thread, NULL);
        double secs = (double)(now_ns() - t0) / 1e9;
        size_t total = 0;
        for (unsigned i = 0; i < arg_inflight; i++)
                total += w[i].done;
        uint64_t *first = calloc(total, sizeof *first), *all = calloc(total, sizeof *all),
                 *prep = calloc(total, sizeof *prep);
        size_t k = 0;
        for (unsigned i = 0; i < arg_inflight; i++)
                for (unsigned j = 0; j < w[i].done; j++, k++) {
                        first[k] = w[i].first_ns[j];
                        all[k] = w[i].all_ns[j];
                        prep[k] = w[i].prepare_ns[j];
                }
        uint64_t bytes = (uint64_t)arg_pages * arg_layers * arg_layer_bytes;
        printf("RESULT handoffs=%zu inflight=%u groups=%u bytes=%" PRIu64 " per_s=%.0f", total, arg_inflight,
               arg_groups, bytes, (double)(total + (size_t)arg_warmup * arg_inflight) / secs);
        stats("first", first, total);
        stats("all", all, total);
        stats("prepare", prep, total);
        printf(" mib_s=%.1f\n", (double)bytes * (double)(total + (size_t)arg_warmup * arg_inflight) / secs / 1048576.0);
        return 0;
}
