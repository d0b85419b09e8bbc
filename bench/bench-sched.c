/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Benchmarks of the scheduler, the WAL and restart, each beside a limit measured in
 * the same run:
 *   1. admission decisions per second  vs  the bare bookkeeping of a request id
 *      (hashmap put + get + remove), the least any admission has to do;
 *   2. WAL appends per second per fsync policy  vs  raw write() (+ fdatasync, as the
 *      policy does) of the very same bytes to a file in the same directory; and the
 *      writer thread's group commit under load: 1, 8 and 64 appenders each waiting
 *      for its own record to be durable before the next (as a D-Bus reply does),
 *      durable records per second and records per fdatasync  vs  raw write+fdatasync
 *      of one record at a time;
 *   3. restart-to-serving with a full arena (adopt the arena fd kept by the fd store,
 *      map it, replay the WAL)  vs  copying the arena's bytes back (what a restart that
 *      reloads memory would need at the least); then the same with the arena full of
 *      committed sequences (half of them clones sharing every page) and a feature
 *      arena full of cached features, whose WAL records are replayed for real: the
 *      page pool's refcounts and free list and the feature index rebuilt; and with the
 *      arena full of prefix cache (every page a block-directory entry, no sequence)
 *      plus journaled handoffs, half of them in flight (rolled back at the restart).
 * Usage: bench-sched [DIR] (default: $TMPDIR or /tmp; use a real disk for fsync). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/arena.h"
#include "pages/directory-record.h"
#include "pages/directory.h"
#include "feature/feature.h"
#include "handoff/handoff-record.h"
#include "hashmap.h"
#include "pages/pages.h"
#include "pages/sequence-record.h"
#include "sched/scheduler.h"
#include "time-util.h"
#include "wal/wal-writer.h"
#include "wal/wal.h"

static double now_s(void) {
        return (double)now_nsec(CLOCK_MONOTONIC) / 1e9;
}

static void bench_admission(void) {
        SchedConfig c;
        Scheduler *s;
        sched_config_defaults(&c);
        if (sched_new(&c, &s) < 0)
                abort();
        char id[32];
        for (int i = 0; i < 8; i++) {
                snprintf(id, sizeof id, "p%d", i);
                sched_worker_add(s, &(SchedWorkerInfo){ .id = id, .stage = SCHED_STAGE_PREFILL, .pools = 7, .slots = 8 });
                snprintf(id, sizeof id, "d%d", i);
                sched_worker_add(s, &(SchedWorkerInfo){ .id = id, .stage = SCHED_STAGE_DECODE, .pools = 7, .slots = 16,
                                                        .free_pages = 1 << 20 });
        }
        enum { N = 400000, WINDOW = 64 };
        static char ids[WINDOW][32];
        uint64_t admitted = 0;
        usec_t now = 1000 * USEC_PER_SEC;
        double t0 = now_s();
        for (int i = 0; i < N; i++) {
                SchedDecision d;
                char *rid = ids[i % WINDOW];
                if (i >= WINDOW) {
                        (void)sched_complete(s, rid, SCHED_STAGE_PREFILL, 1000, true, now);
                        (void)sched_complete(s, rid, SCHED_STAGE_DECODE, 5000, true, now);
                }
                snprintf(rid, 32, "req-%d", i);
                if (sched_admit(s, rid, (TaskType)(i % 3), 0, &(SchedHints){ .pages_needed = 4 }, now, &d) < 0)
                        abort();
                admitted += d.verdict == SCHED_ADMIT;
                now += 100;
        }
        double t = now_s() - t0;
        sched_free(s);

        /* The limit: keep and forget the request id. */
        Hashmap *h = hashmap_new(HASHMAP_KEY_STRING, 0);
        t0 = now_s();
        for (int i = 0; i < N; i++) {
                char *rid = ids[i % WINDOW];
                if (i >= WINDOW)
                        hashmap_remove(h, rid);
                snprintf(rid, 32, "req-%d", i);
                hashmap_put(h, rid, rid);
                if (!hashmap_get(h, rid))
                        abort();
        }
        double tl = now_s() - t0;
        hashmap_free(h);
        printf("admission: %.0f decisions/s (%" PRIu64 " admitted of %d, 16 workers, %d outstanding); "
               "limit (id bookkeeping) %.0f/s; ratio %.3f\n",
               N / t, admitted, N, WINDOW, N / tl, (N / t) / (N / tl));
}

