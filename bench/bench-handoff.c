/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Handoff benchmarks. Each figure is printed beside the limit measured in the same run,
 * with the ratio:
 *
 *   copy       intra-host handoff between two host arenas (memfd mappings), layer groups
 *              planned and sliced as epdd does, moved by the local transport's threads,
 *              versus one memcpy() of the same bytes.
 *   same-arena a handoff within one arena: the pages are handed over; bytes copied.
 *   layered    exposed handoff time after the last layer group is ready, shipping each
 *              group as it is ready versus shipping the whole sequence at the end, with a
 *              simulated per-group compute time; the limit is one group's transfer.
 *   ring       notification round trip over the ring pair (eventfds + shared records)
 *              versus a D-Bus method round trip (sd-bus, peer to peer on a socketpair).
 *
 * Usage: bench-handoff [--size MiB] [--threads N] [--quick] */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <systemd/sd-bus.h>
#include <systemd/sd-id128.h>
#include <time.h>
#include <unistd.h>

#include "handoff/handoff.h"
#include "macro.h"
#include "handoff/ring.h"
#include "time-util.h"
#include "transport/local.h"

#define PAGE (256U * 1024U) /* one KV block: 32 layers x 8 KiB */
#define LAYERS 32
#define GROUPS 8
#define SLICE (4U << 20)

static uint64_t arg_size = 256ULL << 20;
static unsigned arg_threads = 2;
static bool arg_quick;

static double now_s(void) {
        return (double)now_nsec(CLOCK_MONOTONIC) / 1e9;
}

static void *map_region(uint64_t size) {
        int fd = memfd_create("bench-arena", MFD_CLOEXEC);
        if (fd < 0 || ftruncate(fd, (off_t)size) < 0) {
                perror("memfd");
                exit(1);
        }
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
        close(fd);
        if (p == MAP_FAILED) {
                perror("mmap");
                exit(1);
        }
        memset(p, 0x5a, size);
        return p;
}

/* ---- planning a group as epdd does ---- */

typedef struct Vec {
        TransportWrite *w;
        size_t n, cap;
} Vec;

static int collect(const HandoffSlice *s, void *userdata) {
        Vec *v = userdata;
        if (v->n == v->cap) {
                v->cap = v->cap ? v->cap * 2 : 256;
                v->w = realloc(v->w, v->cap * sizeof *v->w);
                if (!v->w)
                        abort();
        }
        v->w[v->n++] = (TransportWrite) { .src_region = 0, .src_offset = s->src_offset, .dst_region = 1,
                                          .dst_offset = s->dst_offset, .length = s->length, .cookie = v->n };
        return 0;
}

/* Pages interleaved (not contiguous) on both sides, as a real pool hands them out. */
static void page_offsets(uint64_t *src, uint64_t *dst, uint32_t n) {
        for (uint32_t i = 0; i < n; i++) {
                src[i] = (uint64_t)((i * 7) % n) * PAGE;
                dst[i] = (uint64_t)((i * 13) % n) * PAGE;
        }
}

static HandoffGroupLayout group_layout(uint32_t g) {
        uint32_t per = LAYERS / GROUPS;
        uint64_t lb = PAGE / LAYERS;
        return (HandoffGroupLayout) { .n_ranges = 1, .ranges = { { (uint64_t)g * per * lb, per * lb } } };
}

static void plan(Vec *v, uint32_t g, const uint64_t *src, const uint64_t *dst, uint32_t n) {
        HandoffGroupLayout l = group_layout(g);
        v->n = 0;
        if (handoff_plan_group(&l, src, dst, n, SLICE, collect, v) < 0)
                abort();
}

static void wait_all(Transport *t, size_t n) {
        TransportCompletion c[512];
        size_t got = 0;
        while (got < n) {
                struct pollfd p = { .fd = t->ops->completion_fd(t), .events = POLLIN };
                if (poll(&p, 1, 10000) <= 0) {
                        fprintf(stderr, "transport stalled\n");
                        exit(1);
                }
                size_t k;
                while ((k = t->ops->poll(t, c, ELEMENTSOF(c))) > 0) {
                        for (size_t i = 0; i < k; i++)
                                if (c[i].error) {
                                        fprintf(stderr, "write failed: %s\n", strerror(-c[i].error));
                                        exit(1);
                                }
                        got += k;
                }
        }
}

