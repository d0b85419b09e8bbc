/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* handoff-client: one side of a layered handoff through libepd, for the multi-host
 * tests (test-handoff-netns.py) and the handoff benchmark. It prints one line per
 * step on stdout (flushed), so the driver can fault the system at a known point.
 *
 *   handoff-client prefill ADDRESS ARENA DEST_HOST REQUEST_ID PAGES GROUPS DELAY_MS TIMEOUT_MS
 *     registers as a prefill worker, fills a sequence of PAGES pages with a pattern,
 *     Prepares the handoff to DEST_HOST ("prepared TOKEN" or "prepare-failed ERROR"),
 *     reports each layer group ready DELAY_MS apart ("ready G"; "stale G" once the
 *     handoff is gone), then waits up to TIMEOUT_MS for the end: "final STATE CAUSE
 *     MS" (MS since the last group was ready), releases everything ("released").
 *     With HANDOFF_CLIENT_RETRY_BACKPRESSURE=1, a Prepare refused with
 *     Error.Backpressure is tried again after its retry-after ("deferred US"), as a
 *     worker honouring it would, until TIMEOUT_MS.
 *   handoff-client decode ADDRESS REQUEST_ID TIMEOUT_MS
 *     registers as a decode worker ("registered"), accepts with AcceptWait (no retries: it
 *     answers when the Prepare arrives), follows the groups on its ring (no polling):
 *     "group G ok" when group G has landed and every byte of
 *     its layers matches (groups must complete in order: "group G OUT-OF-ORDER" or
 *     "group G MISMATCH" otherwise, exit 4), Commits when all are in ("final
 *     committed - MS"), or reports "final rolled-back CAUSE MS"; releases everything.
 *
 *   handoff-client watch ADDRESS DECODE_HOST SECONDS
 *     registers a prefill worker with a ring and a decode worker placed on DECODE_HOST
 *     (ConfigureWorker Host), prints "ring-open", then for SECONDS: every ring
 *     backpressure record as "backpressure PEER LEVEL REASON PERMILLE RETRY_US", and
 *     every 100 ms an Admit of a new request, printed as "verdict VERDICT REASON" when
 *     it differs from the previous one (admitted requests are completed at once).
 *
 * With HANDOFF_CLIENT_RELEASE_ON_COMMIT=1 the prefill prepares with release_on_commit
 * (its ring says committed, then the handoff is gone: no Release) and the decode commits
 * with CommitAndRelease (no Release either).
 * With HANDOFF_CLIENT_BENCH=1 (bench/bench-handoff-netns.py): no pattern is written or
 * checked, and the prefill side prints "shipped US
 * BYTES", the microseconds from the first LayerGroupReady to the source's handoff
 * reaching transferred (every byte acknowledged by the destination) or committed.
 *
 * Exit: 0 when the handoff ended (committed or rolled back) and everything was
 * released, 3 on a timeout, 4 on wrong bytes or order, 1 on other errors. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "epd/epd.h"
#include "epd/handoff.h"

#define LAYERS 8
#define TOKENS 16
#define KV_BYTES 256
#define LAYER_BYTES ((uint64_t)TOKENS * 2 * KV_BYTES)
#define PAGE_SIZE (LAYERS * LAYER_BYTES)

static const epd_kv_layout kv = { .layers = LAYERS, .tokens_per_block = TOKENS, .k_bytes_per_token = KV_BYTES,
                                  .v_bytes_per_token = KV_BYTES, .dtype = "bfloat16" };

static bool bench;
static bool retry_backpressure;
static bool release_on_commit;

static uint64_t now_us(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000000 + (uint64_t)ts.tv_nsec / 1000;
}

static uint64_t now_ms(void) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

static uint8_t pattern(uint32_t page, uint64_t off, uint8_t seed) {
        return (uint8_t)(((uint32_t)page * 0x9E3779B1u + (uint32_t)off * 2654435761u) >> 13) ^ seed;
}

static uint8_t seed_of(const char *rid) {
        uint8_t s = 0x5a;
        for (const char *p = rid; *p; p++)
                s = (uint8_t)(s * 31 + (uint8_t)*p);
        return s;
}

static int fail(epd_client *c, int r, const char *what) {
        printf("error %s %s %s\n", what, c && epd_last_error_name(c) ? epd_last_error_name(c) : strerror(-r),
               c && epd_last_error_message(c) ? epd_last_error_message(c) : "");
        fflush(stdout);
        return 1;
}

static int connect_worker(const char *address, const char *role, epd_client **ret) {
        int r = epd_connect(address, ret);
        if (r < 0)
                return fail(NULL, r, "connect");
        /* HANDOFF_CLIENT_NAME: the worker's "name" (placement answers name the publisher). */
        r = epd_register_named(*ret, role, "netfaults", "cpu", &kv, NULL, getenv("HANDOFF_CLIENT_NAME"), NULL);
        if (r < 0)
                return fail(*ret, r, "register");
        return 0;
}

static bool final_state(const char *s) {
        return strcmp(s, "committed") == 0 || strcmp(s, "rolled-back") == 0;
}

static int run_prefill(char **argv) {
        const char *address = argv[0], *arena = argv[1], *dest = argv[2], *rid = argv[3];
        uint32_t n_pages = (uint32_t)strtoul(argv[4], NULL, 0), n_groups = (uint32_t)strtoul(argv[5], NULL, 0);
        uint64_t delay_ms = strtoull(argv[6], NULL, 0), timeout_ms = strtoull(argv[7], NULL, 0);
        if (n_groups == 0 || LAYERS % n_groups != 0 || n_pages == 0) {
                fprintf(stderr, "GROUPS must divide %d; PAGES > 0\n", LAYERS);
                return 1;
        }
        epd_client *c = NULL;
        epd_ring_client *ring = NULL;
        int r = connect_worker(address, "prefill", &c);
        if (r)
                return r;
        /* Bench mode waits for the source's state on its ring (an fd), not by polling. */
        if ((bench || release_on_commit) && (r = epd_ring_open(c, 64, 256, &ring)) < 0)
                return fail(c, r, "open ring");
        char *seq = NULL, *handoff = NULL;
        uint32_t *pages = NULL;
        size_t n;
        if ((r = epd_sequence_create(c, arena, n_pages, &seq, &pages, &n)) < 0)
                return fail(c, r, "create-sequence");
        int ai = epd_arena_find(c, arena);
        uint8_t *base;
        if (ai < 0 || (r = epd_arena_map(c, (size_t)ai, (void **)&base)) < 0)
                return fail(c, ai < 0 ? ai : r, "map");
        const epd_arena *a = epd_arena_get(c, (size_t)ai);
        uint8_t seed = seed_of(rid);
        for (uint32_t p = 0; p < n_pages && !bench; p++) {
                uint8_t *pg = base + epd_page_offset(a, PAGE_SIZE, pages[p]);
                for (uint64_t o = 0; o < PAGE_SIZE; o++)
                        pg[o] = pattern(p, o, seed);
        }
        /* HANDOFF_CLIENT_PUBLISH=BASE: publish the pages in the block directory as the
         * chain BASE, BASE+1, ... ("published N"), then wait for "go" on stdin before the
         * handoff (the cluster test locates the prefix from another host first). */
        const char *publish = getenv("HANDOFF_CLIENT_PUBLISH");
        if (publish) {
                uint64_t hbase = strtoull(publish, NULL, 0), *hashes = calloc(n_pages, sizeof *hashes);
                char line[64];
                if (!hashes)
                        return fail(c, -ENOMEM, "publish");
                for (uint32_t p = 0; p < n_pages; p++)
                        hashes[p] = hbase + p;
                r = epd_sequence_publish(c, seq, 0, hashes, n_pages);
                free(hashes);
                if (r < 0)
                        return fail(c, r, "publish");
                printf("published %d\n", r);
                fflush(stdout);
                if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0)
                        return fail(c, -ECANCELED, "publish-wait");
        }
        uint32_t groups[LAYERS];
        for (uint32_t g = 0; g < n_groups; g++)
                groups[g] = LAYERS / n_groups;
        uint64_t token = 0;
        uint64_t end = now_ms() + timeout_ms;
        for (;;) {
                epd_handoff_options o = { .release_on_commit = release_on_commit };
                r = epd_handoff_prepare(c, rid, dest, seq, groups, n_groups, &o, &handoff, &token);
                if (r < 0 && retry_backpressure && now_ms() < end && epd_last_error_name(c) &&
                    strcmp(epd_last_error_name(c), "org.epd1.Error.Backpressure") == 0) {
                        uint64_t retry = epd_last_error_retry_after_usec(c) ?: 100000;
                        printf("deferred %" PRIu64 "\n", retry);
                        usleep((useconds_t)(retry < 1000000 ? retry : 1000000));
                        continue;
                }
                if (r != -EHOSTUNREACH || now_ms() > end)
                        break;
                usleep(20000); /* the peer is still connecting */
        }
        if (r < 0) {
                uint64_t retry = epd_last_error_retry_after_usec(c);
                if (retry > 0)
                        printf("prepare-failed %s retry_after_usec=%" PRIu64 "\n", epd_last_error_name(c) ?: strerror(-r),
                               retry);
                else
                        printf("prepare-failed %s\n", epd_last_error_name(c) ?: strerror(-r));
                fflush(stdout);
                epd_sequence_release(c, seq);
                free(seq);
                free(pages);
                epd_ring_close(ring);
                epd_disconnect(c);
                return 0;
        }
        printf("prepared %" PRIu64 "\n", token);
        fflush(stdout);
        uint64_t t_last = now_ms(), t_first = now_us();
        for (uint32_t g = 0; g < n_groups; g++) {
                if (g > 0 && delay_ms > 0)
                        usleep((useconds_t)(delay_ms * 1000));
                r = epd_handoff_layer_group_ready(c, handoff, g);
                t_last = now_ms();
                if (r == -ESTALE) {
                        printf("stale %u\n", g);
                        fflush(stdout);
                        break;
                }
                if (r < 0)
                        return fail(c, r, "layer-group-ready");
                printf("ready %u\n", g);
                fflush(stdout);
        }
        epd_handoff_status st = {};
        end = now_ms() + timeout_ms;
        bool shipped = false, ended_on_ring = false;
        while (ring && !ended_on_ring && now_ms() < end) {
                struct epd_ring_record rec;
                int k = epd_ring_next(ring, &rec, 100000);
                if (k == -EAGAIN)
                        continue;
                if (k < 0)
                        break;
                if (rec.opcode != EPD_RING_EV_HANDOFF_STATE || rec.token != token)
                        continue;
                if (!shipped &&
                    (rec.arg0 == EPD_HANDOFF_STATE_TRANSFERRED || rec.arg0 == EPD_HANDOFF_STATE_COMMITTED)) {
                        printf("shipped %" PRIu64 " %" PRIu64 "\n", now_us() - t_first, (uint64_t)n_pages * PAGE_SIZE);
                        shipped = true;
                }
                ended_on_ring = rec.arg0 == EPD_HANDOFF_STATE_COMMITTED || rec.arg0 == EPD_HANDOFF_STATE_ROLLED_BACK;
        }
        /* Prepared with release_on_commit and committed: the daemon released it as it
         * committed, nothing to ask or release. */
        bool gone = release_on_commit && ended_on_ring && (epd_handoff_get(c, handoff, &st) < 0);
        if (gone) {
                snprintf(st.state, sizeof st.state, "committed");
                st.cause[0] = 0;
                r = 0;
        }
        while (!gone && (r = epd_handoff_get(c, handoff, &st)) >= 0 && !final_state(st.state) && now_ms() < end) {
                if (bench && !shipped && strcmp(st.state, "transferred") == 0) {
                        printf("shipped %" PRIu64 " %" PRIu64 "\n", now_us() - t_first, st.bytes);
                        shipped = true;
                }
                usleep(5000);
        }
        if (bench && !shipped && r >= 0 && strcmp(st.state, "committed") == 0)
                printf("shipped %" PRIu64 " %" PRIu64 "\n", now_us() - t_first, st.bytes);
        if (r < 0)
                return fail(c, r, "get");
        printf("final %s %s %" PRIu64 "\n", st.state, st.cause[0] ? st.cause : "-", now_ms() - t_last);
        fflush(stdout);
        bool ended = final_state(st.state);
        if ((!gone && (r = epd_handoff_release(c, handoff)) < 0) || (r = epd_sequence_release(c, seq)) < 0)
                return fail(c, r, "release");
        printf("released\n");
        fflush(stdout);
        free(seq);
        free(pages);
        free(handoff);
        epd_ring_close(ring);
        epd_disconnect(c);
        return ended ? 0 : 3;
}

