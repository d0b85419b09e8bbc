/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Handoffs between GPU arenas through a real epdd, by real worker processes, each
 * against a limit measured in the same run:
 *
 *   gpu -> gpu    a prefill worker process hands a sequence of 2 MiB pages from one GPU
 *                 arena to another (same GPU; and GPU 0 -> GPU 1 where there are two),
 *                 a decode worker process (which imported the destination arena's fd)
 *                 accepts, watches it land and commits; vs one raw cuMemcpyDtoDAsync
 *                 (cuMemcpyPeerAsync between GPUs) of the same bytes between the same
 *                 mappings, in the prefill worker
 *   layer groups  the same with 8 layer groups: each group is 256 KiB of every page,
 *                 scattered with a 2 MiB stride, under [Gpu] CopyKernel=small (the
 *                 batched copy kernel; groups that queue up go 4 to a batch) and again
 *                 with MergeGroups=1 (every group alone), and =never (copy engines,
 *                 cuMemcpyBatchAsync where the driver has it)
 *   gpu <-> host  to and from a host arena (pinned by epdd) vs raw cuMemcpyDtoHAsync /
 *                 HtoDAsync with a cuMemAllocHost buffer
 *   CoW           a clone of a sequence in a GPU arena, one page written: exactly that
 *                 page copied, bytes equal (time of PrepareWrite; no limit)
 *
 * Handoff time: from just before the prefill worker's first LayerGroupReady to the
 * decode worker seeing every group landed (epd_handoff_get), CLOCK_MONOTONIC across the
 * two processes; median of REPS after a warm-up. The first handoff of every case is
 * checked word by word in the decode worker (every 256 KiB of every page holds its own
 * value). Usage: gpu-handoff-bench EPDD [--quick]. Exits 77 without a GPU. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/epd-gpu.h"
#include "epd/epd-telemetry.h"
#include "epd/epd.h"
#include "epd/handoff.h"
#include "gpu-test-util.h"
#include "system.h"

#define MiB UINT64_C(1048576)
#define GiB (UINT64_C(1024) * MiB)
#define PAGE (2 * MiB)
#define CHUNK (256 * 1024ULL)
#define REPS 5
#define MAX_ROWS 32
#define MAX_GROUPS 8

static const epd_kv_layout kv = { .layers = 32, .tokens_per_block = 16, .k_bytes_per_token = 2048,
                                  .v_bytes_per_token = 2048, .dtype = "bf16" }; /* 2 MiB pages */
static const uint32_t groups1[1] = { 32 };
static const uint32_t groups8[8] = { 4, 4, 4, 4, 4, 4, 4, 4 };

typedef struct Row {
        char name[96];
        uint64_t bytes;
        double ms, limit_ms, goal;
        bool ok;
} Row;

typedef struct Case {
        const char *name;
        const char *src, *dst;  /* arenas */
        const uint32_t *groups;
        size_t n_groups;
        bool host;              /* size SH (host arena) instead of S */
        bool poll;              /* the decode polls GetAll instead of waiting on its ring */
} Case;

typedef enum { M_PREPARED, M_ACCEPTED, M_T0, M_DONE, M_QUIT } MsgKind;

typedef struct Msg {
        MsgKind kind;
        char rid[33];
        uint32_t n_pages;
        uint32_t n_groups;
        bool verify;
        char dst[16];
        double t;
        bool ok;
        bool poll;
        double at[MAX_GROUPS];  /* M_DONE: when each group was seen landed; M_T0: LayerGroupReady returned */
} Msg;

static uint64_t S, SH; /* bytes of a GPU and of a host handoff */
static int n_gpus;
/* The daemon of the current run(): more [Gpu] settings, and where its copy engine's
 * timeline goes ("": none; EPD_GPU_COPY_TIMELINE, docs/gpu.md). */
static const char *gpu_extra = "";
static char timeline_path[600];

static uint32_t word(uint32_t page, uint64_t chunk) {
        return (uint32_t)mix64((uint64_t)page * 4096 + chunk + 1);
}

static void msg_send(int fd, const Msg *m) {
        REQUIRE(write(fd, m, sizeof *m) == (ssize_t)sizeof *m, "pipe write: %m");
}

static void msg_recv(int fd, Msg *m) {
        REQUIRE(read(fd, m, sizeof *m) == (ssize_t)sizeof *m, "pipe read: %m");
}

static epd_client *worker(const char *address, const char *role) {
        epd_client *c = NULL;
        CHECK(epd_connect(address, &c));
        int r = epd_register(c, role, "bench", "cuda:0", &kv, NULL);
        REQUIRE(r >= 0, "register: %s", epd_last_error_message(c));
        return c;
}

typedef struct Mapped {
        const char *name;
        bool gpu;
        int ordinal;            /* this process's ordinal of the arena's GPU */
        uint64_t dev;
        uint8_t *host;
        EpdGpuMapping *m;
} Mapped;

static EpdGpu *G;
static GpuSystem *SYS;

static void map(epd_client *c, Mapped *x) {
        int i = epd_arena_find(c, x->name);
        REQUIRE(i >= 0, "no arena %s", x->name);
        if (x->gpu) {
                CHECK(epd_gpu_arena_map(c, G, (size_t)i, &x->m));
                x->dev = epd_gpu_mapping_device_pointer(x->m);
        } else {
                void *b;
                CHECK(epd_arena_map(c, (size_t)i, &b));
                x->host = b;
        }
}

static Mapped *find(Mapped *v, size_t n, const char *name) {
        for (size_t i = 0; i < n; i++)
                if (strcmp(v[i].name, name) == 0)
                        return &v[i];
        REQUIRE(false, "arena %s not mapped", name);
        return NULL;
}

static char *make_sequence(epd_client *c, const char *arena, uint32_t n, uint64_t **offs) {
        sd_bus_message *reply = NULL;
        sd_bus_error e = SD_BUS_ERROR_NULL;
        const char *path;
        const void *v;
        size_t sz;
        int r = epd__call(c, "/org/epd1/pages", "org.epd1.Pages", "CreateSequence", &reply, "su", arena, n);
        REQUIRE(r >= 0, "CreateSequence %s %u: %s", arena, n, epd_last_error_message(c));
        CHECK(sd_bus_message_read(reply, "o", &path));
        char *p = strdup(path);
        sd_bus_message_unref(reply);
        CHECK(sd_bus_get_property(c->bus, NULL, p, "org.epd1.Sequence", "Offsets", &e, &reply, "at"));
        CHECK(sd_bus_message_read_array(reply, 't', &v, &sz));
        REQUIRE(sz / 8 == n, "offsets");
        *offs = malloc(sz);
        memcpy(*offs, v, sz);
        sd_bus_message_unref(reply);
        return p;
}

static void fill(Mapped *x, const uint64_t *offs, uint32_t n) {
        for (uint32_t p = 0; p < n; p++)
                for (uint64_t k = 0; k < PAGE / CHUNK; k++) {
                        uint64_t at = offs[p] + k * CHUNK;
                        if (x->gpu)
                                CHECK(CU(SYS->driver, cuMemsetD32Async, x->dev + at, word(p, k), CHUNK / 4, NULL));
                        else
                                for (uint64_t w = 0; w < CHUNK / 4; w++)
                                        ((uint32_t *)(x->host + at))[w] = word(p, k);
                }
        if (x->gpu)
                CHECK(CU(SYS->driver, cuCtxSynchronize));
}

static bool verify(Mapped *x, const uint64_t *offs, uint32_t n, uint32_t *buf) {
        for (uint32_t p = 0; p < n; p++) {
                const uint32_t *v = buf;
                if (x->gpu)
                        CHECK(CU(SYS->driver, cuMemcpyDtoH, buf, x->dev + offs[p], PAGE));
                else
                        v = (const uint32_t *)(x->host + offs[p]);
                for (uint64_t k = 0; k < PAGE / CHUNK; k++) {
                        /* Whole chunk first (vectorized), the first wrong word only on failure. */
                        const uint64_t *q = (const uint64_t *)(v + k * (CHUNK / 4));
                        uint64_t want = word(p, k) * (UINT64_C(1) << 32 | 1), diff = 0;
                        for (uint64_t w = 0; w < CHUNK / 8; w++)
                                diff |= q[w] ^ want;
                        if (diff == 0)
                                continue;
                        for (uint64_t w = 0; w < CHUNK / 4; w++)
                                if (v[k * (CHUNK / 4) + w] != word(p, k)) {
                                        fprintf(stderr, "page %u word %" PRIu64 " of chunk %" PRIu64 ": %08x, want %08x\n",
                                                p, w, k, v[k * (CHUNK / 4) + w], word(p, k));
                                        return false;
                                }
                }
        }
        return true;
}

/* ---- decode worker ---- */

static void decode_main(const char *address, int fd, const char *const *arenas, size_t n_arenas) {
        epd_client *c = worker(address, "decode");
        Mapped m[8] = {};
        uint32_t *buf = NULL;

        CHECK(epd_gpu_open(&G));
        CHECK(gpu_system_open(getenv("EPD_LIBCUDA"), &SYS));
        CHECK(gpu_device_make_current(SYS, &SYS->devices[0]));
        CHECK(CU(SYS->driver, cuMemAllocHost, (void **)&buf, PAGE));
        for (size_t i = 0; i < n_arenas; i++) {
                m[i].name = arenas[i];
                m[i].gpu = strncmp(arenas[i], "gpu", 3) == 0;
                map(c, &m[i]);
        }
        epd_ring_client *ring = NULL;
        CHECK(epd_ring_open(c, 64, 1024, &ring));
        for (;;) {
                Msg in, out = {};
                epd_handoff_accepted acc;
                epd_handoff_status st;
                msg_recv(fd, &in);
                if (in.kind == M_QUIT)
                        break;
                REQUIRE(in.kind == M_PREPARED, "protocol");
                int r = epd_handoff_accept(c, in.rid, &acc);
                REQUIRE(r >= 0, "Accept: %s", epd_last_error_message(c));
                out.kind = M_ACCEPTED;
                msg_send(fd, &out);
                uint32_t done = acc.groups_done;
                double at[MAX_GROUPS] = {};
                bool rolled_back = false;
                if (in.poll)
                        /* What this benchmark did before 2026-12-04: GetAll back to back. */
                        for (;;) {
                                CHECK(epd_handoff_get(c, acc.path, &st));
                                for (uint32_t g = done; g < st.groups_done && g < MAX_GROUPS; g++)
                                        at[g] = now_sec();
                                done = st.groups_done;
                                rolled_back = strcmp(st.state, "rolled-back") == 0;
                                if (done == in.n_groups || rolled_back)
                                        break;
                        }
                else
                        /* As a decode worker waits: progress records on its ring. */
                        while (done < in.n_groups && !rolled_back) {
                                struct epd_ring_record rec;
                                r = epd_ring_next(ring, &rec, 120 * UINT64_C(1000000));
                                REQUIRE(r >= 0, "ring: %s", strerror(-r));
                                if (rec.token != acc.token)
                                        continue;
                                if (rec.opcode == EPD_RING_EV_GROUP_PROGRESS && rec.group > done) {
                                        for (uint32_t g = done; g < rec.group && g < MAX_GROUPS; g++)
                                                at[g] = now_sec();
                                        done = rec.group;
                                } else if (rec.opcode == EPD_RING_EV_HANDOFF_STATE)
                                        rolled_back = rec.arg0 == EPD_HANDOFF_STATE_ROLLED_BACK;
                        }
                out = (Msg) { .kind = M_DONE, .t = now_sec(), .ok = done == in.n_groups };
                memcpy(out.at, at, sizeof at);
                char *dseq = NULL;
                if (out.ok) {
                        r = epd_handoff_commit(c, acc.path, &dseq);
                        out.ok = r >= 0;
                }
                if (out.ok && in.verify)
                        out.ok = verify(find(m, n_arenas, in.dst), acc.offsets, in.n_pages, buf);
                (void)epd_handoff_release(c, acc.path);
                if (dseq)
                        (void)epd__call(c, dseq, "org.epd1.Sequence", "Release", NULL, NULL);
                free(dseq);
                epd_handoff_accepted_done(&acc);
                Msg t0;
                msg_recv(fd, &t0);
                msg_send(fd, &out);
        }
        epd_ring_close(ring);
        epd_disconnect(c);
        _exit(0);
}

/* ---- prefill worker ---- */

typedef struct Source {
        const char *arena;
        uint64_t bytes;
        char *seq;
        uint64_t *offs;
} Source;

static double raw_copy(Mapped *dst, Mapped *src, uint64_t bytes, void *pinned) {
        double v[REPS + 1];
        CUstream st;
        int dev = src->gpu ? src->ordinal : dst->ordinal;
        CHECK(gpu_device_make_current(SYS, &SYS->devices[dev]));
        CHECK(CU(SYS->driver, cuStreamCreate, &st, CU_STREAM_NON_BLOCKING));
        for (int i = 0; i <= REPS; i++) {
                double t0 = now_sec();
                if (src->gpu && dst->gpu && src->ordinal == dst->ordinal)
                        CHECK(CU(SYS->driver, cuMemcpyDtoDAsync, dst->dev, src->dev, bytes, st));
                else if (src->gpu && dst->gpu)
                        CHECK(CU(SYS->driver, cuMemcpyPeerAsync, dst->dev, SYS->devices[dst->ordinal].ctx, src->dev,
                                 SYS->devices[src->ordinal].ctx, bytes, st));
                else if (src->gpu)
                        CHECK(CU(SYS->driver, cuMemcpyDtoHAsync, pinned, src->dev, bytes, st));
                else
                        CHECK(CU(SYS->driver, cuMemcpyHtoDAsync, dst->dev, pinned, bytes, st));
                CHECK(CU(SYS->driver, cuStreamSynchronize, st));
                v[i] = (now_sec() - t0) * 1e3;
        }
        (void)CU(SYS->driver, cuStreamDestroy, st);
        CHECK(gpu_device_make_current(SYS, &SYS->devices[0]));
        return median(v + 1, REPS);
}

static void put_row(int rows_fd, const char *name, uint64_t bytes, double ms, double limit_ms, double goal, bool ok) {
        Row r = { .bytes = bytes, .ms = ms, .limit_ms = limit_ms, .goal = goal, .ok = ok };
        snprintf(r.name, sizeof r.name, "%s", name);
        printf("RESULT %s bytes=%" PRIu64 " ms=%.3f limit_ms=%.3f ratio=%.3f %s\n", name, bytes, ms, limit_ms,
               limit_ms > 0 ? limit_ms / ms : 0, ok ? "ok" : "FAILED");
        fflush(stdout);
        REQUIRE(write(rows_fd, &r, sizeof r) == (ssize_t)sizeof r, "rows pipe");
}

/* The daemon's copy engine's timeline of the last repetition (gpu_copy_engine_set_timeline()):
 * each part, in ms after the first LayerGroupReady (t0): its submission, its GPU start and
 * end, when epdd's completion thread saw it; then the GPU's idle time between the first
 * start and the last end, and how late parts were seen. */
static unsigned print_timeline(const char *name, double t0) {
        FILE *f = fopen(timeline_path, "re");
        char line[512];
        double busy = 0, idle = 0, lag_max = 0, lag_sum = 0, first = -1, last_end = -1, reap_lag_max = 0;
        double reap_lag_sum = 0;
        unsigned n = 0, n_reaped = 0;
        /* Per job: when the loop reaped it, when its last part was seen (a job's reap line
         * may come before or after its parts' lines). */
        enum { JOBS = 4096 };
        static struct { uint64_t job, at, seen; } jobs[JOBS];
        size_t n_jobs = 0;
        if (!f) {
                printf("gpu timeline %s: none (%m)\n", name);
                return 0;
        }
        while (fgets(line, sizeof line, f)) {
                uint64_t job, at, u;
                double d;
                int x;
                bool reap = sscanf(line, "reap job=%" SCNu64 " at=%" SCNu64, &job, &at) == 2;
                bool part = !reap && sscanf(line,
                                            "part job=%" SCNu64 " dev=%d segs=%" SCNu64 " bytes=%" SCNu64
                                            " enter=%" SCNu64 " queued=%" SCNu64 " gpu_start=%lf gpu_end=%lf seen=%" SCNu64,
                                            &job, &x, &u, &u, &u, &u, &d, &d, &at) == 9;
                if (!reap && !part)
                        continue;
                size_t i = 0;
                while (i < n_jobs && jobs[i].job != job)
                        i++;
                if (i == n_jobs) {
                        if (n_jobs == JOBS)
                                continue;
                        jobs[n_jobs++] = (typeof(jobs[0])) { .job = job };
                }
                if (reap)
                        jobs[i].at = at;
                else if (at > jobs[i].seen)
                        jobs[i].seen = at;
        }
        rewind(f);
        printf("gpu timeline %s (ms after the first LayerGroupReady): job segs MiB | enter queued | gpu start..end | "
               "seen reaped\n",
               name);
        while (fgets(line, sizeof line, f)) {
                uint64_t job, segs, bytes, enter, queued, seen, reaped = 0;
                double gs, ge;
                int dev, err;
                if (sscanf(line,
                           "part job=%" SCNu64 " dev=%d segs=%" SCNu64 " bytes=%" SCNu64 " enter=%" SCNu64
                           " queued=%" SCNu64 " gpu_start=%lf gpu_end=%lf seen=%" SCNu64 " error=%d",
                           &job, &dev, &segs, &bytes, &enter, &queued, &gs, &ge, &seen, &err) != 10 ||
                    gs < 0)
                        continue;
                for (size_t i = 0; i < n_jobs; i++)
                        if (jobs[i].job == job)
                                reaped = jobs[i].at;
                double b = t0 * 1e6;
                printf("  %3" PRIu64 " %5" PRIu64 " %5" PRIu64 " | %6.3f %6.3f | %6.3f..%6.3f | %6.3f %6.3f%s\n", job,
                       segs, bytes >> 20, (enter - b) / 1e3, (queued - b) / 1e3, (gs - b) / 1e3, (ge - b) / 1e3,
                       (seen - b) / 1e3, reaped ? (reaped - b) / 1e3 : -1.0, err ? " error" : "");
                if (first < 0)
                        first = gs;
                if (last_end >= 0 && gs > last_end)
                        idle += gs - last_end;
                busy += ge - gs;
                last_end = last_end < ge ? ge : last_end;
                lag_sum += (double)seen - ge;
                lag_max = lag_max < (double)seen - ge ? (double)seen - ge : lag_max;
                n++;
        }
        fclose(f);
        /* The loop's lag: from a job's last part seen done to its reap. */
        for (size_t i = 0; i < n_jobs; i++)
                if (jobs[i].at && jobs[i].seen && jobs[i].at >= jobs[i].seen) {
                        double l = (double)(jobs[i].at - jobs[i].seen);
                        reap_lag_sum += l;
                        reap_lag_max = reap_lag_max < l ? l : reap_lag_max;
                        n_reaped++;
                }
        if (n > 0)
                printf("gpu timeline %s: %u parts; GPU first start %.3f, last end %.3f ms; busy %.3f ms, idle between "
                       "parts %.3f ms; seen after the GPU's end: mean %.3f, max %.3f ms; reaped by the loop after "
                       "its last part was seen: mean %.3f, max %.3f ms (%u jobs)\n",
                       name, n, (first - t0 * 1e6) / 1e3, (last_end - t0 * 1e6) / 1e3, busy / 1e3, idle / 1e3,
                       lag_sum / n / 1e3, lag_max / 1e3, n_reaped ? reap_lag_sum / n_reaped / 1e3 : 0,
                       reap_lag_max / 1e3, n_reaped);
        return n;
}

/* The daemon under test (its CPU time per case: what its loop and its copy engine's
 * completion thread cost, polling included). */
static pid_t epdd_pid;

/* CPU time of every thread of pid so far, ns (/proc/PID/task/TID/schedstat); 0 unknown. */
static uint64_t process_cpu_ns(pid_t pid) {
        char path[64];
        snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
        DIR *d = opendir(path);
        uint64_t sum = 0;
        struct dirent *de;
        if (!d)
                return 0;
        while ((de = readdir(d))) {
                char p[300];
                unsigned long long ns;
                if (de->d_name[0] == '.')
                        continue;
                snprintf(p, sizeof p, "/proc/%d/task/%s/schedstat", (int)pid, de->d_name);
                FILE *f = fopen(p, "re");
                if (f && fscanf(f, "%llu", &ns) == 1)
                        sum += ns;
                if (f)
                        fclose(f);
        }
        closedir(d);
        return sum;
}

/* How late a timer wakes this process up: 2000 sleeps of 50 µs, the median and the 99th
 * percentile of the overshoot in µs (what the copy engine's completion thread pays for
 * its naps, against the GPU interrupt's wake-up in the timeline's `seen`). */
static void timer_wakeups(void) {
        double v[2000];
        for (size_t i = 0; i < ELEMENTSOF(v); i++) {
                double t0 = now_sec();
                (void)nanosleep(&(struct timespec) { .tv_nsec = 50000 }, NULL);
                v[i] = (now_sec() - t0) * 1e6 - 50;
        }
        qsort(v, ELEMENTSOF(v), sizeof v[0], cmp_double);
        printf("timer wake-up after a 50 us sleep: late by %.1f us median, %.1f us p99\n", v[ELEMENTSOF(v) / 2],
               v[ELEMENTSOF(v) * 99 / 100]);
}

/* One of the daemon's copy counters (org.epd1.Gpu.CopyCounters); 0 when unknown. */
static uint64_t copy_counter(epd_client *c, const char *name) {
        sd_bus_message *reply = NULL;
        uint64_t v, found = 0;
        const char *k;
        if (sd_bus_get_property(c->bus, NULL, "/org/epd1", "org.epd1.Gpu", "CopyCounters", NULL, &reply, "a{st}") < 0)
                return 0;
        if (sd_bus_message_enter_container(reply, 'a', "{st}") >= 0)
                while (sd_bus_message_read(reply, "{st}", &k, &v) > 0)
                        if (strcmp(k, name) == 0)
                                found = v;
        sd_bus_message_unref(reply);
        return found;
}

static void prefill_main(const char *address, int fd, int rows_fd, const Case *cases, size_t n_cases,
                         const char *const *arenas, size_t n_arenas, const char *tag, bool cow) {
        epd_client *c = worker(address, "prefill");
        Mapped m[8] = {};
        Source src[8] = {};
        size_t n_src = 0;
        void *pinned = NULL;
        static unsigned serial;

        CHECK(epd_gpu_open(&G));
        CHECK(gpu_system_open(getenv("EPD_LIBCUDA"), &SYS));
        CHECK(gpu_device_make_current(SYS, &SYS->devices[0]));
        CHECK(CU(SYS->driver, cuMemAllocHost, &pinned, SH));
        memset(pinned, 1, SH);
        for (size_t i = 0; i < n_arenas; i++) {
                m[i].name = arenas[i];
                m[i].gpu = strncmp(arenas[i], "gpu", 3) == 0;
                /* gpuN lives on the daemon's GPU N (the config below); same ordinals here. */
                m[i].ordinal = m[i].gpu && strcmp(arenas[i], "gpu2") == 0 ? 1 : 0;
                map(c, &m[i]);
        }

        for (size_t k = 0; k < n_cases; k++) {
                const Case *cs = &cases[k];
                uint64_t bytes = cs->host ? SH : S;
                Source *s = NULL;
                for (size_t i = 0; i < n_src; i++)
                        if (strcmp(src[i].arena, cs->src) == 0 && src[i].bytes == bytes)
                                s = &src[i];
                if (!s) {
                        s = &src[n_src++];
                        s->arena = cs->src;
                        s->bytes = bytes;
                        s->seq = make_sequence(c, cs->src, (uint32_t)(bytes / PAGE), &s->offs);
                        fill(find(m, n_arenas, cs->src), s->offs, (uint32_t)(bytes / PAGE));
                }
                double raw = raw_copy(find(m, n_arenas, cs->dst), find(m, n_arenas, cs->src), bytes, pinned);

                uint64_t strided0 = copy_counter(c, "strided-copies"), launches0 = copy_counter(c, "kernel-launches");
                uint64_t cpu0 = process_cpu_ns(epdd_pid);
                double v[REPS + 1], ready[MAX_GROUPS] = {}, landed[MAX_GROUPS] = {}, t0_last = 0;
                char rid_last[33] = "";
                bool ok = true;
                for (int rep = 0; rep <= REPS; rep++) {
                        Msg out = { .kind = M_PREPARED, .n_pages = (uint32_t)(bytes / PAGE),
                                    .n_groups = (uint32_t)cs->n_groups, .verify = rep == 0, .poll = cs->poll },
                            in;
                        snprintf(out.rid, sizeof out.rid, "%08x%024x", (unsigned)getpid(), ++serial);
                        snprintf(out.dst, sizeof out.dst, "%s", cs->dst);
                        epd_handoff_options o = { .arena = cs->dst, .timeout_usec = 60ULL * 1000000 };
                        char *path = NULL;
                        uint64_t token;
                        int r = epd_handoff_prepare(c, out.rid, NULL, s->seq, cs->groups, cs->n_groups, &o, &path,
                                                    &token);
                        REQUIRE(r >= 0, "Prepare: %s", epd_last_error_message(c));
                        msg_send(fd, &out);
                        msg_recv(fd, &in);
                        REQUIRE(in.kind == M_ACCEPTED, "protocol");
                        if (timeline_path[0] && rep == REPS)
                                (void)truncate(timeline_path, 0); /* the last repetition's parts alone */
                        double t0 = t0_last = now_sec();
                        for (uint32_t g = 0; g < cs->n_groups; g++) {
                                CHECK(epd_handoff_layer_group_ready(c, path, g));
                                if (g < MAX_GROUPS)
                                        ready[g] = now_sec();
                        }
                        Msg tm = { .kind = M_T0, .t = t0 };
                        msg_send(fd, &tm);
                        msg_recv(fd, &in);
                        REQUIRE(in.kind == M_DONE, "protocol");
                        ok = ok && in.ok;
                        v[rep] = (in.t - t0) * 1e3;
                        memcpy(landed, in.at, sizeof landed);
                        memcpy(rid_last, out.rid, sizeof rid_last);
                        (void)epd_handoff_release(c, path);
                        free(path);
                }
                char name[96];
                snprintf(name, sizeof name, "%s%s", cs->name, tag);
                put_row(rows_fd, name, bytes, median(v + 1, REPS), raw, 0.9, ok);
                printf("copies %s: %" PRIu64 " 2D copies, %" PRIu64 " kernel launches in %d repetitions; epdd CPU "
                       "%.2f ms a handoff (all its threads)\n",
                       name, copy_counter(c, "strided-copies") - strided0, copy_counter(c, "kernel-launches") - launches0,
                       REPS + 1, (double)(process_cpu_ns(epdd_pid) - cpu0) / 1e6 / (REPS + 1));
                fflush(stdout);
                if (cs->n_groups > 1) {
                        /* Where the time went in the last repetition, in ms after the first
                         * LayerGroupReady: each call's return, and each group seen landed. */
                        printf("timeline %s: ready", name);
                        for (size_t g = 0; g < MIN(cs->n_groups, (size_t)MAX_GROUPS); g++)
                                printf(" %.2f", (ready[g] - t0_last) * 1e3);
                        printf("; landed");
                        for (size_t g = 0; g < MIN(cs->n_groups, (size_t)MAX_GROUPS); g++)
                                printf(" %.2f", (landed[g] - t0_last) * 1e3);
                        printf(" (raw copy of it all %.2f)\n", raw);
                        /* The daemon was started with the timeline on: it has every
                         * part of the repetition. */
                        if (timeline_path[0])
                                REQUIRE(print_timeline(name, t0_last) > 0, "no copy timeline in %s", timeline_path);
                        /* The daemon's view of the same repetition (its request trace), in
                         * ms after group 0's group-ready: per group, when its call reached
                         * the daemon (group-sent's time less its took=) and when its copies
                         * completed there (group-sent). */
                        epd_trace_event *ev = NULL;
                        size_t n_ev = 0;
                        if (epd_trace_get(c, rid_last, &ev, &n_ev, NULL) >= 0) {
                                uint64_t first = 0;
                                for (size_t i = 0; i < n_ev && !first; i++)
                                        if (strcmp(ev[i].type, "group-ready") == 0)
                                                first = ev[i].ts_usec;
                                printf("daemon %s: group ready..landed", name);
                                for (size_t i = 0; first && i < n_ev; i++)
                                        if (strcmp(ev[i].type, "group-sent") == 0)
                                                printf(" %d:%.2f..%.2f", ev[i].group,
                                                       ((double)ev[i].ts_usec - (double)ev[i].duration_usec -
                                                        (double)first) / 1e3,
                                                       ((double)ev[i].ts_usec - (double)first) / 1e3);
                                printf("\n");
                                free(ev);
                        }
                        fflush(stdout); /* this child ends with _exit() */
                }
        }

        if (cow) {
                /* Clone a sequence on a GPU arena, write one page: only it is copied. */
                Source *s = &src[0];
                Mapped *ms = find(m, n_arenas, s->arena);
                sd_bus_message *reply = NULL;
                const char *cp;
                const void *pages;
                size_t sz;
                uint32_t copied = 0;
                uint32_t n = (uint32_t)(s->bytes / PAGE);
                CHECK(epd__call(c, s->seq, "org.epd1.Sequence", "Clone", &reply, NULL));
                CHECK(sd_bus_message_read(reply, "o", &cp));
                char *clone = strdup(cp);
                sd_bus_message_unref(reply);
                double t0 = now_sec();
                int r = epd__call(c, clone, "org.epd1.Sequence", "PrepareWrite", &reply, "uu", n / 2, 1);
                double ms_ = (now_sec() - t0) * 1e3;
                REQUIRE(r >= 0, "PrepareWrite: %s", epd_last_error_message(c));
                CHECK(sd_bus_message_read_array(reply, 'u', &pages, &sz));
                CHECK(sd_bus_message_read(reply, "u", &copied));
                sd_bus_message_unref(reply);
                uint64_t *after = NULL;
                sd_bus_error e = SD_BUS_ERROR_NULL;
                CHECK(sd_bus_get_property(c->bus, NULL, clone, "org.epd1.Sequence", "Offsets", &e, &reply, "at"));
                const void *ov;
                CHECK(sd_bus_message_read_array(reply, 't', &ov, &sz));
                after = malloc(sz);
                memcpy(after, ov, sz);
                sd_bus_message_unref(reply);
                unsigned moved = 0;
                for (uint32_t i = 0; i < n; i++)
                        moved += after[i] != s->offs[i];
                uint32_t *buf = pinned;
                bool ok = copied == 1 && moved == 1 && after[n / 2] != s->offs[n / 2] && ms->gpu;
                if (ok) {
                        /* The private copy holds page n/2's words. */
                        CHECK(CU(SYS->driver, cuMemcpyDtoH, buf, ms->dev + after[n / 2], PAGE));
                        for (uint64_t k = 0; ok && k < PAGE / CHUNK; k++)
                                for (uint64_t w = 0; ok && w < CHUNK / 4; w++)
                                        ok = buf[k * (CHUNK / 4) + w] == word(n / 2, k);
                }
                printf("CoW: clone of %u pages, page %u written: %u copied, %u page(s) moved, bytes %s\n", n, n / 2,
                       copied, moved, ok ? "equal" : "WRONG");
                put_row(rows_fd, "CoW: clone, write 1 page (2 MiB)", PAGE, ms_, 0, 0, ok);
                (void)epd__call(c, clone, "org.epd1.Sequence", "Release", NULL, NULL);
                free(after);
                free(clone);
        }

        Msg q = { .kind = M_QUIT };
        msg_send(fd, &q);
        for (size_t i = 0; i < n_src; i++) {
                (void)epd__call(c, src[i].seq, "org.epd1.Sequence", "Release", NULL, NULL);
                free(src[i].seq);
                free(src[i].offs);
        }
        epd_disconnect(c);
        _exit(0);
}

/* ---- the daemon ---- */

static pid_t start_epdd(const char *epdd, const char *dir, const char *policy, unsigned merge, char *address,
                        size_t n) {
        char config[512], socket_path[400], log[512];
        snprintf(socket_path, sizeof socket_path, "%s/bus", dir);
        snprintf(config, sizeof config, "%s/epd.conf", dir);
        snprintf(log, sizeof log, "%s/epdd.log", dir);
        (void)unlink(socket_path);
        FILE *f = fopen(config, "we");
        REQUIRE(f, "config: %m");
        fprintf(f,
                "[Daemon]\nSocket=%s\nSystemBus=no\nStateDirectory=%s/state\nLogLevel=warning\nHostId=bench\n"
                "[Cluster]\nHandoffTimeout=120s\n"
                "[Gpu]\nCopyKernel=%s\nMergeGroups=%u\n%s"
                "[Arena:gpu0]\nDomain=gpu\nGpu=0\nSize=%" PRIu64 "\n"
                "[Arena:gpu1]\nDomain=gpu\nGpu=0\nSize=%" PRIu64 "\n"
                "[Arena:host0]\nSize=%" PRIu64 "\n",
                socket_path, dir, policy, merge, gpu_extra, S + SH + 64 * MiB, S + SH + 64 * MiB, 2 * SH + 64 * MiB);
        if (n_gpus > 1)
                fprintf(f, "[Arena:gpu2]\nDomain=gpu\nGpu=1\nSize=%" PRIu64 "\n", S + 64 * MiB);
        fclose(f);
        pid_t pid = fork();
        if (pid == 0) {
                FILE *l = freopen(log, "we", stderr);
                (void)l;
                if (timeline_path[0])
                        (void)setenv("EPD_GPU_COPY_TIMELINE", timeline_path, 1);
                execl(epdd, epdd, "-c", config, (char *)NULL);
                _exit(127);
        }
        for (int i = 0; i < 3000; i++) {
                int st;
                if (access(socket_path, F_OK) == 0) {
                        snprintf(address, n, "direct:%s", socket_path);
                        return pid;
                }
                if (waitpid(pid, &st, WNOHANG) == pid)
                        break;
                usleep(10000);
        }
        char cmd[600];
        snprintf(cmd, sizeof cmd, "cat %s >&2", log);
        if (system(cmd) < 0)
                perror("system");
        REQUIRE(false, "epdd did not start");
        return -1;
}

static int stop_epdd(pid_t pid) {
        int st;
        kill(pid, SIGTERM);
        for (int i = 0; i < 3000; i++) {
                if (waitpid(pid, &st, WNOHANG) == pid)
                        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
                usleep(10000);
        }
        kill(pid, SIGKILL);
        (void)waitpid(pid, &st, 0);
        return -ETIMEDOUT;
}

static int wait_child(pid_t pid) {
        int st;
        if (waitpid(pid, &st, 0) != pid)
                return -errno;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* One daemon, one policy ([Gpu] CopyKernel= and MergeGroups=): its cases; rows come back
 * through rows_fd. */
static bool run(const char *epdd, const char *dir, const char *policy, unsigned merge, const char *tag,
                const Case *cases, size_t n_cases, bool cow, int rows_fd) {
        char address[512];
        const char *arenas[] = { "gpu0", "gpu1", "host0", "gpu2" };
        size_t n_arenas = n_gpus > 1 ? 4 : 3;
        int sp[2];
        fflush(stdout); /* nothing buffered may be printed again by a child */
        pid_t epd = start_epdd(epdd, dir, policy, merge, address, sizeof address);
        epdd_pid = epd;
        REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) == 0, "socketpair");
        pid_t d = fork();
        if (d == 0) {
                close(sp[0]);
                decode_main(address, sp[1], arenas, n_arenas);
        }
        pid_t p = fork();
        if (p == 0) {
                close(sp[1]);
                prefill_main(address, sp[0], rows_fd, cases, n_cases, arenas, n_arenas, tag, cow);
        }
        close(sp[0]);
        close(sp[1]);
        int rp = wait_child(p), rd = wait_child(d), re = stop_epdd(epd);
        if (rp != 0 || rd != 0 || re != 0)
                fprintf(stderr, "run %s: prefill %d, decode %d, epdd %d (log: %s/epdd.log)\n", policy, rp, rd, re, dir);
        return rp == 0 && rd == 0 && re == 0;
}