static Transport *transport(void *a, void *b, uint64_t size, TransportRegion *ra, TransportRegion *rb) {
        Transport *t;
        *ra = (TransportRegion) { .id = 0, .domain = MEMORY_HOST, .host_base = a, .size = size };
        *rb = (TransportRegion) { .id = 1, .domain = MEMORY_HOST, .host_base = b, .size = size };
        if (local_transport_new(arg_threads, &t) < 0 || t->ops->register_region(t, ra) < 0 ||
            t->ops->register_region(t, rb) < 0)
                abort();
        return t;
}

/* ---- copy ---- */

static void bench_copy(void) {
        uint64_t size = arg_size;
        uint32_t n = (uint32_t)(size / PAGE);
        uint8_t *a = map_region(size), *b = map_region(size);
        uint64_t *src = calloc(n, 8), *dst = calloc(n, 8);
        page_offsets(src, dst, n);
        TransportRegion ra, rb;
        Transport *t = transport(a, b, size, &ra, &rb);
        Vec v = {};
        int reps = arg_quick ? 2 : 5;

        double best_memcpy = 1e9, best_handoff = 1e9;
        for (int r = 0; r < reps; r++) {
                double t0 = now_s();
                memcpy(b, a, size);
                best_memcpy = MIN(best_memcpy, now_s() - t0);

                t0 = now_s();
                size_t total = 0;
                for (uint32_t g = 0; g < GROUPS; g++) {
                        plan(&v, g, src, dst, n);
                        if (t->ops->post(t, NULL, v.w, v.n) < 0)
                                abort();
                        total += v.n;
                }
                wait_all(t, total);
                best_handoff = MIN(best_handoff, now_s() - t0);
        }
        /* Check the bytes of one page of each group. */
        for (uint32_t i = 0; i < n; i += n / 4 + 1)
                if (memcmp(b + dst[i], a + src[i], PAGE) != 0) {
                        fprintf(stderr, "copy: bytes differ\n");
                        exit(1);
                }
        double gbs_m = (double)size / best_memcpy / 1e9, gbs_h = (double)size / best_handoff / 1e9;
        printf("copy:       %" PRIu64 " MiB in %u pages, %u groups, %u-byte slices, %u threads\n", size >> 20, n,
               GROUPS, SLICE, arg_threads);
        printf("            handoff %.2f GB/s   limit memcpy (1 thread) %.2f GB/s   ratio %.2f\n", gbs_h, gbs_m,
               gbs_h / gbs_m);
        t->ops->free(t);
        free(v.w);
        free(src);
        free(dst);
        munmap(a, size);
        munmap(b, size);
}

/* ---- same arena ---- */

static void bench_same_arena(void) {
        uint32_t n = (uint32_t)(arg_size / PAGE);
        uint64_t bytes[GROUPS];
        for (uint32_t g = 0; g < GROUPS; g++)
                bytes[g] = (uint64_t)n * (PAGE / GROUPS);
        EpdId id = { .bytes = { 1 } };
        Handoff *s, *d;
        double t0 = now_s();
        if (handoff_new(HANDOFF_SOURCE, &id, 1, GROUPS, bytes, 0, 0, &s) < 0 ||
            handoff_new(HANDOFF_DESTINATION, &id, 1, GROUPS, bytes, 0, 0, &d) < 0)
                abort();
        (void)handoff_prepared(s);
        uint64_t copied = 0;
        for (uint32_t g = 0; g < GROUPS; g++) {
                (void)handoff_group_ready(s, g);
                (void)handoff_group_posted(s, g, 0); /* same arena: no write at all */
                (void)handoff_group_handed_over(d, g);
        }
        (void)handoff_accept(d, 1);
        int r = handoff_commit(d, 1);
        double dt = now_s() - t0;
        printf("same-arena: %" PRIu64 " MiB handed over in %.1f us, bytes copied %" PRIu64 " (limit 0), commit %s\n",
               arg_size >> 20, dt * 1e6, copied, r == 1 ? "ok" : "FAILED");
        handoff_free(s);
        handoff_free(d);
}

/* ---- layered vs whole ---- */

static void sleep_s(double s) {
        struct timespec ts = { .tv_sec = (time_t)s, .tv_nsec = (long)((s - (double)(time_t)s) * 1e9) };
        nanosleep(&ts, NULL);
}