static int noop_apply(void *u, const WalRecord *r, bool s) {
        (*(uint64_t *)u)++;
        return 0;
}

static void bench_wal(const char *base) {
        enum { PAYLOAD = 128, BATCH = 64 };
        uint8_t payload[PAYLOAD], rec[512];
        memset(payload, 0x5a, sizeof payload);
        size_t rsize = wal_record_size(PAYLOAD);

        for (int p = 0; p < _WAL_SYNC_POLICY_MAX; p++) {
                int n = p == WAL_SYNC_ALWAYS ? 2000 : p == WAL_SYNC_BATCH ? 50000 : 200000;
                char dir[512], raw[600];
                snprintf(dir, sizeof dir, "%s/bench-wal-%d-XXXXXX", base, p);
                if (!mkdtemp(dir)) {
                        perror("mkdtemp");
                        exit(1);
                }
                Wal *w;
                uint64_t cnt = 0;
                if (wal_open(dir, (WalSyncPolicy)p, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                        abort();
                double t0 = now_s();
                for (int i = 0; i < n; i++) {
                        if (wal_append(w, WAL_RECORD_TEST, payload, PAYLOAD, NULL) < 0)
                                abort();
                        if (p == WAL_SYNC_BATCH && (i + 1) % BATCH == 0)
                                wal_sync(w);
                }
                wal_sync(w);
                double t = now_s() - t0;
                wal_free(w);

                /* The same bytes, written raw to a file in the same directory. */
                snprintf(raw, sizeof raw, "%s/raw", dir);
                int fd = open(raw, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
                if (fd < 0)
                        abort();
                wal_record_encode(rec, 1, WAL_RECORD_TEST, payload, PAYLOAD);
                t0 = now_s();
                for (int i = 0; i < n; i++) {
                        if (write(fd, rec, rsize) != (ssize_t)rsize)
                                abort();
                        if (p == WAL_SYNC_ALWAYS || (p == WAL_SYNC_BATCH && (i + 1) % BATCH == 0))
                                fdatasync(fd);
                }
                if (p != WAL_SYNC_NONE)
                        fdatasync(fd);
                double tl = now_s() - t0;
                close(fd);
                printf("wal %-6s: %.0f appends/s (%zu-byte records%s); limit raw write%s %.0f/s; ratio %.3f\n",
                       wal_sync_policy_to_string(p), n / t, rsize, p == WAL_SYNC_BATCH ? ", sync every 64" : "",
                       p == WAL_SYNC_NONE ? "" : "+fdatasync", n / tl, (n / t) / (n / tl));
                char cmd[700];
                snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
                if (system(cmd) != 0)
                        fprintf(stderr, "could not remove %s\n", dir);
        }
}

typedef struct GcClient {
        WalWriter *ww;
        int n;
} GcClient;

static void *gc_client(void *userdata) {
        GcClient *c = userdata;
        uint8_t payload[128];
        memset(payload, 0x33, sizeof payload);
        for (int i = 0; i < c->n; i++) {
                uint64_t lsn;
                if (wal_writer_append(c->ww, WAL_RECORD_TEST, payload, sizeof payload, &lsn) < 0 ||
                    wal_writer_wait(c->ww, lsn) < 0)
                        abort();
        }
        return NULL;
}

/* Group commit: appenders that each wait for their own record, like replies do. */
static void bench_group_commit(const char *base) {
        char dir[512];
        snprintf(dir, sizeof dir, "%s/bench-wal-gc-XXXXXX", base);
        if (!mkdtemp(dir)) {
                perror("mkdtemp");
                exit(1);
        }
        /* The limit: one record written and fdatasynced at a time (what each reply
         * would cost without group commit). */
        char raw[600];
        uint8_t rec[512], payload[128];
        memset(payload, 0x33, sizeof payload);
        wal_record_encode(rec, 1, WAL_RECORD_TEST, payload, sizeof payload);
        size_t rsize = wal_record_size(sizeof payload);
        snprintf(raw, sizeof raw, "%s/raw", dir);
        int fd = open(raw, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND | O_CLOEXEC, 0600);
        if (fd < 0)
                abort();
        int nraw = 500;
        double t0 = now_s();
        for (int i = 0; i < nraw; i++)
                if (write(fd, rec, rsize) != (ssize_t)rsize || fdatasync(fd) < 0)
                        abort();
        double limit = nraw / (now_s() - t0);
        close(fd);
        (void)unlink(raw);

        static const int clients[] = { 1, 8, 64 };
        for (size_t k = 0; k < ELEMENTSOF(clients); k++) {
                Wal *w;
                uint64_t cnt = 0;
                char sub[600];
                snprintf(sub, sizeof sub, "%s/c%d", dir, clients[k]);
                if (wal_open(sub, WAL_SYNC_BATCH, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                        abort();
                WalWriter *ww;
                if (wal_writer_new(w, &ww) < 0)
                        abort();
                int per = MAX(2000 / clients[k], 50);
                pthread_t th[64];
                GcClient c = { ww, per };
                t0 = now_s();
                for (int i = 0; i < clients[k]; i++)
                        if (pthread_create(&th[i], NULL, gc_client, &c) != 0)
                                abort();
                for (int i = 0; i < clients[k]; i++)
                        pthread_join(th[i], NULL);
                double t = now_s() - t0;
                WalWriterStats st;
                wal_writer_stats(ww, &st);
                double rate = (double)st.synced_records / t;
                printf("wal group commit, %2d appenders each waiting for its record: %.0f durable records/s, "
                       "%.1f records per fdatasync (%" PRIu64 " syncs); limit write+fdatasync per record %.0f/s; "
                       "ratio %.2f\n",
                       clients[k], rate, st.syncs ? (double)st.synced_records / (double)st.syncs : 0.0, st.syncs,
                       limit, rate / limit);
                wal_writer_free(ww);
                wal_free(w);
        }
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
                fprintf(stderr, "could not remove %s\n", dir);
}

/* A host arena of `size` bytes, every byte written, and a dup of its fd (what the fd
 * store keeps), made from *ac; NULL, having said why, where none can be made. */
static Arena *full_arena(ArenaConfig *ac, uint64_t size, const char *what, int *ret_fd) {
        *ac = (ArenaConfig){ .name = (char *)"bench0", .domain = MEMORY_HOST, .usage = ARENA_USAGE_KV,
                             .size = size, .hugepages = HUGEPAGES_NO, .numa_node = -1, .gpu = -1 };
        Arena *a;
        if (arena_new_host(ac, 0, "bench", &a) < 0) {
                printf("%s: skipped (cannot create a %" PRIu64 " MiB arena)\n", what, size >> 20);
                return NULL;
        }
        memset((uint8_t *)a->base + a->data_offset, 0xa5, arena_data_size(a));
        *ret_fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 3);
        return a;
}

static void bench_restart(const char *base) {
        const uint64_t size = 256ULL << 20;
        ArenaConfig ac;
        int fd;
        Arena *a = full_arena(&ac, size, "restart", &fd);
        if (!a)
                return;

        /* A WAL with a realistic backlog since the last compaction. */
        char dir[512];
        snprintf(dir, sizeof dir, "%s/bench-restart-XXXXXX", base);
        if (!mkdtemp(dir))
                abort();
        Wal *w;
        uint64_t cnt = 0;
        uint8_t payload[96] = {};
        enum { RECORDS = 100000 };
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                abort();
        for (int i = 0; i < RECORDS; i++)
                wal_append(w, WAL_RECORD_TEST, payload, sizeof payload, NULL);
        wal_free(w);
        arena_free(a); /* the old daemon is gone; the fd store holds `fd` */

        double t0 = now_s();
        Arena *b;
        if (arena_adopt_host(&ac, 0, fd, "bench", &b) < 0)
                abort();
        cnt = 0;
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                abort();
        double t = now_s() - t0;
        if (cnt != RECORDS || ((uint8_t *)b->base)[b->data_offset + 12345] != 0xa5)
                abort();
        wal_free(w);

        /* The limit: copying the arena's bytes back from anywhere. */
        void *src = malloc(arena_data_size(b));
        if (!src)
                abort();
        memset(src, 0x5a, arena_data_size(b));
        t0 = now_s();
        memcpy((uint8_t *)b->base + b->data_offset, src, arena_data_size(b));
        double tl = now_s() - t0;
        free(src);
        arena_free(b);
        printf("restart: adopt %" PRIu64 " MiB arena + replay %d WAL records in %.2f ms; limit (copy the arena "
               "back) %.2f ms; ratio %.1fx faster\n",
               size >> 20, RECORDS, t * 1e3, tl * 1e3, tl / t);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
                fprintf(stderr, "could not remove %s\n", dir);
}

/* What epdd's replay does with sequence and feature records, without the bus: the
 * last PUT per sequence, then refcounts and free lists (page_manager_restore_finish()). */
typedef struct StateReplay {
        uint32_t **tables;
        uint32_t *n;
        size_t n_seqs;
        FeatureCache *features;
        uint64_t records;
} StateReplay;

static int state_apply(void *u, const WalRecord *r, bool from_snapshot) {
        StateReplay *st = u;
        st->records++;
        if (r->type >> 8 == WAL_RECORD_SEQUENCE >> 8) {
                SequenceRecord rec;
                if (sequence_record_put_parse(r->payload, r->length, &rec) < 0)
                        return -EBADMSG;
                uint32_t i;
                memcpy(&i, rec.id.bytes, sizeof i);
                if (i >= st->n_seqs)
                        return -EBADMSG;
                uint32_t *t = realloc(st->tables[i], (rec.n_pages ? rec.n_pages : 1) * sizeof *t);
                if (!t)
                        return -ENOMEM;
                for (uint32_t k = 0; k < rec.n_pages; k++)
                        t[k] = sequence_record_page(&rec, k);
                st->tables[i] = t;
                st->n[i] = rec.n_pages;
                return 0;
        }
        if (r->type >> 8 == WAL_RECORD_FEATURE >> 8)
                return feature_cache_apply_record(st->features, r->type, r->payload, r->length);
        return 0;
}

static void bench_restart_state(const char *base) {
        const uint64_t size = 256ULL << 20, page = 32 << 10, feat = 256 << 10;
        ArenaConfig ac = { .name = (char *)"bench0", .domain = MEMORY_HOST, .usage = ARENA_USAGE_KV,
                           .size = size, .hugepages = HUGEPAGES_NO, .numa_node = -1, .gpu = -1 };
        ArenaConfig fc = { .name = (char *)"feat0", .domain = MEMORY_HOST, .usage = ARENA_USAGE_FEATURE,
                           .size = size, .hugepages = HUGEPAGES_NO, .numa_node = -1, .gpu = -1 };
        Arena *a, *fa;
        if (arena_new_host(&ac, 0, "bench", &a) < 0 || arena_new_host(&fc, 1, "bench", &fa) < 0) {
                printf("restart with state: skipped (cannot create two %" PRIu64 " MiB arenas)\n", size >> 20);
                return;
        }
        memset((uint8_t *)a->base + a->data_offset, 0xa5, arena_data_size(a));
        memset((uint8_t *)fa->base + fa->data_offset, 0x5a, arena_data_size(fa));
        int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 3), ffd = fcntl(fa->fd, F_DUPFD_CLOEXEC, 3);
        uint64_t n_pages = arena_data_size(a) / page, n_feat = arena_data_size(fa) / feat;
        const uint32_t per_seq = 64;
        size_t n_seqs = 2 * (size_t)(n_pages / per_seq); /* originals + one clone each */

        char dir[512];
        snprintf(dir, sizeof dir, "%s/bench-restart-state-XXXXXX", base);
        if (!mkdtemp(dir))
                abort();
        Wal *w;
        uint64_t cnt = 0;
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                abort();
        /* Sequences: create with 16 pages, append 3 × 16 (4 PUTs each), then clone. */
        PageId *pages = malloc(per_seq * sizeof *pages);
        uint8_t *buf = malloc(sequence_record_put_size(0, per_seq));
        if (!pages || !buf)
                abort();
        for (size_t s = 0; s < n_seqs; s++) {
                EpdId id = {};
                uint32_t i = (uint32_t)s;
                memcpy(id.bytes, &i, sizeof i);
                size_t orig = s / 2;
                for (uint32_t k = 0; k < per_seq; k++)
                        pages[k] = (PageId)(orig * per_seq + k);
                for (uint32_t n = (s % 2 ? per_seq : 16); n <= per_seq; n += 16) {
                        sequence_record_put_encode(buf, &id, 0, 0, page, 0, NULL, 0, pages, n);
                        wal_append(w, WAL_RECORD_SEQUENCE + SEQUENCE_REC_PUT, buf, sequence_record_put_size(0, n),
                                   NULL);
                }
        }
        /* Features: the whole feature arena, published one by one. */
        FeatureCacheConfig cfg = { .budget_bytes = size };
        FeatureCache *fcache;
        if (feature_cache_new(&cfg, &fcache) < 0 ||
            feature_cache_add_arena(fcache, 1, NULL, fa->data_offset, arena_data_size(fa), 64 << 10) < 0)
                abort();
        uint8_t fdesc[128];
        for (uint64_t k = 0; k < n_feat; k++) {
                /* READY payload by hand (feature.h): a f32 [feat/4] tensor. */
                char key[32];
                int kl = snprintf(key, sizeof key, "image:%" PRIu64, k);
                uint8_t d[64];
                size_t dl = 0;
                memcpy(d, "EPDFDESC", 8);
                dl = 8;
                uint32_t v = 1, nt = 1;
                memcpy(d + dl, &v, 4), dl += 4;
                memcpy(d + dl, &nt, 4), dl += 4;
                d[dl++] = 1, d[dl++] = 'x', d[dl++] = 0 /* f32 */, d[dl++] = 1;
                d[dl++] = 0, d[dl++] = 0;
                uint64_t off = 0, shape = feat / 4, stride = 1;
                memcpy(d + dl, &off, 8), dl += 8;
                memcpy(d + dl, &shape, 8), dl += 8;
                memcpy(d + dl, &stride, 8), dl += 8;
                uint32_t hdr32[2] = { 1, (uint32_t)kl };
                uint64_t hdr64[4] = { fa->data_offset + k * feat, feat, feat, 1000 };
                uint32_t tail[2] = { (uint32_t)dl, 0 };
                size_t len = 0;
                memcpy(fdesc + len, hdr32, 8), len += 8;
                memcpy(fdesc + len, hdr64, 32), len += 32;
                memset(fdesc + len, 0, 16), len += 16;
                memcpy(fdesc + len, tail, 8), len += 8;
                memcpy(fdesc + len, key, (size_t)kl), len += (size_t)kl;
                memcpy(fdesc + len, d, dl), len += dl;
                wal_append(w, WAL_RECORD_FEATURE + FEATURE_REC_READY, fdesc, len, NULL);
        }
        uint64_t records = wal_last_lsn(w);
        wal_free(w);
        free(pages);
        free(buf);
        arena_free(a);
        arena_free(fa);

        StateReplay st = { .n_seqs = n_seqs, .features = fcache };
        st.tables = calloc(n_seqs, sizeof *st.tables);
        st.n = calloc(n_seqs, sizeof *st.n);
        if (!st.tables || !st.n)
                abort();
        double t0 = now_s();
        Arena *b, *fb;
        PagePool *pool;
        if (arena_adopt_host(&ac, 0, fd, "bench", &b) < 0 || arena_adopt_host(&fc, 1, ffd, "bench", &fb) < 0)
                abort();
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, state_apply, &st) < 0)
                abort();
        if (page_pool_new(n_pages, page, b->data_offset, &pool) < 0)
                abort();
        uint32_t *refs = calloc(n_pages, sizeof *refs);
        if (!refs)
                abort();
        for (size_t s = 0; s < n_seqs; s++)
                for (uint32_t k = 0; k < st.n[s]; k++)
                        refs[st.tables[s][k]]++;
        if (page_pool_restore(pool, refs) < 0)
                abort();
        double t = now_s() - t0;
        PagePoolStats ps;
        page_pool_stats(pool, &ps);
        if (st.records != records || ps.free != n_pages % per_seq || ps.shared != n_pages - n_pages % per_seq ||
            feature_cache_stats(fcache)->n_features != n_feat || page_pool_verify(pool) < 0)
                abort();
        wal_free(w);

        void *src = malloc(2 * size);
        if (!src)
                abort();
        memset(src, 0x5a, 2 * size);
        t0 = now_s();
        memcpy((uint8_t *)b->base + b->data_offset, src, arena_data_size(b));
        memcpy((uint8_t *)fb->base + fb->data_offset, (uint8_t *)src + size, arena_data_size(fb));
        double tl = now_s() - t0;
        free(src);
        printf("restart with state: adopt 2 x %" PRIu64 " MiB arenas + replay %" PRIu64 " records (%zu sequences "
               "over %" PRIu64 " pages, %" PRIu64 " features) + rebuild the pool in %.2f ms; limit (copy both arenas "
               "back) %.2f ms; ratio %.1fx faster\n",
               size >> 20, records, n_seqs, n_pages, n_feat, t * 1e3, tl * 1e3, tl / t);
        for (size_t s = 0; s < n_seqs; s++)
                free(st.tables[s]);
        free(st.tables);
        free(st.n);
        free(refs);
        page_pool_free(pool);
        feature_cache_free(fcache);
        arena_free(b);
        arena_free(fb);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
                fprintf(stderr, "could not remove %s\n", dir);
}

/* Restart-to-serving with a full arena of prefix cache: every page of a 256 MiB KV
 * arena is a block-directory entry that no sequence holds (IDLE, evictable), and 1024
 * handoff sides are journaled (512 committed, 512 in flight). What epdd does at start:
 * adopt the arena by fd, replay the directory PUTs (last per hash) and the handoff
 * records (the journal), rebuild the pool with the entries' pages, insert every entry
 * again, drop the temporary references (pages IDLE again) and roll back what was in
 * flight. Limit: copying the arena's bytes back. */
typedef struct DirReplay {
        DirectoryRecord *entries;
        uint64_t n_entries, cap;
        HandoffJournal journal;
        uint64_t records;
} DirReplay;

static int dir_apply(void *u, const WalRecord *r, bool from_snapshot) {
        DirReplay *st = u;
        st->records++;
        if (r->type >> 8 == WAL_RECORD_DIRECTORY >> 8) {
                DirectoryRecord rec;
                if (directory_record_put_parse(r->payload, r->length, &rec) < 0 || st->n_entries >= st->cap)
                        return -EBADMSG;
                st->entries[st->n_entries++] = rec; /* hashes are unique here */
                return 0;
        }
        if (r->type >> 8 == WAL_RECORD_HANDOFF >> 8)
                return handoff_journal_apply(&st->journal, (uint8_t)(r->type & 0xff), r->payload, r->length);
        return 0;
}

static void bench_restart_directory(const char *base) {
        const uint64_t size = 256ULL << 20, page = 32 << 10;
        ArenaConfig ac;
        int fd;
        Arena *a = full_arena(&ac, size, "restart with prefix cache", &fd);
        if (!a)
                return;
        uint64_t n_pages = arena_data_size(a) / page;
        const unsigned n_handoffs = 512;

        char dir[512];
        snprintf(dir, sizeof dir, "%s/bench-restart-dir-XXXXXX", base);
        if (!mkdtemp(dir))
                abort();
        Wal *w;
        uint64_t cnt = 0;
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, noop_apply, &cnt) < 0)
                abort();
        uint8_t buf[HANDOFF_REC_PREPARED_SIZE(8)];
        for (uint64_t p = 0; p < n_pages; p++) {
                DirectoryRecord rec = { .hash = 0x9e3779b97f4a7c15ULL * (p + 1), .arena = 0, .page = (uint32_t)p,
                                        .page_size = page };
                directory_record_put_encode(buf, &rec);
                wal_append(w, WAL_RECORD_DIRECTORY + DIRECTORY_REC_PUT, buf, DIRECTORY_REC_PUT_SIZE, NULL);
        }
        uint32_t hpages[8] = { 0, 1, 2, 3, 4, 5, 6, 7 };
        for (unsigned k = 0; k < n_handoffs; k++) {
                HandoffRecord r = { .type = HANDOFF_REC_PREPARED, .token = 1000 + k, .role = (HandoffRole)(k % 2),
                                    .value = 4, .arena = 0, .n_pages = 8, .page_size = page };
                memcpy(r.request_id.bytes, &k, sizeof k);
                handoff_record_encode(buf, &r, hpages);
                wal_append(w, WAL_RECORD_HANDOFF + HANDOFF_REC_PREPARED, buf, handoff_record_size(&r), NULL);
                if (k % 4 < 2) {
                        r.type = HANDOFF_REC_COMMITTED;
                        r.value = 0;
                        handoff_record_encode(buf, &r, NULL);
                        wal_append(w, WAL_RECORD_HANDOFF + HANDOFF_REC_COMMITTED, buf, handoff_record_size(&r), NULL);
                }
        }
        uint64_t records = wal_last_lsn(w);
        wal_free(w);
        arena_free(a);

        DirReplay st = { .cap = n_pages };
        st.entries = calloc(n_pages, sizeof *st.entries);
        if (!st.entries || handoff_journal_init(&st.journal) < 0)
                abort();
        double t0 = now_s();
        Arena *b;
        PagePool *pool;
        Directory *d;
        if (arena_adopt_host(&ac, 0, fd, "bench", &b) < 0)
                abort();
        if (wal_open(dir, WAL_SYNC_NONE, &w) < 0 || wal_replay(w, dir_apply, &st) < 0)
                abort();
        if (page_pool_new(n_pages, page, b->data_offset, &pool) < 0 || directory_new(&d) < 0)
                abort();
        directory_attach_pool(d, pool);
        uint32_t *refs = calloc(n_pages, sizeof *refs);
        if (!refs)
                abort();
        for (uint64_t i = 0; i < st.n_entries; i++)
                refs[st.entries[i].page] = 1;
        if (page_pool_restore(pool, refs) < 0)
                abort();
        for (uint64_t i = 0; i < st.n_entries; i++)
                if (directory_insert(d, pool, st.entries[i].hash, st.entries[i].page) < 0)
                        abort();
        for (uint64_t i = 0; i < st.n_entries; i++)
                (void)page_unref(pool, st.entries[i].page);
        unsigned rolled_back = handoff_journal_recover(&st.journal, NULL, NULL);
        double t = now_s() - t0;
        PagePoolStats ps;
        page_pool_stats(pool, &ps);
        if (st.records != records || ps.cached_idle != n_pages || directory_size(d) != n_pages ||
            rolled_back != n_handoffs / 2 || page_pool_verify(pool) < 0)
                abort();
        wal_free(w);

        void *src = malloc(size);
        if (!src)
                abort();
        memset(src, 0x5a, size);
        t0 = now_s();
        memcpy((uint8_t *)b->base + b->data_offset, src, arena_data_size(b));
        double tl = now_s() - t0;
        free(src);
        printf("restart with prefix cache: adopt a %" PRIu64 " MiB arena + replay %" PRIu64 " records (%" PRIu64
               " directory entries, every page cached; %u handoff sides, %u rolled back) + rebuild pool and directory "
               "in %.2f ms; limit (copy the arena back) %.2f ms; ratio %.1fx faster\n",
               size >> 20, records, n_pages, n_handoffs, rolled_back, t * 1e3, tl * 1e3, tl / t);
        directory_free(d);
        page_pool_free(pool);
        handoff_journal_done(&st.journal);
        free(st.entries);
        free(refs);
        arena_free(b);
        char cmd[700];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
        if (system(cmd) != 0)
                fprintf(stderr, "could not remove %s\n", dir);
}

int main(int argc, char **argv) {
        const char *base = argc > 1 ? argv[1] : getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
        bench_admission();
        bench_wal(base);
        bench_group_commit(base);
        bench_restart(base);
        bench_restart_state(base);
        bench_restart_directory(base);
        return 0;
}