static bool group_matches(const uint8_t *base, const uint64_t *offs, size_t n_pages, uint32_t first_layer,
                          uint32_t layers, uint8_t seed) {
        for (size_t p = 0; p < n_pages; p++)
                for (uint64_t o = first_layer * LAYER_BYTES; o < (first_layer + layers) * LAYER_BYTES; o++)
                        if (base[offs[p] + o] != pattern((uint32_t)p, o, seed))
                                return false;
        return true;
}

static int run_decode(char **argv) {
        const char *address = argv[0], *rid = argv[1];
        uint64_t timeout_ms = strtoull(argv[2], NULL, 0);
        epd_client *c = NULL;
        int r = connect_worker(address, "decode", &c);
        if (r)
                return r;
        /* Registered: the daemon's KV arena has this worker's page size from now on, so
         * a Prepare towards it can land (the test waits for this line). */
        printf("registered\n");
        fflush(stdout);
        /* No polling: the ring tells of progress, AcceptWait of the handoff's arrival (it
         * accepts before the first byte lands, so the progress reaches the ring). */
        epd_ring_client *ring = NULL;
        if ((r = epd_ring_open(c, 64, 1024, &ring)) < 0)
                return fail(c, r, "open-ring");
        epd_handoff_accepted acc;
        r = epd_handoff_accept_wait(c, rid, timeout_ms * 1000, &acc);
        if (r < 0)
                return fail(c, r, "accept");
        printf("accepted %zu %u\n", acc.n_pages, acc.n_groups);
        fflush(stdout);
        int ai = epd_arena_find(c, acc.arena);
        uint8_t *base;
        if (ai < 0 || (r = epd_arena_map(c, (size_t)ai, (void **)&base)) < 0)
                return fail(c, ai < 0 ? ai : r, "map");
        uint8_t seed = seed_of(rid);
        uint32_t per = acc.n_groups ? LAYERS / acc.n_groups : LAYERS, checked = 0;
        epd_handoff_status st = {};
        uint64_t t_last = now_ms();
        int ret = 0;
        uint64_t end = now_ms() + timeout_ms;
        if ((r = epd_handoff_get(c, acc.path, &st)) < 0)
                return fail(c, r, "get");
        for (;;) {
                if (st.groups_done < checked) {
                        printf("group %u OUT-OF-ORDER\n", st.groups_done);
                        ret = 4;
                        break;
                }
                /* Groups land in order: every group below groups_done is complete. */
                for (; checked < st.groups_done; checked++) {
                        bool ok = bench || group_matches(base, acc.offsets, acc.n_pages, checked * per, per, seed);
                        printf("group %u %s\n", checked, ok ? "ok" : "MISMATCH");
                        t_last = now_ms();
                        if (!ok)
                                ret = 4;
                }
                fflush(stdout);
                if (ret)
                        break;
                if (final_state(st.state))
                        break;
                if (acc.n_groups > 0 && st.groups_done == acc.n_groups) {
                        char *dseq = NULL;
                        r = release_on_commit ? epd_handoff_commit_and_release(c, acc.path, &dseq)
                                              : epd_handoff_commit(c, acc.path, &dseq);
                        if (r == -ESTALE)
                                continue; /* rolled back under us: reported on the next turn */
                        if (r < 0)
                                return fail(c, r, "commit");
                        for (uint32_t g = 0; g < acc.n_groups && !bench; g++)
                                if (!group_matches(base, acc.offsets, acc.n_pages, g * per, per, seed))
                                        ret = 4;
                        if (ret) {
                                printf("committed MISMATCH\n");
                                fflush(stdout);
                        }
                        r = epd_sequence_release(c, dseq);
                        free(dseq);
                        if (r < 0)
                                return fail(c, r, "release-sequence");
                        if (release_on_commit) {
                                /* CommitAndRelease: the handoff is gone already. */
                                snprintf(st.state, sizeof st.state, "committed");
                                st.cause[0] = 0;
                                break;
                        }
                        if ((r = epd_handoff_get(c, acc.path, &st)) < 0)
                                return fail(c, r, "get");
                        break;
                }
                if (now_ms() > end) {
                        ret = 3;
                        break;
                }
                /* The next ring record of this handoff (progress or state); after 200 ms
                 * without one, the state is read once more (a record the ring could not
                 * take went as a signal instead): a safety net, not a polling loop. */
                struct epd_ring_record rec;
                int k = epd_ring_next(ring, &rec, 200000);
                if (k >= 0 && rec.token != acc.token)
                        continue;
                if (k >= 0 && rec.opcode == EPD_RING_EV_GROUP_PROGRESS) {
                        /* Records queued before a state read may be older than it. */
                        if (rec.group > st.groups_done)
                                st.groups_done = rec.group;
                        continue;
                }
                if (k < 0 && k != -EAGAIN && k != -ETIMEDOUT)
                        return fail(c, k, "ring");
                if ((r = epd_handoff_get(c, acc.path, &st)) < 0)
                        return fail(c, r, "get");
        }
        printf("final %s %s %" PRIu64 "\n", st.state, st.cause[0] ? st.cause : "-", now_ms() - t_last);
        fflush(stdout);
        if (!(release_on_commit && strcmp(st.state, "committed") == 0) && (r = epd_handoff_release(c, acc.path)) < 0)
                return fail(c, r, "release");
        printf("released\n");
        fflush(stdout);
        epd_handoff_accepted_done(&acc);
        epd_ring_close(ring);
        epd_disconnect(c);
        return ret;
}