static void bench_layered(void) {
        uint64_t size = arg_size;
        uint32_t n = (uint32_t)(size / PAGE);
        uint8_t *a = map_region(size), *b = map_region(size);
        uint64_t *src = calloc(n, 8), *dst = calloc(n, 8);
        page_offsets(src, dst, n);
        TransportRegion ra, rb;
        Transport *t = transport(a, b, size, &ra, &rb);
        Vec v = {};

        /* One group's transfer time: the limit of what layering can hide. */
        double one = 1e9;
        for (int r = 0; r < 3; r++) {
                plan(&v, 0, src, dst, n);
                double t0 = now_s();
                t->ops->post(t, NULL, v.w, v.n);
                wait_all(t, v.n);
                one = MIN(one, now_s() - t0);
        }
        /* Compute per group: a little longer than its transfer, as when the copy keeps up. */
        double compute = one * 1.5;

        /* Exposed time: from the moment the last group is computed until every byte
         * has landed. Best of three runs each. */
        double whole = 1e9, layered = 1e9;
        TransportCompletion c[512];
        for (int run = 0; run < 3; run++) {
                /* Whole sequence at the end. */
                for (uint32_t g = 0; g < GROUPS; g++)
                        sleep_s(compute);
                double t0 = now_s();
                size_t total = 0;
                for (uint32_t g = 0; g < GROUPS; g++) {
                        plan(&v, g, src, dst, n);
                        t->ops->post(t, NULL, v.w, v.n);
                        total += v.n;
                }
                wait_all(t, total);
                whole = MIN(whole, now_s() - t0);

                /* Layered: ship each group as soon as it is computed; completions are
                 * collected as they come, as epdd's event loop does. */
                size_t done = 0;
                total = 0;
                for (uint32_t g = 0; g < GROUPS; g++) {
                        sleep_s(compute);
                        if (g == GROUPS - 1)
                                t0 = now_s(); /* the last group is ready */
                        plan(&v, g, src, dst, n);
                        t->ops->post(t, NULL, v.w, v.n);
                        total += v.n;
                        done += t->ops->poll(t, c, ELEMENTSOF(c));
                }
                wait_all(t, total - done);
                layered = MIN(layered, now_s() - t0);
        }

        printf("layered:    %u groups of %.1f MiB, compute %.2f ms per group\n", GROUPS,
               (double)size / GROUPS / (1 << 20), compute * 1e3);
        printf("            exposed after the last group: layered %.2f ms, whole-at-end %.2f ms, one group's transfer %.2f ms\n",
               layered * 1e3, whole * 1e3, one * 1e3);
        printf("            layered / one group %.2f (goal about 1)   layered / whole %.3f\n", layered / one,
               layered / whole);
        t->ops->free(t);
        free(v.w);
        free(src);
        free(dst);
        munmap(a, size);
        munmap(b, size);
}

/* ---- ring vs D-Bus ---- */

typedef struct RingPeer {
        Ring *ring;
        volatile bool stop;
} RingPeer;

static void *ring_daemon(void *userdata) {
        RingPeer *p = userdata;
        struct epd_ring_record rec, out;
        while (!p->stop) {
                struct pollfd pf = { .fd = p->ring->submit_fd, .events = POLLIN };
                if (poll(&pf, 1, 100) <= 0)
                        continue;
                (void)ring_drain_submit(p->ring);
                while (ring_consume(p->ring, &rec) == 0) {
                        ring_record_completion(&out, rec.user_data, 0);
                        (void)ring_post(p->ring, &out);
                }
                (void)ring_kick(p->ring);
        }
        return NULL;
}

static int method_ping(sd_bus_message *m, void *userdata, sd_bus_error *error) {
        return sd_bus_reply_method_return(m, NULL);
}

static const sd_bus_vtable ping_vtable[] = {
        SD_BUS_VTABLE_START(0),
        SD_BUS_METHOD("Ping", "", "", method_ping, 0),
        SD_BUS_VTABLE_END,
};

typedef struct BusPeer {
        int fd;
        volatile bool stop;
} BusPeer;

static void *bus_daemon(void *userdata) {
        BusPeer *p = userdata;
        sd_bus *bus = NULL;
        sd_id128_t id;
        if (sd_id128_randomize(&id) < 0 || sd_bus_new(&bus) < 0 || sd_bus_set_fd(bus, p->fd, p->fd) < 0 ||
            sd_bus_set_server(bus, 1, id) < 0 || sd_bus_set_anonymous(bus, 1) < 0 ||
            sd_bus_add_object_vtable(bus, NULL, "/bench", "org.epd1.Bench", ping_vtable, NULL) < 0 ||
            sd_bus_start(bus) < 0)
                abort();
        while (!p->stop) {
                int r = sd_bus_process(bus, NULL);
                if (r < 0)
                        break;
                if (r == 0)
                        (void)sd_bus_wait(bus, 100000);
        }
        sd_bus_flush_close_unref(bus);
        return NULL;
}