static int count_gpus(void) {
        pid_t pid = fork();
        if (pid == 0) {
                GpuSystem *s = NULL;
                if (gpu_system_open(getenv("EPD_LIBCUDA"), &s) < 0)
                        _exit(0);
                _exit((int)MIN(s->n_devices, (size_t)8));
        }
        return wait_child(pid);
}

int main(int argc, char **argv) {
        const char *epdd = argc > 1 ? argv[1] : getenv("EPDD");
        bool quick = argc > 2 && strcmp(argv[2], "--quick") == 0;
        REQUIRE(epdd, "usage: gpu-handoff-bench EPDD [--quick]");

        /* No CUDA in this process: its children use it after fork. */
        n_gpus = count_gpus();
        if (n_gpus <= 0) {
                printf("SKIP: no GPU\n");
                return 77;
        }
        S = quick ? 512 * MiB : 16 * GiB;
        SH = quick ? 128 * MiB : 4 * GiB;

        const Case small[] = {
                { "handoff gpu->gpu 2M pages, 1 group", "gpu0", "gpu1", groups1, 1, false },
                { "handoff gpu->gpu 2M pages, 8 groups", "gpu0", "gpu1", groups8, 8, false },
                { "handoff gpu->gpu 2M pages, 8 groups, decode polls", "gpu0", "gpu1", groups8, 8, false, true },
                { "handoff gpu->host 2M pages, 1 group", "gpu0", "host0", groups1, 1, true },
                { "handoff host->gpu 2M pages, 1 group", "host0", "gpu1", groups1, 1, true },
                { "handoff gpu0->gpu1 2M pages, 1 group", "gpu0", "gpu2", groups1, 1, false },
        };
        const Case never[] = {
                { "handoff gpu->gpu 2M pages, 8 groups", "gpu0", "gpu1", groups8, 8, false },
        };
        char dir[] = "/tmp/epd-gpu-handoff-XXXXXX";
        REQUIRE(mkdtemp(dir), "mkdtemp: %m");
        int rows[2];
        REQUIRE(pipe2(rows, O_CLOEXEC | O_NONBLOCK) == 0, "pipe");
        printf("GPUs: %d; handoffs of %" PRIu64 " MiB (GPU) and %" PRIu64 " MiB (host), 2 MiB pages\n", n_gpus,
               S >> 20, SH >> 20);
        timer_wakeups();

        bool ok = run(epdd, dir, "small", 8, " (CopyKernel=small)", small, ELEMENTSOF(small) - (n_gpus > 1 ? 0 : 1), true,
                      rows[1]);
        /* Every group alone, as before groups that queue up went together: the same run's
         * comparison for the 8-group row. */
        ok = run(epdd, dir, "small", 1, " (CopyKernel=small, MergeGroups=1)", never, 1, false, rows[1]) && ok;
        ok = run(epdd, dir, "never", 8, " (CopyKernel=never)", never, 1, false, rows[1]) && ok;
        {
                /* Where the 8-group row's time over the raw copy goes: the daemon's copy
                 * engine's own timeline of its last repetition (GPU start and end of each
                 * part, when the host submitted it, when the completion thread saw it done
                 * and the loop reaped it), as it runs by default; with the completion
                 * thread sleeping in the blocking sync (CompletionSpin=0, the default
                 * until 2026-12-06), and polling 2 ms a part; with fewer of the
                 * queued groups merged (MergeGroups=4) and all of them behind the first
                 * (MergeGroups=16, BatchesInFlight=1). */
                static const struct {
                        unsigned merge;
                        const char *extra, *tag;
                        bool timeline;
                } study[] = {
                        { 8, "", " (timeline)", true },
                        { 8, "CompletionSpin=0\n", " (CompletionSpin=0, timeline)", true },
                        { 8, "CompletionSpin=0\n", " (CompletionSpin=0)", false },
                        { 8, "CompletionSpin=2ms\n", " (CompletionSpin=2ms)", false },
                        { 4, "", " (MergeGroups=4)", false },
                        { 16, "BatchesInFlight=1\n", " (MergeGroups=16, BatchesInFlight=1, timeline)", true },
                        { 16, "BatchesInFlight=1\n", " (MergeGroups=16, BatchesInFlight=1)", false },
                };
                /* --quick (CI, the fake driver): the first, that the timeline works. */
                for (size_t i = 0; i < (quick ? 1 : ELEMENTSOF(study)); i++) {
                        gpu_extra = study[i].extra;
                        if (study[i].timeline) {
                                snprintf(timeline_path, sizeof timeline_path, "%s/copy-timeline.txt", dir);
                                (void)unlink(timeline_path);
                        } else
                                timeline_path[0] = 0;
                        ok = run(epdd, dir, "small", study[i].merge, study[i].tag, never, 1, false, rows[1]) && ok;
                }
                gpu_extra = "";
                timeline_path[0] = 0;
        }
        close(rows[1]);

        Row r[MAX_ROWS];
        size_t n = 0;
        while (n < MAX_ROWS && read(rows[0], &r[n], sizeof r[n]) == (ssize_t)sizeof r[n])
                n++;
        if (n_gpus < 2)
                printf("GPU 0 -> GPU 1: not measured (one GPU)\n");
        printf("\n| benchmark | bytes | ms | GB/s | limit GB/s | ratio | goal | check |\n");
        printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n");
        for (size_t i = 0; i < n; i++) {
                if (!r[i].ok)
                        ok = false;
                if (r[i].limit_ms > 0)
                        printf("| %s | %" PRIu64 " | %.3f | %.1f | %.1f | %.3f | %.2f | %s |\n", r[i].name, r[i].bytes,
                               r[i].ms, r[i].bytes / r[i].ms / 1e6, r[i].bytes / r[i].limit_ms / 1e6,
                               r[i].limit_ms / r[i].ms, r[i].goal, r[i].ok ? "exact" : "FAILED");
                else
                        printf("| %s | %" PRIu64 " | %.3f | | | | | %s |\n", r[i].name, r[i].bytes, r[i].ms,
                               r[i].ok ? "1 page copied, exact" : "FAILED");
        }
        char cmd[200];
        snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
        if (ok && system(cmd) < 0)
                perror("rm");
        return ok ? EXIT_SUCCESS : EXIT_FAILURE;
}