static int run_watch(char **argv) {
        const char *address = argv[0], *decode_host = argv[1];
        uint64_t end = now_ms() + strtoull(argv[2], NULL, 0) * 1000;
        epd_client *c = NULL, *d = NULL;
        epd_ring_client *ring = NULL;
        int r = connect_worker(address, "prefill", &c);
        if (r)
                return r;
        r = connect_worker(address, "decode", &d);
        if (r)
                return r;
        if ((r = epd_configure_worker_host(d, decode_host)) < 0)
                return fail(d, r, "configure-worker-host");
        if ((r = epd_ring_open(c, 64, 256, &ring)) < 0)
                return fail(c, r, "open-ring");
        printf("ring-open\n");
        char last[64] = "";
        unsigned n = 0;
        while (now_ms() < end) {
                struct epd_ring_record rec;
                while ((r = epd_ring_next(ring, &rec, 100000)) >= 0) {
                        struct epd_ring_backpressure bp;
                        if (epd_ring_record_backpressure(&rec, &bp) < 0)
                                continue;
                        printf("backpressure %s %u %u %u %" PRIu64 "\n", bp.peer, bp.level, bp.reason, bp.permille,
                               bp.retry_after_usec);
                }
                if (r != -EAGAIN)
                        return fail(c, r, "ring");
                char rid[40];
                epd_admission a;
                snprintf(rid, sizeof rid, "watch-%u", n++);
                if ((r = epd_admit(c, rid, "interactive", 0, 0, false, &a)) < 0)
                        return fail(c, r, "admit");
                static const char *const verdicts[] = { "admit", "defer", "reject" };
                char now[64];
                snprintf(now, sizeof now, "%s %s", verdicts[a.verdict], a.reason);
                if (strcmp(now, last) != 0) {
                        printf("verdict %s\n", now);
                        snprintf(last, sizeof last, "%s", now);
                }
                if (a.verdict == EPD_ADMIT &&
                    ((r = epd_complete(c, rid, "prefill", 1000, true)) < 0 ||
                     (r = epd_complete(c, rid, "decode", 1000, true)) < 0))
                        return fail(c, r, "complete");
        }
        printf("done\n");
        epd_ring_close(ring);
        epd_disconnect(d);
        epd_disconnect(c);
        return 0;
}