static void bench_ring(void) {
        int n = arg_quick ? 2000 : 20000;
        Ring *ring;
        if (ring_new(256, 256, &ring) < 0)
                abort();
        /* The worker's view: its own mapping, as libepd has it. */
        void *base = mmap(NULL, ring->size, PROT_READ | PROT_WRITE, MAP_SHARED, ring->memfd, 0);
        struct epd_ring w;
        if (base == MAP_FAILED || epd_ring_attach(&w, base, ring->size, 0) < 0)
                abort();
        RingPeer rp = { .ring = ring };
        pthread_t th;
        pthread_create(&th, NULL, ring_daemon, &rp);

        struct epd_ring_record rec = { .opcode = EPD_RING_OP_NOP }, out;
        double t0 = now_s();
        for (int i = 0; i < n; i++) {
                rec.user_data = (uint64_t)i;
                uint64_t one = 1, v;
                if (epd_ring_produce(&w.sq, &rec) < 0)
                        abort();
                (void)!write(ring->submit_fd, &one, sizeof one);
                for (;;) {
                        if (epd_ring_consume(&w.cq, &out) == 0)
                                break;
                        struct pollfd pf = { .fd = ring->complete_fd, .events = POLLIN };
                        (void)poll(&pf, 1, 1000);
                        (void)!read(ring->complete_fd, &v, sizeof v);
                }
                if (out.user_data != (uint64_t)i)
                        abort();
        }
        double ring_rtt = (now_s() - t0) / n;
        rp.stop = true;
        pthread_join(th, NULL);
        munmap(base, ring->size);
        ring_free(ring);

        int sv[2];
        if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
                abort();
        BusPeer bp = { .fd = sv[1] };
        pthread_create(&th, NULL, bus_daemon, &bp);
        sd_bus *bus = NULL;
        if (sd_bus_new(&bus) < 0 || sd_bus_set_fd(bus, sv[0], sv[0]) < 0 || sd_bus_set_anonymous(bus, 1) < 0 ||
            sd_bus_start(bus) < 0)
                abort();
        int nb = n / 4;
        t0 = now_s();
        for (int i = 0; i < nb; i++) {
                sd_bus_error e = SD_BUS_ERROR_NULL;
                if (sd_bus_call_method(bus, NULL, "/bench", "org.epd1.Bench", "Ping", &e, NULL, NULL) < 0)
                        abort();
        }
        double bus_rtt = (now_s() - t0) / nb;
        bp.stop = true;
        sd_bus_flush_close_unref(bus);
        pthread_join(th, NULL);
        printf("ring:       notification round trip %.1f us   limit D-Bus method round trip %.1f us   ratio %.2f (%.1fx faster)\n",
               ring_rtt * 1e6, bus_rtt * 1e6, ring_rtt / bus_rtt, bus_rtt / ring_rtt);
}

int main(int argc, char **argv) {
        static const struct option opts[] = {
                { "size", required_argument, NULL, 's' },
                { "threads", required_argument, NULL, 't' },
                { "quick", no_argument, NULL, 'q' },
                {},
        };
        int c;
        while ((c = getopt_long(argc, argv, "s:t:q", opts, NULL)) >= 0)
                switch (c) {
                case 's':
                        arg_size = strtoull(optarg, NULL, 10) << 20;
                        break;
                case 't':
                        arg_threads = (unsigned)atoi(optarg);
                        break;
                case 'q':
                        arg_quick = true;
                        arg_size = MIN(arg_size, 32ULL << 20);
                        break;
                default:
                        return 2;
                }
        if (arg_size < (uint64_t)PAGE * GROUPS || arg_threads == 0 || arg_threads > LOCAL_TRANSPORT_THREADS_MAX) {
                fprintf(stderr, "bad --size or --threads\n");
                return 2;
        }
        arg_size = arg_size / PAGE * PAGE;
        bench_copy();
        bench_same_arena();
        bench_layered();
        bench_ring();
        return 0;
}
