/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epd-demo: a synthetic Encoder -> Prefill -> Decode workload through epdd, and a load
 * generator for it. Each lane is three workers (one connection each): an encoder that
 * asks the feature cache for an image's hidden states and computes them only when told
 * to produce (writing them into the feature arena it mapped from the daemon), a prefill
 * worker that reads them through its own mapping of the same memory, computes "KV"
 * layer group by layer group into the pages of a sequence and reports each group ready
 * over its ring, and a decode worker that accepts the handoff, follows the groups on
 * its ring, commits and reads the KV from its own sequence. Bytes never cross the bus.
 * With --decode-address the decode worker talks to another epdd (a peer of the first):
 * the handoff crosses hosts.
 *
 * --requests N requests over --images K distinct images, --concurrency C lanes at once
 * (threads, one epd_client each). Request ids are unique (a random run id and the
 * request's number), so that `epdctl trace` follows one request. Every byte read is
 * checked against what its writer wrote, also when the image was cached by an earlier
 * run. A Prepare refused with org.epd1.Error.Backpressure waits the retry_after_usec
 * the daemon gave and tries again (NoSpace: a short backoff). Prints what moved, how
 * fast, and what the terms mean; --json for scripts. Exit status 0 only when every
 * request completed and every check matched. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "epd/epd-feature.h"
#include "epd/epd.h"
#include "epd/handoff.h"
#include "tool-connect.h"

#define IMAGES_MAX 256
#define REQUESTS_MAX 1000000
#define CONCURRENCY_MAX 32
#define RETRIES_MAX 50
#define RETRY_SLEEP_MAX_USEC (5 * 1000000ULL)

static const char *arg_address = NULL;
static const char *arg_decode_address = NULL;
static const char *arg_arena = NULL;
static unsigned arg_requests = 2;
static unsigned arg_images = 1;
static unsigned arg_concurrency = 1;
static bool arg_json = false;

/* Qwen3-VL-8B-like shapes, scaled down: 576 image tokens x 4096 hidden (bf16); KV for 8
 * layers x 36 blocks of 16 tokens x 8 KV heads x 128 dims, handed over in 4 groups. */
#define FEATURE_BYTES (576ULL * 4096 * 2)
#define N_PAGES 36U
#define N_GROUPS 4U
static const epd_kv_layout kv = { .layers = 8, .tokens_per_block = 16, .k_bytes_per_token = 8 * 128 * 2,
                                  .v_bytes_per_token = 8 * 128 * 2, .dtype = "bf16" };
#define LAYER_BYTES ((uint64_t)16 * (8 * 128 * 2 * 2))
#define PAGE_BYTES (LAYER_BYTES * 8)

static uint64_t run_id;

/* Expected checksums of the images, computed once from their pattern. */
static pthread_mutex_t image_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t image_sum[IMAGES_MAX];
static bool image_sum_known[IMAGES_MAX];

static double now_s(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t fnv1a(uint64_t h, const uint8_t *p, size_t n) {
        for (size_t i = 0; i < n; i++)
                h = (h ^ p[i]) * 1099511628211ULL;
        return h;
}
#define FNV_START 1469598103934665603ULL

/* The image's "hidden states": a pattern of the image number, the same in every run, so
 * that bytes cached by an earlier run check out too. */
static uint8_t image_byte(unsigned image, size_t i) {
        return (uint8_t)((i * 2654435761u >> 13) + image * 131u);
}

static void image_fill(unsigned image, uint8_t *p, size_t n) {
        for (size_t i = 0; i < n; i++)
                p[i] = image_byte(image, i);
}

static uint64_t image_checksum(unsigned image) {
        pthread_mutex_lock(&image_lock);
        if (!image_sum_known[image]) {
                uint8_t buf[65536];
                uint64_t h = FNV_START;
                for (size_t off = 0; off < FEATURE_BYTES; off += sizeof buf) {
                        size_t n = FEATURE_BYTES - off < sizeof buf ? FEATURE_BYTES - off : sizeof buf;
                        for (size_t i = 0; i < n; i++)
                                buf[i] = image_byte(image, off + i);
                        h = fnv1a(h, buf, n);
                }
                image_sum[image] = h;
                image_sum_known[image] = true;
        }
        uint64_t s = image_sum[image];
        pthread_mutex_unlock(&image_lock);
        return s;
}

typedef struct Stats {
        unsigned completed, failed;
        unsigned encoder_runs, encoder_hits, encoder_waits, acquires, acquire_hits;
        unsigned feature_mismatches, kv_mismatches;
        unsigned backpressure_retries, nospace_retries;
        unsigned ring_notices;
        uint64_t bytes_moved;
        unsigned zero_copy, copied, remote;
        double *latency;        /* Prepare to Commit, seconds, per completed request */
        size_t n_latency;
        double exposed;         /* sum over requests: last group ready -> all arrived */
} Stats;

typedef struct Lane {
        unsigned index;
        epd_client *enc, *pre, *dec;
        epd_ring_client *ring_p, *ring_d;
        uint8_t *kp_base;
        const epd_arena *ka;
        char *host_p, *host_d;
        bool remote;
        Stats st;
        char error[1024];
} Lane;

static atomic_uint next_request;

static int lane_fail(Lane *l, epd_client *c, int r, const char *what) {
        const char *name = c ? epd_last_error_name(c) : NULL, *msg = c ? epd_last_error_message(c) : NULL;
        if (name)
                snprintf(l->error, sizeof l->error, "%s: %s: %s", what, name, msg && *msg ? msg : strerror(-r));
        else
                snprintf(l->error, sizeof l->error, "%s: %s", what, strerror(-r));
        return r;
}

static int lane_open(Lane *l) {
        int r;
        const char *bad = arg_address;
        if ((r = epd_connect(arg_address, &l->enc)) >= 0 && (r = epd_connect(arg_address, &l->pre)) >= 0 &&
            (bad = arg_decode_address, r = epd_connect(arg_decode_address, &l->dec)) >= 0)
                bad = NULL;
        if (r < 0) {
                char where[512], what[600];
                tool_address_describe(bad, where, sizeof where);
                snprintf(what, sizeof what, "cannot connect to epdd at %s", where);
                return lane_fail(l, NULL, r, what);
        }
        if ((r = epd_register(l->enc, "encoder", "qwen3-vl-demo", "cpu", NULL, NULL)) < 0)
                return lane_fail(l, l->enc, r, "register the encoder");
        if ((r = epd_register(l->pre, "prefill", "qwen3-vl-demo", "cpu", &kv, NULL)) < 0)
                return lane_fail(l, l->pre, r, "register the prefill worker");
        if ((r = epd_register(l->dec, "decode", "qwen3-vl-demo", "cpu", &kv, NULL)) < 0)
                return lane_fail(l, l->dec, r, "register the decode worker");
        int kp = epd_arena_find(l->pre, "host0");
        if (kp < 0) {
                snprintf(l->error, sizeof l->error, "the KV arena host0 is not there (epd.conf defines others)");
                return -ENOENT;
        }
        if ((r = epd_arena_map(l->pre, (size_t)kp, (void **)&l->kp_base)) < 0)
                return lane_fail(l, l->pre, r, "map the KV arena");
        l->ka = epd_arena_get(l->pre, (size_t)kp);
        if (l->ka->size - l->ka->data_offset < (uint64_t)N_PAGES * PAGE_BYTES) {
                snprintf(l->error, sizeof l->error, "arena host0 is too small for the demo's %u pages of %" PRIu64 " bytes",
                         N_PAGES, PAGE_BYTES);
                return -ENOSPC;
        }
        if ((r = epd_ring_open(l->pre, 64, 64, &l->ring_p)) < 0 || (r = epd_ring_open(l->dec, 64, 64, &l->ring_d)) < 0)
                return lane_fail(l, NULL, r, "open the rings");
        if ((r = epd_get_host_id(l->pre, &l->host_p)) < 0 || (r = epd_get_host_id(l->dec, &l->host_d)) < 0)
                return lane_fail(l, NULL, r, "read the host ids");
        l->remote = strcmp(l->host_p, l->host_d) != 0;
        return 0;
}

static void lane_close(Lane *l) {
        epd_ring_close(l->ring_p);
        epd_ring_close(l->ring_d);
        free(l->host_p);
        free(l->host_d);
        epd_disconnect(l->dec);
        epd_disconnect(l->pre);
        epd_disconnect(l->enc);
}

static void sleep_usec(uint64_t usec) {
        if (usec > RETRY_SLEEP_MAX_USEC)
                usec = RETRY_SLEEP_MAX_USEC;
        struct timespec ts = { .tv_sec = (time_t)(usec / 1000000), .tv_nsec = (long)(usec % 1000000) * 1000 };
        nanosleep(&ts, NULL);
}

static void image_key(unsigned image, char *buf, size_t n) {
        snprintf(buf, n, "sha256:%016" PRIx64 "6a09e667f3bcc908|qwen3-vl-demo|576x4096",
                 (uint64_t)((uint64_t)image * UINT64_C(0x9e3779b97f4a7c15)));
}

/* Encoder: the features of `image` are in the cache when this returns. */
static int encode(Lane *l, unsigned image, const char *rid) {
        static const epd_feature_tensor tensor = { .name = "image_embeds", .dtype = "bf16", .rank = 2,
                                                   .shape = { 576, 4096 } };
        char key[EPD_FEATURE_KEY_MAX];
        epd_feature *f = NULL;
        image_key(image, key, sizeof key);
        double t0 = now_s();
        int r = epd_feature_acquire(l->enc, key, true, &f);
        if (r < 0)
                return lane_fail(l, l->enc, r, "acquire the image features (encoder)");
        if (strcmp(f->result, "produce") == 0) {
                r = epd_feature_produce(l->enc, f, FEATURE_BYTES, &tensor, 1, rid);
                if (r >= 0 && !f->data)
                        r = -ENOMEM;
                if (r < 0) {
                        epd_feature_release(l->enc, f);
                        return lane_fail(l, l->enc, r, "reserve the image features");
                }
                image_fill(image, f->data, FEATURE_BYTES); /* "the vision tower" */
                l->st.encoder_runs++;
                r = epd_feature_publish(l->enc, f, (uint64_t)((now_s() - t0) * 1e6));
                if (r < 0) {
                        epd_feature_release(l->enc, f);
                        return lane_fail(l, l->enc, r, "publish the image features");
                }
        } else if (strcmp(f->result, "wait") == 0) {
                /* Another lane is computing the same image: wait for it, no polling. */
                l->st.encoder_waits++;
                r = epd_feature_wait(l->enc, f, 30 * 1000000ULL);
                if (r < 0) {
                        epd_feature_release(l->enc, f);
                        return lane_fail(l, l->enc, r, "wait for the image features");
                }
        } else
                l->st.encoder_hits++;
        epd_feature_release(l->enc, f);
        return 0;
}

/* Prefill reads the features through its own mapping; checks them. 1: evicted since. */
static int prefill_read(Lane *l, unsigned image) {
        char key[EPD_FEATURE_KEY_MAX];
        epd_feature *g = NULL;
        image_key(image, key, sizeof key);
        int r = epd_feature_acquire(l->pre, key, false, &g);
        l->st.acquires++;
        if (r == -ENOENT)
                return 1; /* evicted between the encoder and here: encode again */
        if (r < 0)
                return lane_fail(l, l->pre, r, "acquire the image features (prefill)");
        if (strcmp(g->result, "wait") == 0 && (r = epd_feature_wait(l->pre, g, 30 * 1000000ULL)) < 0) {
                epd_feature_release(l->pre, g);
                return lane_fail(l, l->pre, r, "wait for the image features (prefill)");
        }
        if (!g->data) {
                epd_feature_release(l->pre, g);
                return 1;
        }
        l->st.acquire_hits++;
        if (fnv1a(FNV_START, g->data, FEATURE_BYTES) != image_checksum(image))
                l->st.feature_mismatches++;
        epd_feature_release(l->pre, g);
        return 0;
}

static int prepare(Lane *l, const char *rid, const char *seq, char **handoff, uint64_t *token) {
        static const uint32_t groups[N_GROUPS] = { 2, 2, 2, 2 };
        epd_handoff_options opts = { .arena = l->remote ? NULL : arg_arena };
        for (unsigned attempt = 0;; attempt++) {
                int r = epd_handoff_prepare(l->pre, rid, l->remote ? l->host_d : NULL, seq, groups, N_GROUPS, &opts,
                                            handoff, token);
                if (r >= 0)
                        return 0;
                if (attempt >= RETRIES_MAX || (r != -EAGAIN && r != -ENOSPC))
                        return lane_fail(l, l->pre, r, "prepare the handoff");
                /* Backpressure: the daemon says how long to wait; NoSpace: the decode
                 * side is full for now. */
                uint64_t wait = r == -EAGAIN ? epd_last_error_retry_after_usec(l->pre) : 0;
                if (r == -EAGAIN)
                        l->st.backpressure_retries++;
                else
                        l->st.nospace_retries++;
                sleep_usec(wait ? wait : 20000ULL << (attempt < 6 ? attempt : 6));
        }
}

static bool record_is(const struct epd_ring_record *rec, const uint8_t rid[16]) {
        return memcmp(rec->request_id, rid, 16) == 0;
}

static void parse_rid(const char *hex, uint8_t out[16]) {
        for (int i = 0; i < 16; i++) {
                unsigned v;
                sscanf(hex + 2 * i, "%2x", &v);
                out[i] = (uint8_t)v;
        }
}

static int run_request(Lane *l, unsigned n) {
        char rid[33];
        uint8_t rid_bytes[16];
        unsigned image = n % arg_images;
        snprintf(rid, sizeof rid, "%016" PRIx64 "%016" PRIx64, run_id, (uint64_t)n);
        parse_rid(rid, rid_bytes);

        int r;
        for (unsigned tries = 0;; tries++) {
                if ((r = encode(l, image, rid)) < 0)
                        return r;
                if ((r = prefill_read(l, image)) <= 0)
                        break;
                if (tries >= 3) {
                        snprintf(l->error, sizeof l->error, "the features of image %u were evicted three times "
                                 "before the prefill worker read them (feature cache too small for --concurrency?)",
                                 image);
                        return -ENOSPC;
                }
        }
        if (r < 0)
                return r;

        char *seq = NULL, *handoff = NULL, *dseq = NULL;
        uint32_t *pages = NULL;
        size_t np;
        uint64_t token;
        epd_handoff_accepted acc = {};
        if ((r = epd_sequence_create(l->pre, "host0", N_PAGES, &seq, &pages, &np)) < 0)
                return lane_fail(l, l->pre, r, "create the prefill sequence");
        double t_prepare = now_s();
        r = prepare(l, rid, seq, &handoff, &token);
        if (r >= 0 && (r = epd_handoff_accept(l->dec, rid, &acc)) < 0)
                lane_fail(l, l->dec, r, "accept the handoff");
        double t_last = 0;
        /* Layer group by layer group: the KV of group g is written, then reported ready
         * on the ring; the daemon ships it while the next group is computed. */
        for (uint32_t g = 0, layer = 0; r >= 0 && g < N_GROUPS; layer += 2, g++) {
                for (uint32_t p = 0; p < N_PAGES; p++) {
                        uint8_t *pg = l->kp_base + epd_page_offset(l->ka, PAGE_BYTES, pages[p]);
                        memset(pg + layer * LAYER_BYTES, (int)(uint8_t)(n * 7u + p * 3u + g), 2 * LAYER_BYTES);
                }
                if (g == N_GROUPS - 1)
                        t_last = now_s();
                if ((r = epd_ring_layer_group_ready(l->ring_p, rid, token, g, g)) < 0)
                        lane_fail(l, l->pre, r, "report a layer group ready (ring)");
        }
        /* Decode: follows this request's groups on its ring (no bus round trip each). */
        uint32_t seen = acc.groups_done;
        while (r >= 0 && seen < N_GROUPS) {
                struct epd_ring_record rec;
                if ((r = epd_ring_next(l->ring_d, &rec, 30 * 1000000ULL)) < 0) {
                        lane_fail(l, l->dec, r, "wait for the layer groups");
                        break;
                }
                if (!record_is(&rec, rid_bytes))
                        continue; /* an earlier request's, or a backpressure notice */
                if (rec.opcode == EPD_RING_EV_GROUP_PROGRESS) {
                        seen = rec.group;
                        l->st.ring_notices++;
                } else if (rec.opcode == EPD_RING_EV_HANDOFF_STATE && rec.arg0 == EPD_HANDOFF_STATE_ROLLED_BACK) {
                        snprintf(l->error, sizeof l->error, "handoff of request %s rolled back (cause %" PRIu64 ")",
                                 rid, rec.arg1);
                        r = -ECANCELED;
                }
        }
        double t_arrived = now_s();
        uint64_t kv_pre = 0, kv_dec = 0;
        epd_handoff_status st = {};
        if (r >= 0) {
                for (uint32_t p = 0; p < N_PAGES; p++)
                        kv_pre ^= fnv1a(FNV_START, l->kp_base + epd_page_offset(l->ka, PAGE_BYTES, pages[p]), PAGE_BYTES) + p;
                if ((r = epd_handoff_commit(l->dec, acc.path, &dseq)) < 0)
                        lane_fail(l, l->dec, r, "commit");
        }
        double t_commit = now_s();
        if (r >= 0 && (r = epd_handoff_get(l->dec, acc.path, &st)) < 0)
                lane_fail(l, l->dec, r, "read the handoff's status");
        if (r >= 0) {
                int kd = epd_arena_find(l->dec, acc.arena);
                uint8_t *kd_base = NULL;
                if (kd < 0 || (r = epd_arena_map(l->dec, (size_t)kd, (void **)&kd_base)) < 0)
                        lane_fail(l, l->dec, kd < 0 ? -ENOENT : r, "map the decode arena");
                else
                        for (uint32_t p = 0; p < N_PAGES; p++)
                                kv_dec ^= fnv1a(FNV_START, kd_base + acc.offsets[p], PAGE_BYTES) + p;
        }
        if (r >= 0) {
                if (kv_pre != kv_dec)
                        l->st.kv_mismatches++;
                l->st.bytes_moved += st.bytes;
                if (l->remote)
                        l->st.remote++;
                else if (st.bytes == 0)
                        l->st.zero_copy++;
                else
                        l->st.copied++;
                l->st.latency[l->st.n_latency++] = t_commit - t_prepare;
                l->st.exposed += t_arrived - t_last;
        }
        if (acc.path)
                (void)epd_handoff_release(l->dec, acc.path);
        if (handoff)
                (void)epd_handoff_release(l->pre, handoff);
        if (dseq)
                (void)epd_sequence_release(l->dec, dseq);
        (void)epd_sequence_release(l->pre, seq);
        epd_handoff_accepted_done(&acc);
        /* The prefill side's ring carries its own progress records: drop them. */
        struct epd_ring_record rec;
        while (epd_ring_next(l->ring_p, &rec, 0) >= 0)
                ;
        free(seq);
        free(pages);
        free(handoff);
        free(dseq);
        return r;
}

static void *lane_main(void *userdata) {
        Lane *l = userdata;
        unsigned n;
        while ((n = atomic_fetch_add(&next_request, 1)) < arg_requests) {
                if (run_request(l, n) < 0) {
                        l->st.failed++;
                        fprintf(stderr, "epd-demo: request %u: %s\n", n, l->error);
                } else
                        l->st.completed++;
        }
        return NULL;
}

static int cmp_double(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static double quantile(const double *v, size_t n, double q) {
        if (n == 0)
                return 0;
        size_t i = (size_t)(q * (double)(n - 1) + 0.5);
        return v[i < n ? i : n - 1];
}

static void merge(Stats *t, const Stats *s) {
        t->completed += s->completed;
        t->failed += s->failed;
        t->encoder_runs += s->encoder_runs;
        t->encoder_hits += s->encoder_hits;
        t->encoder_waits += s->encoder_waits;
        t->acquires += s->acquires;
        t->acquire_hits += s->acquire_hits;
        t->feature_mismatches += s->feature_mismatches;
        t->kv_mismatches += s->kv_mismatches;
        t->backpressure_retries += s->backpressure_retries;
        t->nospace_retries += s->nospace_retries;
        t->ring_notices += s->ring_notices;
        t->bytes_moved += s->bytes_moved;
        t->zero_copy += s->zero_copy;
        t->copied += s->copied;
        t->remote += s->remote;
        t->exposed += s->exposed;
        memcpy(t->latency + t->n_latency, s->latency, s->n_latency * sizeof(double));
        t->n_latency += s->n_latency;
}

static void report(const Stats *t, const Lane *l0, double wall) {
        double p50 = quantile(t->latency, t->n_latency, 0.5) * 1e3, p99 = quantile(t->latency, t->n_latency, 0.99) * 1e3;
        unsigned lookups = t->encoder_runs + t->encoder_hits + t->encoder_waits;
        bool ok = t->failed == 0 && t->feature_mismatches == 0 && t->kv_mismatches == 0;
        if (arg_json) {
                printf("{\"ok\":%s,\"requests\":%u,\"completed\":%u,\"failed\":%u,\"concurrency\":%u,\"images\":%u,"
                       "\"run_id\":\"%016" PRIx64 "\",\"encoder_runs\":%u,\"encoder_cache_hits\":%u,\"encoder_waits\":%u,"
                       "\"prefill_acquires\":%u,\"prefill_hits\":%u,\"feature_mismatches\":%u,\"kv_mismatches\":%u,"
                       "\"backpressure_retries\":%u,\"nospace_retries\":%u,\"ring_notices\":%u,\"bytes_moved\":%" PRIu64
                       ",\"zero_copy\":%u,\"copied\":%u,\"remote\":%u,\"seconds\":%.6f,\"requests_per_second\":%.3f,"
                       "\"handoff_p50_ms\":%.3f,\"handoff_p99_ms\":%.3f,\"prefill_host\":\"%s\",\"decode_host\":\"%s\"}\n",
                       ok ? "true" : "false", arg_requests, t->completed, t->failed, arg_concurrency, arg_images, run_id,
                       t->encoder_runs, t->encoder_hits, t->encoder_waits, t->acquires, t->acquire_hits,
                       t->feature_mismatches, t->kv_mismatches, t->backpressure_retries, t->nospace_retries,
                       t->ring_notices, t->bytes_moved, t->zero_copy, t->copied, t->remote, wall,
                       wall > 0 ? t->completed / wall : 0.0, p50, p99, l0->host_p ?: "", l0->host_d ?: "");
                return;
        }
        const char *how = t->remote ? "across hosts, over the peer transport"
                          : t->copied ? "between two arenas of this host (a memcpy per layer group)"
                                      : "within one arena: the pages themselves change hands, no byte is copied";
        printf("epd demo: Encoder -> Prefill -> Decode through epdd (run %016" PRIx64 ")\n", run_id);
        printf("  requests                %u completed, %u failed (%u at a time; ids %016" PRIx64 "00..., see "
               "`epdctl trace ID`)\n",
               t->completed, t->failed, arg_concurrency, run_id);
        printf("  workers                 %u (an encoder, a prefill and a decode worker per lane)%s\n",
               3 * arg_concurrency, t->remote ? "; decode on another epdd" : "");
        printf("  feature cache           %u image%s: the vision encoder ran %u time%s for %u lookups (%u cache hit%s, "
               "%u waited for another lane's run)\n",
               arg_images, arg_images == 1 ? "" : "s", t->encoder_runs, t->encoder_runs == 1 ? "" : "s", lookups,
               t->encoder_hits, t->encoder_hits == 1 ? "" : "s", t->encoder_waits);
        printf("  feature bytes           %u reads of %llu bytes by the prefill worker, through its own mapping of the "
               "encoder's memory: %s\n",
               t->acquire_hits, (unsigned long long)FEATURE_BYTES,
               t->feature_mismatches ? "MISMATCH" : "every byte as the encoder wrote it");
        printf("  KV per request          %u pages x %llu KiB, %u layers handed over in %u layer groups\n", N_PAGES,
               (unsigned long long)(PAGE_BYTES >> 10), kv.layers, N_GROUPS);
        printf("  layered handoff         %s -> %s, %s\n", l0->host_p, l0->host_d, how);
        printf("  KV bytes moved          %" PRIu64 " in total; decode read %s\n", t->bytes_moved,
               t->kv_mismatches ? "a MISMATCH" : "every page as prefill wrote it");
        printf("  progress notices        %u: records the daemon put on the decode worker's ring (a shared-memory "
               "queue, no D-Bus call) as each layer group arrived\n",
               t->ring_notices);
        if (t->backpressure_retries || t->nospace_retries)
                printf("  retries                 %u after Backpressure (waited the retry-after the daemon gave), "
                       "%u after NoSpace\n",
                       t->backpressure_retries, t->nospace_retries);
        printf("  handoff latency         P50 %.2f ms, P99 %.2f ms: Prepare to Commit as the workers see it, the "
               "prefill's KV writes included\n",
               p50, p99);
        printf("  exposed handoff time    %.2f ms per request: from the last layer group ready to all of them "
               "arrived (what overlapping the handoff with prefill leaves)\n",
               t->completed ? t->exposed * 1e3 / t->completed : 0.0);
        printf("  rate                    %.1f requests/s over %.3f s wall time (encode, prefill, handoff, decode "
               "check; %u at a time)",
               wall > 0 ? t->completed / wall : 0.0, wall, arg_concurrency);
        if (t->bytes_moved)
                printf(", KV at %.1f MiB/s", (double)t->bytes_moved / (1 << 20) / wall);
        printf("\n  bytes over the bus      0 (memory is shared by fd; the bus carries only control)\n");
}

static void help(void) {
        printf("Usage: epd-demo [OPTIONS]\n\n"
               "Runs Encoder -> Prefill -> Decode requests through epdd and checks every byte.\n\n"
               "  -A --address=ADDR          epdd to use (direct:PATH, bus:ADDRESS, system; default as libepd)\n"
               "  -D --decode-address=ADDR   epdd of the decode workers (a peer of the first: handoffs cross hosts)\n"
               "  -a --arena=NAME            destination KV arena of local handoffs (default: the same arena,\n"
               "                             no copy)\n"
               "  -n --requests=N            requests to run (default 2)\n"
               "  -i --images=K              distinct images among them, 1..%u (default 1: all but the first hit\n"
               "                             the feature cache)\n"
               "  -c --concurrency=C         requests at once, 1..%u (default 1); each lane registers three workers\n"
               "  -j --json                  print the summary as one JSON object\n"
               "  -h --help                  show this help\n"
               "     --version               show the version\n\n"
               "Exit status: 0 when every request completed and every byte checked out, 2 for a bad\n"
               "command line, 1 otherwise.\n",
               IMAGES_MAX, CONCURRENCY_MAX);
}

static int parse_count(const char *opt, const char *v, unsigned max, unsigned *ret) {
        char *end;
        errno = 0;
        unsigned long n = strtoul(v, &end, 10);
        if (!*v || *end || errno || n == 0 || n > max) {
                fprintf(stderr, "epd-demo: --%s=%s: expected a number from 1 to %u\n", opt, v, max);
                return -EINVAL;
        }
        *ret = (unsigned)n;
        return 0;
}

static int parse_argv(int argc, char *argv[]) {
        enum { ARG_VERSION = 0x100 };
        static const struct option options[] = {
                { "address", required_argument, NULL, 'A' },
                { "decode-address", required_argument, NULL, 'D' },
                { "arena", required_argument, NULL, 'a' },
                { "requests", required_argument, NULL, 'n' },
                { "images", required_argument, NULL, 'i' },
                { "concurrency", required_argument, NULL, 'c' },
                { "json", no_argument, NULL, 'j' },
                { "help", no_argument, NULL, 'h' },
                { "version", no_argument, NULL, ARG_VERSION },
                {},
        };
        int c;
        while ((c = getopt_long(argc, argv, "A:D:a:n:i:c:jh", options, NULL)) >= 0)
                switch (c) {
                case 'A':
                        arg_address = optarg;
                        break;
                case 'D':
                        arg_decode_address = optarg;
                        break;
                case 'a':
                        arg_arena = optarg;
                        break;
                case 'n':
                        if (parse_count("requests", optarg, REQUESTS_MAX, &arg_requests) < 0)
                                return -EINVAL;
                        break;
                case 'i':
                        if (parse_count("images", optarg, IMAGES_MAX, &arg_images) < 0)
                                return -EINVAL;
                        break;
                case 'c':
                        if (parse_count("concurrency", optarg, CONCURRENCY_MAX, &arg_concurrency) < 0)
                                return -EINVAL;
                        break;
                case 'j':
                        arg_json = true;
                        break;
                case 'h':
                        help();
                        return 0;
                case ARG_VERSION:
                        printf("epd-demo " EPD_VERSION "\n");
                        return 0;
                default:
                        fprintf(stderr, "See epd-demo --help.\n");
                        return -EINVAL;
                }
        if (optind < argc) {
                fprintf(stderr, "epd-demo: unexpected argument '%s'; see epd-demo --help.\n", argv[optind]);
                return -EINVAL;
        }
        if (tool_address_check("epd-demo", arg_address) < 0 || tool_address_check("epd-demo", arg_decode_address) < 0)
                return -EINVAL;
        if (!arg_decode_address)
                arg_decode_address = arg_address;
        if (arg_concurrency > arg_requests)
                arg_concurrency = arg_requests;
        return 1;
}

int main(int argc, char *argv[]) {
        int r = parse_argv(argc, argv);
        if (r <= 0)
                return r < 0 ? 2 : 0;
        if (getrandom(&run_id, sizeof run_id, 0) != sizeof run_id)
                run_id = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);

        Lane *lanes = calloc(arg_concurrency, sizeof *lanes);
        Stats total = { .latency = calloc(arg_requests, sizeof(double)) };
        if (!lanes || !total.latency) {
                fprintf(stderr, "epd-demo: out of memory\n");
                return 1;
        }
        for (unsigned i = 0; i < arg_concurrency; i++) {
                lanes[i].index = i;
                lanes[i].st.latency = calloc(arg_requests, sizeof(double));
                if (!lanes[i].st.latency || lane_open(&lanes[i]) < 0) {
                        fprintf(stderr, "epd-demo: %s\n", lanes[i].error[0] ? lanes[i].error : "out of memory");
                        for (unsigned k = 0; k <= i; k++)
                                lane_close(&lanes[k]);
                        return 1;
                }
        }
        double t0 = now_s();
        pthread_t *threads = calloc(arg_concurrency, sizeof *threads);
        if (!threads)
                return 1;
        for (unsigned i = 1; i < arg_concurrency; i++)
                if (pthread_create(&threads[i], NULL, lane_main, &lanes[i]) != 0) {
                        fprintf(stderr, "epd-demo: cannot start lane %u\n", i);
                        threads[i] = 0;
                }
        lane_main(&lanes[0]);
        for (unsigned i = 1; i < arg_concurrency; i++)
                if (threads[i])
                        pthread_join(threads[i], NULL);
        double wall = now_s() - t0;
        for (unsigned i = 0; i < arg_concurrency; i++)
                merge(&total, &lanes[i].st);
        qsort(total.latency, total.n_latency, sizeof(double), cmp_double);
        /* Requests never started (a lane that could not start) count as failed. */
        if (total.completed + total.failed < arg_requests)
                total.failed = arg_requests - total.completed;
        report(&total, &lanes[0], wall);
        bool ok = total.failed == 0 && total.feature_mismatches == 0 && total.kv_mismatches == 0;
        for (unsigned i = 0; i < arg_concurrency; i++) {
                lane_close(&lanes[i]);
                free(lanes[i].st.latency);
        }
        free(lanes);
        free(threads);
        free(total.latency);
        return ok ? 0 : 1;
}
