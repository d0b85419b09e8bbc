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
 * and the figure is handoffs per second. --pipeline K keeps K in flight from one thread
 * instead, on one prefill and one decode connection and ring, as a worker that pipelines
 * its requests does: Prepare sent without waiting (epd_handoff_prepare_async), the
 * decode's accept, progress and commit on its ring, its sequence released without
 * waiting; warm-up W x K handoffs, then COUNT measured. bench-handoff-netns.py runs it between two
 * network namespaces beside the bare TCP ping-pong and iperf3 limits.
 *
 *   bench-handoff-latency --prefill ADDR --decode ADDR [--dest HOST] [--arena A]
 *       [--dest-arena A] [--pages P] [--layers L] [--groups G] [--layer-bytes B]
 *       [--count N] [--inflight K | --pipeline K] [--warmup W] [--ring-ready] [--bus-commit]
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
static bool arg_ring_ready, arg_bus_commit, arg_pipeline;

static uint64_t now_ns(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* Layers per group: arg_layers spread over arg_groups, the first groups one more. */
static void layer_groups(uint32_t *groups) {
        for (unsigned g = 0; g < arg_groups; g++)
                groups[g] = arg_layers / arg_groups + (g < arg_layers % arg_groups);
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
        layer_groups(groups);
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

static void stats(const char *name, uint64_t *v, size_t n);

/* ---- --pipeline K: one thread, one prefill and one decode connection and ring, K
 * handoffs in flight on them, as a worker that pipelines its requests does (Prepare
 * without waiting for its answer, everything else on the rings). ---- */

typedef struct Slot {
        unsigned idx, serial;
        char rid[33];
        char *seq;                    /* its source sequence (handed off again and again) */
        uint64_t token, dtoken;       /* source (Prepare's answer), destination (ACCEPTED) */
        uint64_t t0, t_first, t_all, t_prepared;
        bool prepared, src_committed, commit_done, busy;
        uint64_t retry_at;            /* Prepare refused with Backpressure: again at */
} Slot;

typedef struct Pipe {
        epd_client *p, *d;
        epd_ring_client *pr, *dr;
        Slot *slots;
        unsigned started, done, measured;
        uint64_t *first_ns, *all_ns, *prepare_ns;
        uint64_t *early;              /* sources seen committed before their Prepare's answer (K at most) */
        unsigned n_early;
        uint64_t t_measure;
} Pipe;

static Pipe pipe_;

#define COMMIT_TAG (UINT64_C(1) << 63)

static void pipe_prepared(epd_client *c, int error, const char *path, uint64_t token, void *userdata) {
        Slot *s = userdata;
        if (error < 0) {
                const char *name = epd_last_error_name(c);
                if (!name || strcmp(name, "org.epd1.Error.Backpressure") != 0)
                        die(c, error, "prepare (pipelined)");
                /* A full window: again after what the daemon asks, as workers do. */
                uint64_t retry = epd_last_error_retry_after_usec(c);
                s->retry_at = now_ns() + (retry ? (retry < 100000 ? retry : 100000) : 100) * 1000;
                return;
        }
        s->prepared = true;
        s->token = token;
        s->t_prepared = now_ns();
        for (unsigned i = 0; i < pipe_.n_early; i++)
                if (pipe_.early[i] == token) {
                        s->src_committed = true;
                        pipe_.early[i] = pipe_.early[--pipe_.n_early];
                        break;
                }
}

static void pipe_prepare(Slot *s) {
        epd_handoff_options o = { .arena = arg_dest_arena, .ready = arg_groups, .release_on_commit = true };
        uint32_t groups[1024];
        layer_groups(groups);
        s->retry_at = 0;
        int r = epd_handoff_prepare_async(pipe_.p, s->rid, arg_dest, s->seq, groups, arg_groups, &o, pipe_prepared, s);
        if (r < 0)
                die(pipe_.p, r, "prepare (pipelined)");
}

static void pipe_start(Slot *s) {
        s->serial++;
        snprintf(s->rid, sizeof s->rid, "%08x%08x%016x", (unsigned)getpid(), s->idx, s->serial);
        s->token = s->dtoken = 0;
        s->t_first = s->t_all = 0;
        s->prepared = s->src_committed = s->commit_done = false;
        s->busy = true;
        pipe_.started++;
        int r = epd_ring_accept(pipe_.dr, s->rid, 10 * 1000000ULL, s->idx);
        if (r < 0)
                die(pipe_.d, r, "ring accept (pipelined)");
        s->t0 = now_ns();
        pipe_prepare(s);
}

static Slot *slot_of_dtoken(uint64_t token) {
        for (unsigned i = 0; i < arg_inflight; i++)
                if (pipe_.slots[i].busy && pipe_.slots[i].dtoken == token)
                        return &pipe_.slots[i];
        return NULL;
}

static void pipe_progress(Slot *s, uint32_t done) {
        uint64_t t = now_ns();
        if (done >= 1 && !s->t_first)
                s->t_first = t;
        if (done >= arg_groups && !s->t_all) {
                s->t_all = t;
                int r = epd_ring_commit(pipe_.dr, s->rid, s->dtoken, 1, COMMIT_TAG | s->idx);
                if (r < 0)
                        die(pipe_.d, r, "ring commit (pipelined)");
        }
}

static void pipe_decode_record(const struct epd_ring_record *rec) {
        if (rec->opcode == EPD_RING_EV_HANDOFF_ACCEPTED && rec->user_data < arg_inflight) {
                Slot *s = &pipe_.slots[rec->user_data];
                s->dtoken = rec->token;
                pipe_progress(s, rec->group);
        } else if (rec->opcode == EPD_RING_EV_GROUP_PROGRESS) {
                Slot *s = slot_of_dtoken(rec->token);
                if (s)
                        pipe_progress(s, rec->group);
        } else if (rec->opcode == EPD_RING_EV_COMPLETION) {
                if (rec->result < 0) {
                        fprintf(stderr, "bench-handoff-latency: ring %s failed: %s\n",
                                rec->user_data & COMMIT_TAG ? "commit" : "accept", strerror(-rec->result));
                        exit(1);
                }
                if (!(rec->user_data & COMMIT_TAG))
                        return;
                Slot *s = &pipe_.slots[rec->user_data & ~COMMIT_TAG];
                char dseq[EPD_RING_SEQUENCE_PATH_MAX];
                if (epd_ring_record_sequence_path(rec, dseq, sizeof dseq) < 0)
                        die(NULL, -EBADMSG, "the commit's sequence");
                int r = epd_sequence_release_nowait(pipe_.d, dseq);
                if (r < 0)
                        die(pipe_.d, r, "release (decode sequence, pipelined)");
                s->commit_done = true;
        } else if (rec->opcode == EPD_RING_EV_HANDOFF_STATE && rec->arg0 == EPD_HANDOFF_STATE_ROLLED_BACK &&
                   slot_of_dtoken(rec->token)) {
                fprintf(stderr, "bench-handoff-latency: handoff rolled back (cause %" PRIu64 ")\n", rec->arg1);
                exit(1);
        }
}

static void pipe_source_record(const struct epd_ring_record *rec) {
        if (rec->opcode != EPD_RING_EV_HANDOFF_STATE || rec->arg0 != EPD_HANDOFF_STATE_COMMITTED)
                return;
        for (unsigned i = 0; i < arg_inflight; i++) {
                Slot *s = &pipe_.slots[i];
                if (s->busy && s->prepared && s->token == rec->token) {
                        s->src_committed = true;
                        return;
                }
        }
        /* Before its Prepare's answer was taken (the answer waits for the journal): one
         * per slot at most. */
        if (pipe_.n_early < arg_inflight)
                pipe_.early[pipe_.n_early++] = rec->token;
}

/* Slots whose handoff is over: measured (after the warm-up), then started again. */
static void pipe_reap(unsigned total) {
        for (unsigned i = 0; i < arg_inflight; i++) {
                Slot *s = &pipe_.slots[i];
                if (!s->busy || !s->prepared || !s->src_committed || !s->commit_done)
                        continue;
                s->busy = false;
                pipe_.done++;
                if (pipe_.done == arg_warmup * arg_inflight)
                        pipe_.t_measure = now_ns();
                if (pipe_.done > arg_warmup * arg_inflight && pipe_.measured < arg_count) {
                        unsigned k = pipe_.measured++;
                        pipe_.first_ns[k] = s->t_first - s->t0;
                        pipe_.all_ns[k] = s->t_all - s->t0;
                        pipe_.prepare_ns[k] = s->t_prepared - s->t0;
                }
                if (pipe_.started < total)
                        pipe_start(s);
        }
}

static int run_pipelined(void) {
        unsigned total = arg_count + arg_warmup * arg_inflight;
        int r;
        pipe_.p = connect_as(arg_prefill, "prefill", arg_arena);
        pipe_.d = connect_as(arg_decode, "decode", arg_dest_arena ? arg_dest_arena : arg_arena);
        if ((r = epd_ring_open(pipe_.p, 1024, 4096, &pipe_.pr)) < 0)
                die(pipe_.p, r, "open ring");
        if ((r = epd_ring_open(pipe_.d, 1024, 4096, &pipe_.dr)) < 0)
                die(pipe_.d, r, "open ring");
        pipe_.slots = calloc(arg_inflight, sizeof *pipe_.slots);
        pipe_.first_ns = calloc(arg_count, sizeof(uint64_t));
        pipe_.all_ns = calloc(arg_count, sizeof(uint64_t));
        pipe_.prepare_ns = calloc(arg_count, sizeof(uint64_t));
        pipe_.early = calloc(arg_inflight, sizeof(uint64_t));
        if (!pipe_.slots || !pipe_.first_ns || !pipe_.all_ns || !pipe_.prepare_ns || !pipe_.early)
                die(NULL, -ENOMEM, "memory");
        for (unsigned i = 0; i < arg_inflight; i++) {
                uint32_t *pages = NULL;
                size_t n;
                pipe_.slots[i].idx = i;
                if ((r = epd_sequence_create(pipe_.p, arg_arena, arg_pages, &pipe_.slots[i].seq, &pages, &n)) < 0)
                        die(pipe_.p, r, "create sequence");
                free(pages);
        }
        uint64_t t0 = now_ns();
        if (arg_warmup == 0)
                pipe_.t_measure = t0;
        for (unsigned i = 0; i < arg_inflight; i++)
                pipe_start(&pipe_.slots[i]);
        unsigned last_done = 0;
        uint64_t last_progress = now_ns();
        /* Which bus connection has something to process: read (or a call's timeout
         * passed) by the last poll. The first turn looks at both. */
        bool process_p = true, process_d = true;
        while (pipe_.done < total) {
                /* No handoff finished in 30 s: say where each slot stands and stop. */
                if (pipe_.done != last_done) {
                        last_done = pipe_.done;
                        last_progress = now_ns();
                } else if (now_ns() - last_progress > 30ULL * 1000000000ULL) {
                        for (unsigned i = 0; i < arg_inflight; i++) {
                                Slot *s = &pipe_.slots[i];
                                if (s->busy)
                                        fprintf(stderr, "bench-handoff-latency: %s: prepared %d, landed %d, "
                                                "committed (decode) %d, committed (source) %d\n", s->rid,
                                                s->prepared, s->t_all != 0, s->commit_done, s->src_committed);
                        }
                        die(NULL, -ETIMEDOUT, "pipelined handoffs stalled");
                }
                /* What came in: Prepare answers (callbacks), then the rings' records.
                 * epd_process() takes everything there is; a connection poll did not
                 * wake is not asked (each ask costs a read that finds nothing). */
                if (process_p && (r = epd_process(pipe_.p)) < 0)
                        die(pipe_.p, r, "process");
                if (process_d && (r = epd_process(pipe_.d)) < 0)
                        die(pipe_.d, r, "process");
                struct epd_ring_record rec;
                while (epd_ring_next(pipe_.dr, &rec, 0) == 0)
                        pipe_decode_record(&rec);
                while (epd_ring_next(pipe_.pr, &rec, 0) == 0)
                        pipe_source_record(&rec);
                pipe_reap(total);
                uint64_t now = now_ns(), wake = UINT64_MAX;
                for (unsigned i = 0; i < arg_inflight; i++) {
                        Slot *s = &pipe_.slots[i];
                        if (s->busy && s->retry_at) {
                                if (s->retry_at <= now)
                                        pipe_prepare(s);
                                else if (s->retry_at < wake)
                                        wake = s->retry_at;
                        }
                }
                if (pipe_.done >= total)
                        break;
                /* The bus connections as libepd asks: their events (POLLOUT while a
                 * call waits to be written) and their calls' timeouts. */
                int ev_p = epd_get_events(pipe_.p), ev_d = epd_get_events(pipe_.d);
                uint64_t tmo_p = UINT64_MAX, tmo_d = UINT64_MAX;
                if (ev_p < 0 || (r = epd_get_timeout(pipe_.p, &tmo_p)) < 0)
                        die(pipe_.p, ev_p < 0 ? ev_p : r, "events");
                if (ev_d < 0 || (r = epd_get_timeout(pipe_.d, &tmo_d)) < 0)
                        die(pipe_.d, ev_d < 0 ? ev_d : r, "events");
                struct pollfd fds[4] = {
                        { .fd = epd_get_fd(pipe_.p), .events = (short)ev_p },
                        { .fd = epd_get_fd(pipe_.d), .events = (short)ev_d },
                        { .fd = epd_ring_fd(pipe_.pr), .events = POLLIN },
                        { .fd = epd_ring_fd(pipe_.dr), .events = POLLIN },
                };
                uint64_t tmo = tmo_p < tmo_d ? tmo_p : tmo_d; /* usec */
                if (tmo != UINT64_MAX && tmo * 1000 < wake)
                        wake = tmo * 1000;
                /* 100 ms at most: the stall check above runs meanwhile. */
                uint64_t wait_ms = wake == UINT64_MAX ? 100 : wake > now ? (wake - now) / 1000000 + 1 : 0;
                int ms = wait_ms < 100 ? (int)wait_ms : 100;
                if (poll(fds, 4, ms) < 0 && errno != EINTR)
                        die(NULL, -errno, "poll");
                uint64_t after = now_ns() / 1000;
                process_p = fds[0].revents != 0 || tmo_p <= after;
                process_d = fds[1].revents != 0 || tmo_d <= after;
        }
        double secs = (double)(now_ns() - pipe_.t_measure) / 1e9;
        if ((r = epd_flush(pipe_.d, 10 * 1000000ULL)) < 0)
                die(pipe_.d, r, "release (decode sequences)");
        uint64_t bytes = (uint64_t)arg_pages * arg_layers * arg_layer_bytes;
        printf("RESULT handoffs=%u inflight=%u pipelined=1 groups=%u bytes=%" PRIu64 " per_s=%.0f", pipe_.measured,
               arg_inflight, arg_groups, bytes, (double)pipe_.measured / secs);
        stats("first", pipe_.first_ns, pipe_.measured);
        stats("all", pipe_.all_ns, pipe_.measured);
        stats("prepare", pipe_.prepare_ns, pipe_.measured);
        printf(" mib_s=%.1f\n", (double)bytes * (double)pipe_.measured / secs / 1048576.0);
        for (unsigned i = 0; i < arg_inflight; i++) {
                (void)epd_sequence_release(pipe_.p, pipe_.slots[i].seq);
                free(pipe_.slots[i].seq);
        }
        free(pipe_.slots);
        free(pipe_.first_ns);
        free(pipe_.all_ns);
        free(pipe_.prepare_ns);
        free(pipe_.early);
        epd_ring_close(pipe_.pr);
        epd_ring_close(pipe_.dr);
        epd_disconnect(pipe_.p);
        epd_disconnect(pipe_.d);
        return 0;
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
                { "pipeline", required_argument, NULL, 'K' },
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
                case 'K': arg_inflight = (unsigned)strtoul(optarg, NULL, 0); arg_pipeline = true; break;
                default: return 2;
                }
        if (!arg_prefill || !arg_decode || arg_groups == 0 || arg_groups > arg_layers || arg_groups > 1024 ||
            arg_inflight == 0 || arg_count < arg_inflight || arg_layer_bytes % 64 != 0) {
                fprintf(stderr, "usage: see the comment at the top of bench/bench-handoff-latency.c\n");
                return 2;
        }
        if (arg_pipeline)
                return run_pipelined();
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
        for (unsigned i = 0; i < arg_inflight; i++) {
                free(w[i].first_ns);
                free(w[i].all_ns);
                free(w[i].prepare_ns);
        }
        free(w);
        free(first);
        free(all);
        free(prep);
        return 0;
}