int main(int argc, char *argv[]) {
        setvbuf(stdout, NULL, _IOLBF, 0);
        bench = getenv("HANDOFF_CLIENT_BENCH") && strcmp(getenv("HANDOFF_CLIENT_BENCH"), "1") == 0;
        release_on_commit = getenv("HANDOFF_CLIENT_RELEASE_ON_COMMIT") &&
                            strcmp(getenv("HANDOFF_CLIENT_RELEASE_ON_COMMIT"), "1") == 0;
        retry_backpressure = getenv("HANDOFF_CLIENT_RETRY_BACKPRESSURE") &&
                             strcmp(getenv("HANDOFF_CLIENT_RETRY_BACKPRESSURE"), "1") == 0;
        if (argc == 10 && strcmp(argv[1], "prefill") == 0)
                return run_prefill(argv + 2);
        if (argc == 5 && strcmp(argv[1], "decode") == 0)
                return run_decode(argv + 2);
        if (argc == 5 && strcmp(argv[1], "watch") == 0)
                return run_watch(argv + 2);
        fprintf(stderr,
                "usage: %s prefill ADDRESS ARENA DEST_HOST REQUEST_ID PAGES GROUPS DELAY_MS TIMEOUT_MS\n"
                "       %s decode ADDRESS REQUEST_ID TIMEOUT_MS\n"
                "       %s watch ADDRESS DECODE_HOST SECONDS\n",
                argv[0], argv[0], argv[0]);
        return 2;
}
