/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The source side of a handoff: Prepare (checks, layout, the peer's window, the source
 * object that leases the prefill sequence's pages, then a local twin or the destination
 * host asked), and shipping each layer group as the prefill worker reports it ready:
 * planning its writes, posting them to the transport of the path, and their
 * completions. */
#include "copy.h"
#include "handoff/handoff-internal.h"
#include "transport/cuda.h"
#include "transport/transport-peer.h"

/* ---- messages to the peer ---- */

void handoff_send_message(HandoffObject *o, HandoffMessage *m) {
        _cleanup_(freep) uint8_t *buf = NULL;
        size_t len;
        if (!o->peer)
                return;
        m->request_id = o->h->request_id;
        m->token = o->h->token;
        int r = handoff_message_encode(m, &buf, &len);
        if (r >= 0)
                r = peer_send(o->peer, m->type, buf, len);
        if (r < 0)
                log_debug_errno(r, "handoff %s: cannot send %s to %s: %m", o->request_str,
                                handoff_message_type_to_string(m->type), o->peer_host);
}

typedef struct DurableMessage {
        Peer *peer; /* peers are never freed while the WAL can still answer */
        uint16_t type;
        char request[EPD_ID_STRING_MAX];
        size_t len;
        uint8_t *buf;
} DurableMessage;

static void durable_message_send(void *userdata, int error) {
        DurableMessage *d = userdata;
        int r = error;

        if (r >= 0)
                r = peer_send(d->peer, d->type, d->buf, d->len);
        if (error < 0)
                log_warning_errno(error, "handoff %s: its record is not durable (%m): %s not sent; the peer "
                                         "rolls back at its deadline.",
                                  d->request, handoff_message_type_to_string(d->type));
        else if (r < 0)
                log_debug_errno(r, "handoff %s: cannot send %s: %m", d->request,
                                handoff_message_type_to_string(d->type));
        free(d->buf);
        free(d);
}

void handoff_send_message_when_durable(HandoffObject *o, HandoffMessage *m) {
        DurableMessage *d;
        int r;

        if (!o->peer)
                return;
        d = calloc(1, sizeof *d);
        if (!d) {
                log_oom();
                return;
        }
        m->request_id = o->h->request_id;
        m->token = o->h->token;
        *d = (DurableMessage) { .peer = o->peer, .type = m->type };
        snprintf(d->request, sizeof d->request, "%s", o->request_str);
        r = handoff_message_encode(m, &d->buf, &d->len);
        if (r >= 0)
                r = wal_manager_after_durable(o->hm->manager, durable_message_send, d);
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot send %s: %m", o->request_str,
                                  handoff_message_type_to_string(m->type));
                free(d->buf);
                free(d);
        }
}

/* The byte offsets of the object's pages in its arena (freed by the caller), or NULL. */
static uint64_t *page_offsets(HandoffObject *o) {
        uint64_t *src = calloc(o->n_pages, sizeof *src);
        if (src)
                for (uint32_t i = 0; i < o->n_pages; i++)
                        src[i] = page_offset(o->pool, o->pages[i]);
        return src;
}

/* Plans group g's writes into *c (c->w the caller's to free, also on failure), each cut
 * into slices of the transport's slice size. A local GPU handoff plans by slices of pages
 * instead (post_gpu_slice()). */
static int plan_group(HandoffObject *o, const uint64_t *src, uint32_t g, PlanCtx *c) {
        *c = (PlanCtx) { .o = o, .group = g };
        return handoff_plan_group(&o->layouts[g], src, o->dst_offsets, o->n_pages, o->hm->slice_size,
                                  handoff_plan_collect, c);
}

static int post_group(HandoffObject *o, uint32_t g) {
        HandoffManager *hm = o->hm;
        Handoff *h = o->h;
        int r;

        if (o->staged)
                return o->staging ? handoff_post_group_staged(o, g) : -ESTALE;

        if (o->zero_copy) {
                o->transport = "zero-copy";
                r = handoff_group_posted(h, g, 0);
                if (r >= 0 && o->twin)
                        r = handoff_group_handed_over(o->twin->h, g);
                if (r >= 0)
                        hm->counters.zero_copy_groups++;
                return r;
        }

        /* A local GPU handoff's groups go by post_gpu_groups(). */
        Transport *t = o->peer ? o->net : hm->local;
        if (!t)
                return -ENOTCONN;
        o->transport = t->ops->name;

        _cleanup_(freep) uint64_t *src = page_offsets(o);
        if (!src)
                return -ENOMEM;
        PlanCtx c;
        r = plan_group(o, src, g, &c);
        if (r < 0) {
                free(c.w);
                return r;
        }
        /* Within this host, the whole batch shares one cookie. */
        size_t n_out = o->peer ? c.n : MIN(c.n, (size_t)1);
        OutWrite **ow = calloc(MAX(n_out, (size_t)1), sizeof *ow);
        if (!ow) {
                free(c.w);
                return -ENOMEM;
        }
        size_t i;
        r = 0;
        for (i = 0; i < n_out; i++) {
                ow[i] = malloc(sizeof(OutWrite));
                if (!ow[i]) {
                        r = -ENOMEM;
                        break;
                }
                *ow[i] = (OutWrite) {
                        .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g,
                        .obj = o,
                        .group = g,
                        .pending = o->peer ? 1 : c.n,
                };
                r = hashmap_put(hm->writes, &ow[i]->cookie, ow[i]);
                if (r < 0) {
                        free(ow[i]);
                        break;
                }
        }
        for (size_t k = 0; r >= 0 && k < c.n; k++) {
                c.w[k].cookie = ow[o->peer ? k : 0]->cookie;
                if (o->slot) {
                        /* Pipelined: the destination resolves the slot's pages. */
                        c.w[k].flags |= TRANSPORT_WRITE_TARGET;
                        c.w[k].target = o->slot;
                } else if (o->peer && (t->ops->caps & TRANSPORT_CAP_ATTEMPT)) {
                        /* Real offsets (rdma): taken only while the pages are this
                         * attempt's, never a rolled-back one's into its successor's. */
                        c.w[k].flags |= TRANSPORT_WRITE_ATTEMPT;
                        c.w[k].target = o->h->token;
                }
        }
        if (r >= 0 && c.n > 0)
                handoff_mark_group_end(o, g, &c.w[c.n - 1]);
        /* More writes than a peer takes in flight at all: it can never go (refused at
         * Prepare already when its pages alone are too many). -ENOBUFS from the post
         * below is room only (handoff_pump() waits for it). */
        if (r >= 0 && o->peer && c.n > PEER_INCOMING_MAX)
                r = -E2BIG;
        if (r >= 0)
                r = t->ops->post(t, o->peer, c.w, c.n);
        if (r < 0) {
                for (size_t k = 0; k < i; k++) {
                        (void)hashmap_remove(hm->writes, &ow[k]->cookie);
                        free(ow[k]);
                }
                free(ow);
                free(c.w);
                return r;
        }
        free(ow);
        free(c.w);
        if (o->peer)
                handoff_turn_count(hm, c.n);
        (void)handoff_group_posted(h, g, (uint32_t)c.n);
        if (o->twin && c.n > 0)
                (void)handoff_writes_landing(o->twin->h, g, (uint32_t)c.n);
        hm->counters.batches++;
        return 0;
}

/* A local GPU batch goes to the transport in slices of pages, each planned, checked and
 * posted before the next is planned: the first of about GPU_SLICE_FIRST writes, each next
 * one twice the last, up to GPU_SLICE_MAX. Planning and checking cost some 40 ns a write
 * on the host: a batch posted whole (a layer group of 8192 pages; four merged, 32768)
 * took 0.3 to 1.3 ms before its first byte could go, the GPU idle meanwhile unless a
 * batch ahead still ran; sliced, its first byte goes after a few microseconds and each
 * next slice is planned while the GPU copies the one before. */
#define GPU_SLICE_FIRST 256U
#define GPU_SLICE_MAX 8192U

typedef struct GpuBatch {
        HandoffObject *o;
        Transport *t;
        const uint64_t *src;
        uint32_t first, k;
        PlanCtx *c;        /* per group: its writes of the slice */
        OutWrite **ow;     /* per group: its cookie, pending the writes posted so far */
        TransportWrite *w; /* the slice's writes, as posted */
        size_t w_cap;
} GpuBatch;

/* Plans pages [p, p + n) of every group of the batch and posts their writes page by page
 * (group g's piece of a page, then group g + 1's, ...: the pieces of a page that continue
 * each other become one copy in the transport). Nothing of the slice is posted on
 * failure. */
static int post_gpu_slice(GpuBatch *b, uint32_t p, uint32_t n) {
        HandoffObject *o = b->o;
        size_t total = 0, at = 0;
        bool same = true;
        int r;

        for (uint32_t m = 0; m < b->k; m++) {
                b->c[m].n = 0;
                /* Runs whole (max_slice 0): a copy costs the GPU per operation. */
                r = handoff_plan_group(&o->layouts[b->first + m], b->src + p, o->dst_offsets + p, n, 0,
                                       handoff_plan_collect, &b->c[m]);
                if (r < 0)
                        return r;
                total += b->c[m].n;
                same = same && b->c[m].n == b->c[0].n;
        }
        if (total == 0)
                return 0;
        if (total > b->w_cap) {
                TransportWrite *w = reallocarray(b->w, total, sizeof *w);
                if (!w)
                        return -ENOMEM;
                b->w = w;
                b->w_cap = total;
        }
        if (same)
                for (size_t j = 0; j < b->c[0].n; j++)
                        for (uint32_t m = 0; m < b->k; m++) {
                                b->w[at] = b->c[m].w[j];
                                b->w[at++].cookie = b->ow[m]->cookie;
                        }
        else
                for (uint32_t m = 0; m < b->k; m++)
                        for (size_t j = 0; j < b->c[m].n; j++) {
                                b->w[at] = b->c[m].w[j];
                                b->w[at++].cookie = b->ow[m]->cookie;
                        }
        r = b->t->ops->post(b->t, NULL, b->w, total);
        if (r < 0)
                return r;
        for (uint32_t m = 0; m < b->k; m++)
                b->ow[m]->pending += b->c[m].n;
        o->hm->counters.gpu_slices++;
        return 0;
}

/* A local handoff through the CUDA transport: the k groups from `first` on (one, or
 * several ready while its earlier ones were on the GPU) go as one batch, in slices
 * (post_gpu_slice()). Queued sub-page groups move as fewer, larger copies that way: a
 * layer group of 256 KiB of every 2 MiB page is a descriptor and a GPU page-table walk
 * per 256 KiB; four of them together, per 1 MiB. Each group keeps its cookie and its own
 * completions (the transport completes a post once per cookie), but they all land
 * together, when the whole batch has: a group waits for the others' bytes. A slice that
 * cannot be posted after earlier ones were leaves those in flight: their groups count
 * them as posted (their completions come, and are accounted), and the caller rolls the
 * handoff back. */
static int post_gpu_groups(HandoffObject *o, uint32_t first, uint32_t k) {
        HandoffManager *hm = o->hm;
        Handoff *h = o->h;
        _cleanup_(freep) uint64_t *src = NULL;
        _cleanup_(freep) OutWrite **ow = NULL;
        GpuBatch b = { .o = o, .t = handoff_gpu_transport(hm), .first = first, .k = k };
        uint32_t per_page = 0, made = 0, p = 0;
        int r = 0;

        assert(k > 0);
        if (!b.t)
                return -ENOTCONN;
        o->transport = b.t->ops->name;
        b.src = src = page_offsets(o);
        b.c = calloc(k, sizeof *b.c);
        b.ow = ow = calloc(k, sizeof *ow);
        if (!src || !b.c || !ow) {
                free(b.c);
                return -ENOMEM;
        }
        for (uint32_t m = 0; m < k; m++) {
                b.c[m] = (PlanCtx) { .o = o, .group = first + m };
                per_page += o->layouts[first + m].n_ranges;
        }
        for (; made < k; made++) {
                ow[made] = malloc(sizeof(OutWrite));
                if (!ow[made]) {
                        r = -ENOMEM;
                        break;
                }
                *ow[made] = (OutWrite) {
                        .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | (first + made),
                        .obj = o,
                        .group = first + made,
                };
                r = hashmap_put(hm->writes, &ow[made]->cookie, ow[made]);
                if (r < 0) {
                        free(ow[made]);
                        break;
                }
        }
        uint32_t step = MAX(GPU_SLICE_FIRST / MAX(per_page, 1U), 1U),
                 step_max = MAX(GPU_SLICE_MAX / MAX(per_page, 1U), 1U);
        /* Behind a batch still on the engine with at least as many bytes as a quarter of
         * the largest slice, the first slice is that quarter: the GPU has work while it
         * is planned (a quarter is planned in less time than the GPU takes to copy as
         * much), and small parts cost the GPU more a byte (a part of 64 MiB took the H200
         * 1.5 times as long a byte as one of 1 GiB, bench/RESULTS.md 2026-12-06 22:47). A
         * batch that has finished but is not reaped yet still counts. */
        uint64_t batch_bytes = 0;
        for (uint32_t m = 0; m < k; m++)
                batch_bytes += h->groups[first + m].bytes_expected;
        uint32_t quarter = MAX(MIN(step_max / 4, o->n_pages), 1U);
        if (o->n_pages > 0 &&
            gpu_copy_engine_bytes_in_flight(cuda_transport_engine(b.t)) >= batch_bytes / o->n_pages * quarter)
                step = MAX(step, quarter);
        while (r >= 0 && p < o->n_pages) {
                uint32_t n = MIN(step, o->n_pages - p);
                r = post_gpu_slice(&b, p, n);
                if (r >= 0) {
                        p += n;
                        step = MIN(step * 2, step_max);
                }
        }
        for (uint32_t m = 0; m < k; m++)
                free(b.c[m].w);
        free(b.c);
        free(b.w);

        /* The groups up to the last with writes in flight count what was posted (after
         * a failure past the first slice: what it left in flight completes, and is
         * accounted; the caller rolls back). */
        uint32_t upto = 0;
        for (uint32_t m = 0; m < made; m++)
                if (ow[m]->pending > 0)
                        upto = m + 1;
        if (r < 0)
                k = upto; /* 0: nothing in flight */
        OutWrite *last = NULL;
        for (uint32_t m = 0; m < made; m++) {
                uint32_t g = first + m, n = (uint32_t)ow[m]->pending;
                if (m < k) {
                        (void)handoff_group_posted(h, g, n);
                        if (o->twin && n > 0)
                                (void)handoff_writes_landing(o->twin->h, g, n);
                }
                if (n > 0)
                        last = ow[m];
                else {
                        /* No writes: no completion comes for it. */
                        (void)hashmap_remove(hm->writes, &ow[m]->cookie);
                        free(ow[m]);
                }
        }
        if (last) {
                last->ends_batch = true;
                o->gpu_batches++;
        }
        if (r >= 0) {
                hm->counters.batches++;
                if (k > 1)
                        hm->counters.merged_groups += k;
        }
        return r;
}

void handoff_mark_group_end(HandoffObject *o, uint32_t g, TransportWrite *w) {
        if (!o->imm)
                return;
        w->flags |= TRANSPORT_WRITE_IMM;
        w->imm = handoff_group_imm(g, o->h->groups[g].bytes_expected);
}

void handoff_pump(HandoffObject *o) {
        if (o->unsettled)
                return; /* handoff_settle_wait() pumps */
        /* The groups ready now leave together (one sendmsg over tcp). */
        Transport *net = o->peer ? o->net : NULL;
        Peer *peer = o->peer;
        bool plugged = net && net->ops->plug && net->ops->unplug;
        uint32_t g;
        if (o->gpu && !o->peer && !o->zero_copy) {
                /* [Gpu] BatchesInFlight= batches on the GPU (default 2: one copying,
                 * one queued behind it, prepared while the first runs): groups ready
                 * beyond that wait, then go together (post_gpu_groups()), at most as
                 * many a batch as the transport completes once each (past that, a
                 * completion per run of writes again: thousands). */
                uint32_t k;
                while (o->gpu_batches < o->hm->manager->config.gpu_batches_in_flight &&
                       (k = handoff_ready_unposted(o->h, &g)) > 0) {
                        uint32_t m = MIN(MIN(k, (uint32_t)HANDOFF_GPU_MERGE_MAX),
                                         o->hm->manager->config.gpu_merge_groups); /* 1 to 16 */
                        int r = post_gpu_groups(o, g, m);
                        if (r < 0) {
                                log_warning_errno(r, "handoff %s: cannot ship groups %" PRIu32 "-%" PRIu32 ": %m",
                                                  o->request_str, g, g + m - 1);
                                (void)handoff_rollback(o->h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                                return;
                        }
                }
                return;
        }
        if (plugged)
                net->ops->plug(net, peer);
        while (!o->stalled && handoff_next_to_post(o->h, &g) == 0) {
                if (o->peer && !handoff_turn_has_room(o->hm) && handoff_yield(o))
                        break;
                int r = post_group(o, g);
                if (r == -ENOBUFS && o->peer) {
                        /* The writes in flight to the peer are at the transport's bound
                         * (other handoffs', or this one's earlier groups): the group waits,
                         * ready and not posted, until writes to it complete
                         * (handoff_unstall()). The handoff's deadline still bounds it. */
                        handoff_stall(o);
                        break;
                }
                if (r < 0) {
                        log_warning_errno(r, "handoff %s: cannot ship group %" PRIu32 ": %m", o->request_str, g);
                        (void)handoff_rollback(o->h, HANDOFF_CAUSE_TRANSFER_FAILED, false);
                        break;
                }
        }
        if (plugged)
                net->ops->unplug(net, peer);
}

/* The objects a batch of completions touched, told once each when the batch is done:
 * the groups that landed meanwhile go out as one progress record per side (a ring
 * record, a signal), not one per group. In the order first touched, a local handoff's
 * destination before its source, as when they were told after each completion. */
typedef struct Touched {
        HandoffObject *v[64];
        bool pump[64];  /* a local GPU handoff with a batch landed: its queued groups go next */
        size_t n;
} Touched;

static void touched_flush(Touched *t) {
        /* Telling one may free another (a local handoff's two sides tell each other):
         * all are held while they are told, and each may go at its own unhold. */
        for (size_t i = 0; i < t->n; i++)
                handoff_obj_hold(t->v[i]);
        bool pump = false;
        for (size_t i = 0; i < t->n; i++) {
                handoff_after_event(t->v[i]);
                pump = pump || t->pump[i];
        }
        /* Only then the next batch of a local GPU handoff whose batch landed: planning a
         * merged batch takes milliseconds (tens of thousands of writes), which the
         * landed groups' readers (a decode worker loading layer by layer) do not wait
         * for: their rings are kicked now, not after the loop's callback. What the pump
         * changed (a failed post rolls back) is told after it. */
        if (pump) /* then t->n > 0 */
                handoff_rings_kick_pending(t->v[0]->hm);
        for (size_t i = 0; i < t->n; i++)
                if (t->pump[i] && !handoff_is_ended(t->v[i]->h)) {
                        handoff_pump(t->v[i]);
                        handoff_after_event(t->v[i]);
                }
        for (size_t i = 0; i < t->n; i++)
                handoff_obj_unhold(t->v[i]);
        t->n = 0;
}

/* Room for o: the caller flushed before it looked o up (touched_room()), so that a
 * flush never runs between looking an object up and adding it (a flush may free it). */
static void touched_add(Touched *t, HandoffObject *o, bool pump) {
        for (size_t i = 0; i < t->n; i++)
                if (t->v[i] == o) {
                        t->pump[i] = t->pump[i] || pump;
                        return;
                }
        assert(t->n < ELEMENTSOF(t->v));
        t->pump[t->n] = pump;
        t->v[t->n++] = o;
}

/* Before a completion's objects are looked up: room for two more (a side and its twin). */
static void touched_room(Touched *t) {
        if (t->n + 2 > ELEMENTSOF(t->v))
                touched_flush(t);
}

/* max: completions taken in this call; the transport's completion fd stays readable for
 * the rest (transport_done_take()), taken at the loop's next turn. */
static void on_completions(HandoffManager *hm, Transport *t, size_t max) {
        TransportCompletion c[256];
        Touched touched = {};
        size_t n, seen = 0;
        while (seen < max && (n = t->ops->poll(t, c, MIN(ELEMENTSOF(c), max - seen))) > 0) {
                seen += n;
                for (size_t i = 0; i < n; i++) {
                        touched_room(&touched);
                        OutWrite *w = hashmap_get(hm->writes, &c[i].cookie);
                        if (!w) {
                                log_debug("handoff: completion of unknown write %" PRIu64, c[i].cookie);
                                continue;
                        }
                        HandoffObject *o = w->obj;
                        uint32_t g = w->group;
                        /* A completion may stand for several writes of the batch (the
                         * CUDA transport merges a batch's writes under one cookie). */
                        uint32_t n_writes = c[i].writes;
                        if (n_writes == 0 || n_writes > w->pending) {
                                log_error("handoff %s: a completion of %" PRIu32 " write(s) where %zu are pending",
                                          o->request_str, n_writes, w->pending);
                                n_writes = (uint32_t)MIN(MAX(n_writes, 1U), w->pending);
                        }
                        if (w->stage) {
                                /* Into the staging buffer: no bytes moved yet. */
                                if (c[i].error < 0 && w->error == 0)
                                        w->error = c[i].error;
                                (void)handoff_writes_done(o->h, g, n_writes, 0, c[i].error);
                                w->pending -= n_writes;
                                if (w->pending == 0) {
                                        int err = w->error;
                                        free(hashmap_remove(hm->writes, &c[i].cookie));
                                        handoff_stage_landed(o, g, err);
                                }
                                handoff_after_event(o);
                                continue;
                        }
                        w->pending -= n_writes;
                        bool drained = false;
                        if (w->pending == 0) {
                                if (w->ends_batch && o->gpu_batches > 0) {
                                        o->gpu_batches--;
                                        drained = true;
                                }
                                free(hashmap_remove(hm->writes, &c[i].cookie));
                        }
                        uint64_t bytes = c[i].error < 0 ? 0 : c[i].bytes;
                        (void)handoff_writes_done(o->h, g, n_writes, bytes, c[i].error);
                        if (o->twin) {
                                (void)handoff_writes_landed(o->twin->h, g, n_writes, bytes, c[i].error);
                                o->twin->bytes_moved += bytes;
                        }
                        o->bytes_moved += bytes;
                        hm->counters.bytes += bytes;
                        if (c[i].error < 0)
                                log_debug("handoff %s: write of group %" PRIu32 " failed: %s", o->request_str, g,
                                          strerror(-c[i].error));
                        if (o->twin)
                                touched_add(&touched, o->twin, false);
                        /* drained: the groups that queued up meanwhile go once the
                         * landed ones are told (touched_flush()). */
                        touched_add(&touched, o, drained);
                }
                /* Before the next poll: a completion's write is looked up by its cookie,
                 * whose object only after_event frees. */
                touched_flush(&touched);
        }
        if (seen > 0 && t != hm->local && hm->stalled.first)
                handoff_unstall(hm);
}

int handoff_on_local_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        on_completions(hm, hm->local, SIZE_MAX);
        return 0;
}

int handoff_on_gpu_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = handoff_gpu_transport(hm);
        if (t)
                on_completions(hm, t, SIZE_MAX);
        return 0;
}

int handoff_on_peer_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = peer_manager_transport(hm->manager->peers);
        if (t)
                on_completions(hm, t, HANDOFF_TURN_COMPLETIONS_MAX);
        return 0;
}

int handoff_on_rdma_completion(sd_event_source *s, int fd, uint32_t revents, void *userdata) {
        HandoffManager *hm = userdata;
        Transport *t = peer_manager_rdma(hm->manager->peers);
        if (t)
                on_completions(hm, t, HANDOFF_TURN_COMPLETIONS_MAX);
        return 0;
}

/* ---- source: Prepare ---- */

int handoff_parse_request_id(const char *s, EpdId *ret, Reason *why) {
        if (epd_id_from_string(s, ret) < 0 || epd_id_is_null(ret))
                return reason_set(why, -EINVAL,
                                     "Request id '%s' is not a non-zero 128-bit id in 32 hex digits.", s);
        return 0;
}

static uint64_t layout_hash(const KvLayout *l) {
        uint64_t h = 1469598103934665603ULL;
        uint64_t v[5] = { l->layers, l->tokens_per_block, l->k_bytes_per_token_per_layer,
                          l->v_bytes_per_token_per_layer, l->page_size };
        for (size_t i = 0; i < ELEMENTSOF(v); i++)
                for (int b = 0; b < 8; b++) {
                        h ^= (v[i] >> (8 * b)) & 0xff;
                        h *= 1099511628211ULL;
                }
        return h;
}

static Worker *find_worker(Manager *m, const char *path_or_id) {
        const char *p = strrchr(path_or_id, '/');
        return manager_get_worker(m, p ? p + 1 : path_or_id);
}

static int prepare_error(Reason *why, int r, const char *what) {
        switch (r) {
        case -ENOSPC:
                return reason_set(why, -ENOSPC, "%s: the destination has no room for the pages.", what);
        case -EDQUOT:
                return reason_set(why, -EDQUOT, "%s: too many handoffs.", what);
        case -EPERM:
                return reason_set(why, -EPERM, "%s: the sequence is not yours.", what);
        case -ENOENT:
                return reason_set(why, -ENOENT, "%s: no such sequence.", what);
        case -EINVAL:
                return reason_set(why, -EINVAL, "%s: invalid argument.", what);
        case -ESTALE:
                return reason_set(why, -ESTALE,
                                  "%s: a newer attempt of this request (a larger token) is live on this host.", what);
        default:
                return r;
        }
}

/* What Prepare resolved from its arguments before anything is allocated. */
typedef struct PrepareCtx {
        Worker *worker;
        Client *client;
        EpdId rid;
        Sequence *sequence;
        bool local;
        Peer *peer;              /* remote: the destination's daemon */
        Worker *target;
        uint32_t n_groups;
        HandoffGroupLayout *layouts;
        uint64_t *bytes;         /* per group */
        uint64_t total_bytes;
        Arena *src_arena, *dst_arena;
        bool gpu;
        PeerWindow *window;      /* remote */
        usec_t timeout;
} PrepareCtx;

static void prepare_ctx_done(PrepareCtx *x) {
        free(x->layouts);
        free(x->bytes);
}

/* The arguments, the caller's sequence, the destination and the target worker. */
static int prepare_check(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        Worker *w = x->worker;
        int r;

        r = handoff_parse_request_id(a->request_id, &x->rid, why);
        if (r < 0)
                return r;
        if (!w->layout)
                return reason_set(why, -EINVAL,
                                  "Worker %s registered no KV layout: there are no layer groups to ship.", w->id_str);
        if (!m->page_manager)
                return reason_set(why, -EOPNOTSUPP, "No page manager.");
        r = page_manager_lookup(m->page_manager, x->client, a->sequence, SEQUENCE_ACCESS_OWNER, &x->sequence);
        if (r < 0)
                return prepare_error(why, r, "Prepare");
        if (x->sequence->n_pages == 0 || x->sequence->n_pages > HANDOFF_PAGES_MAX)
                return reason_set(why, -EINVAL, "The sequence has %zu pages; a handoff moves 1 to %u.",
                                  x->sequence->n_pages, HANDOFF_PAGES_MAX);
        if (a->n_groups == 0 || a->n_groups > HANDOFF_GROUPS_MAX)
                return reason_set(why, -EINVAL, "Between 1 and %u layer groups.", HANDOFF_GROUPS_MAX);
        if (a->ready > a->n_groups)
                return reason_set(why, -EINVAL, "Option ready=%" PRIu32 ": there are %zu layer groups.", a->ready,
                                  a->n_groups);
        uint64_t layers = 0;
        for (size_t g = 0; g < a->n_groups; g++) {
                if (a->layer_groups[g] == 0)
                        return reason_set(why, -EINVAL, "Layer group %zu is empty.", g);
                layers += a->layer_groups[g];
        }
        if (layers != w->layout->layers)
                return reason_set(why, -EINVAL, "The layer groups hold %" PRIu64 " layers; the model has %" PRIu32 ".",
                                  layers, w->layout->layers);
        x->n_groups = (uint32_t)a->n_groups;

        x->local = isempty_str(a->destination) || strcmp(a->destination, m->config.host_id) == 0;
        if (!x->local) {
                if (!m->peers || !(x->peer = peer_manager_find(m->peers, a->destination)))
                        return reason_set(why, -ENOENT, "No peer with host id '%s'.", a->destination);
                if (!peer_is_up(x->peer))
                        return reason_set(why, -EHOSTUNREACH, "Peer '%s' is %s.", a->destination,
                                          peer_state_to_string(peer_state(x->peer)));
        }
        if (a->target && a->target[0] && !(x->target = find_worker(m, a->target)))
                return reason_set(why, -ENOENT, "No worker '%s'.", a->target);
        if (x->target && !x->local)
                return reason_set(why, -EINVAL, "A target worker names a local worker.");
        return 0;
}

/* Each group's byte range within a page, from the model's KV layout, and the arenas. */
static int prepare_layout(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        const KvLayout *l = x->worker->layout;

        x->layouts = calloc(x->n_groups, sizeof *x->layouts);
        x->bytes = calloc(x->n_groups, sizeof *x->bytes);
        if (!x->layouts || !x->bytes)
                return -ENOMEM;
        uint32_t first = 0;
        for (uint32_t g = 0; g < x->n_groups; g++) {
                uint64_t off, len;
                if (kv_layout_group_range(l, first, a->layer_groups[g], &off, &len) < 0)
                        return reason_set(why, -EINVAL, "Layer group %u does not fit the layout.", g);
                x->layouts[g].n_ranges = 1;
                x->layouts[g].ranges[0] = (HandoffRange) { .offset = off, .length = len };
                x->bytes[g] = len * x->sequence->n_pages;
                x->total_bytes += x->bytes[g];
                first += a->layer_groups[g];
        }

        x->src_arena = page_manager_sequence_arena(m->page_manager, x->sequence);
        if (!x->src_arena)
                return reason_set(why, -ENOENT, "The sequence's arena is gone.");
        if (x->src_arena->domain == MEMORY_GPU && !m->gpu)
                return reason_set(why, -EOPNOTSUPP, "The GPU domain is off.");
        if (x->local) {
                Arena *want = x->src_arena;
                if (a->arena && a->arena[0] && !(want = manager_find_arena(m, a->arena)))
                        return reason_set(why, -ENOENT, "No arena named '%s'.", a->arena);
                x->dst_arena = handoff_pick_arena(m, l->page_size, (uint32_t)x->sequence->n_pages, x->target, want, false);
                if (!x->dst_arena || (a->arena && a->arena[0] && x->dst_arena != want))
                        return reason_set(why, -EINVAL, "No KV arena with pages of %" PRIu64 " bytes%s.", l->page_size,
                                          x->target ? " that the target worker maps" : "");
                /* Within this host, a copy that touches GPU memory goes through the CUDA transport. */
                x->gpu = x->dst_arena != x->src_arena &&
                         (x->src_arena->domain == MEMORY_GPU || x->dst_arena->domain == MEMORY_GPU);
        }
        return 0;
}

/* A congested path takes new work slowly, not into an unbounded queue: the peer's
 * window (docs/telemetry.md, "The handoff window"). */
static int prepare_admit(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, Reason *why) {
        Manager *m = hm->manager;
        PeerWindow *win = handoff_window_get(hm, x->peer, true);
        TelemetryPeerStats st;
        usec_t retry;

        if (!win)
                return -ENOMEM;
        x->window = win;
        if (telemetry_peer_stats(m, win->host, &st) < 0)
                st = (TelemetryPeerStats){ .level = BACKPRESSURE_NONE, .reason = BACKPRESSURE_REASON_NONE };
        BackpressureLevel level = st.level;
        int r = backpressure_window_admit(&m->config.telemetry.backpressure, level, st.reason, win->handoffs,
                                          win->bytes, x->total_bytes, win->held_avg, &retry, NULL);
        if (r != -EAGAIN)
                return 0;
        const char *reason = backpressure_reason_to_string(st.reason);
        hm->counters.deferred++;
        char what[TRACE_DETAIL_MAX];
        snprintf(what, sizeof what, "prepare deferred: %s (%s)", backpressure_level_to_string(level), reason);
        (void)telemetry_trace(m, a->request_id, TRACE_BACKPRESSURE,
                              &(TraceDetail){ .peer = a->destination, .detail = what, .duration_usec = retry,
                                              .has_uid = x->client != NULL,
                                              .uid = x->client ? (uint32_t)x->client->uid : 0 });
        log_debug("handoff %s: deferred: peer %s at %s (%s), %u handoffs / %" PRIu64 " bytes in flight", a->request_id,
                  a->destination, backpressure_level_to_string(level), reason, win->handoffs, win->bytes);
        if (backpressure_window_closed(level, st.reason))
                return reason_set(why, -EAGAIN, "Peer '%s' is backpressured (%s: %s); retry_after_usec=%" PRIu64,
                                  a->destination, backpressure_level_to_string(level), reason, retry);
        return reason_set(why, -EAGAIN,
                          "Peer '%s': the handoff window is full (%s: %u handoffs, %" PRIu64
                          " bytes in flight); retry_after_usec=%" PRIu64,
                          a->destination, backpressure_level_to_string(level), win->handoffs, win->bytes, retry);
}

/* The source side: a new attempt's object, leasing every page of the sequence. */
static int prepare_source(HandoffManager *hm, PrepareCtx *x, HandoffObject **ret, Reason *why) {
        HandoffObject *o;
        int r;

        hm->last_token = handoff_next_token(hm->last_token, now_usec(CLOCK_REALTIME));
        r = handoff_obj_new(hm, HANDOFF_SOURCE, &x->rid, hm->last_token, x->n_groups, x->bytes, x->timeout, &o);
        if (r < 0)
                return prepare_error(why, r, "Prepare");
        o->layouts = TAKE_PTR(x->layouts);
        o->page_size = x->worker->layout->page_size;
        o->arena = x->src_arena->index;
        o->gpu = x->gpu;
        o->pool = x->sequence->pool;
        o->n_pages = (uint32_t)x->sequence->n_pages;
        o->pages = calloc(o->n_pages, sizeof *o->pages);
        if (x->target)
                o->target_worker = x->target->id;
        r = o->pages ? sequence_lease(x->sequence, 0, o->n_pages, o->pages) : -ENOMEM;
        if (r >= 0) {
                o->holds_pages = true;
                r = handoff_obj_link(o, x->client);
        }
        if (r < 0) {
                handoff_obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        *ret = o;
        return 0;
}

/* Within this host: the destination side is a twin object over the same or another
 * arena of this daemon; both are prepared and journaled now. */
static int prepare_local(HandoffManager *hm, PrepareCtx *x, HandoffObject *o, Reason *why) {
        HandoffObject *d;
        int r = handoff_obj_new(hm, HANDOFF_DESTINATION, &x->rid, o->h->token, x->n_groups, x->bytes, x->timeout, &d);
        if (r >= 0) {
                d->layouts = calloc(x->n_groups, sizeof *d->layouts);
                if (d->layouts)
                        memcpy(d->layouts, o->layouts, x->n_groups * sizeof *d->layouts);
                d->page_size = o->page_size;
                d->target_worker = o->target_worker;
                d->twin = o;
                d->gpu = x->gpu;
                o->twin = d;
                if (x->dst_arena == x->src_arena) {
                        /* Same arena: the pages themselves are handed over. */
                        o->zero_copy = d->zero_copy = true;
                        d->arena = o->arena;
                        d->pool = o->pool;
                        d->n_pages = o->n_pages;
                        d->pages = calloc(d->n_pages, sizeof *d->pages);
                        if (d->pages)
                                memcpy(d->pages, o->pages, d->n_pages * sizeof *d->pages);
                        else
                                r = -ENOMEM;
                } else
                        r = handoff_dest_reserve(d, x->dst_arena, o->n_pages);
                if (r >= 0 && !d->layouts)
                        r = -ENOMEM;
                if (r >= 0 && !o->zero_copy) {
                        o->dst_region = d->arena;
                        o->dst_offsets = calloc(o->n_pages, sizeof *o->dst_offsets);
                        if (!o->dst_offsets)
                                r = -ENOMEM;
                        for (uint32_t i = 0; r >= 0 && i < o->n_pages; i++)
                                o->dst_offsets[i] = page_offset(d->pool, d->pages[i]);
                }
                if (r < 0)
                        handoff_obj_free(d);
        }
        if (r < 0) {
                if (r == -ENOSPC) {
                        hm->counters.refused++;
                        handoff_count_failure(hm, HANDOFF_CAUSE_NO_SPACE);
                }
                handoff_obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        (void)handoff_prepared(o->h);
        o->notified_state = o->h->state;
        r = handoff_journal_prepared(o);
        if (r >= 0)
                r = handoff_journal_prepared(d);
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot journal Prepare: %m", o->request_str);
                handoff_obj_free(d); /* journals the release of what was journaled */
                handoff_obj_free(o);
                return prepare_error(why, r, "Prepare");
        }
        /* The reserved pages may be ones just freed (a Release, an eviction): no byte
         * goes into them before the record that freed them is durable. */
        if (!o->zero_copy && !page_manager_pages_settled(hm->manager->page_manager, d->pool, d->pages, d->n_pages)) {
                r = handoff_settle_wait(o);
                if (r < 0) {
                        log_warning_errno(r, "handoff %s: cannot wait for the journal: %m", o->request_str);
                        handoff_obj_free(d);
                        handoff_obj_free(o);
                        return prepare_error(why, r, "Prepare");
                }
        }
        hm->counters.prepared++;
        x->worker->stats.handoffs_out++;
        d->sched_taken = (uint32_t)manager_pages_taken(hm->manager, o->request_str, x->dst_arena, d->n_pages);
        handoff_expect_arrived(d);
        log_debug("handoff %s: prepared locally (%s, %u pages, %u groups)", o->request_str,
                  o->zero_copy ? "same arena" : "copy", o->n_pages, x->n_groups);
        return HANDOFF_PREPARED_NOW;
}

/* To another host: GPU pages go through a pinned host staging buffer (the peer
 * transport sends from host memory); then the destination is asked, and the answer
 * to Prepare waits for its. */
static int prepare_remote(HandoffManager *hm, const HandoffPrepareArgs *a, PrepareCtx *x, HandoffObject *o,
                          HandoffPrepareWaiter *waiter, Reason *why) {
        uint32_t n_groups = x->n_groups;
        int r;

        /* A layer group is a write a page at least, and a peer takes at most
         * PEER_INCOMING_MAX writes in flight: one with more pages could never go. */
        if (o->n_pages > PEER_INCOMING_MAX) {
                uint32_t n = o->n_pages;
                handoff_obj_free(o);
                return reason_set(why, -EDQUOT,
                                  "A handoff to another host moves at most %u pages (a peer takes %u writes in "
                                  "flight, a page each a layer group); this one has %" PRIu32 ".",
                                  PEER_INCOMING_MAX, PEER_INCOMING_MAX, n);
        }

        if (x->src_arena->domain == MEMORY_GPU) {
                o->net_writes = calloc(n_groups, sizeof *o->net_writes);
                o->n_net = calloc(n_groups, sizeof *o->n_net);
                o->stage_landed = calloc(n_groups, sizeof *o->stage_landed);
                r = o->net_writes && o->n_net && o->stage_landed ? handoff_staging_acquire(hm, (uint64_t)o->n_pages * o->page_size, &o->staging)
                                       : -ENOMEM;
                if (r < 0) {
                        handoff_obj_free(o);
                        if (r == -ENOSPC)
                                return reason_set(why, -ENOSPC,
                                                  "No room for staging %" PRIu64 " bytes of GPU pages to '%s'.",
                                                  (uint64_t)x->sequence->n_pages * x->worker->layout->page_size,
                                                  a->destination);
                        return reason_set(why, -EIO, "Cannot stage GPU pages to '%s': %s", a->destination,
                                          strerror(-r));
                }
                o->staged = true;
        }

        o->peer = x->peer;
        snprintf(o->peer_host, sizeof o->peer_host, "%s", a->destination);
        /* The transport is chosen once: completions in-band and pipelining depend on
         * what it carries (tcp: both; rdma: neither, it asks the destination anyway). */
        o->net = peer_manager_transport_for(handoff_obj_manager(o)->peers, x->peer);
        unsigned caps = o->net ? o->net->ops->caps : 0;
        o->imm = caps & TRANSPORT_CAP_IMM;
        /* Staged (GPU source) handoffs are targeted too: their writes leave from the
         * staging buffer, as late as any other's. They are not pipelined: the staging
         * copy comes first anyway. */
        bool targeted = (caps & TRANSPORT_CAP_TARGET) && o->page_size < HANDOFF_PAGE_SIZE_MAX;
        bool pipelined = targeted && !o->staging && o->imm &&
                         x->total_bytes <= hm->manager->config.handoff_pipeline_bytes;
        if (targeted) {
                /* Writes go to the attempt's slot, pipelined or not: once the attempt is
                 * rolled back at the destination, its late writes are refused there, never
                 * taken for another handoff's that got the same pages. */
                /* Page i at (i << 32): pages are never adjacent, so no write spans two. */
                o->dst_offsets = calloc(o->n_pages, sizeof *o->dst_offsets);
                if (!o->dst_offsets) {
                        handoff_obj_free(o);
                        return -ENOMEM;
                }
                for (uint32_t i = 0; i < o->n_pages; i++)
                        o->dst_offsets[i] = handoff_slot_offset(i, 0);
                o->slot = ++hm->next_slot;
        }
        _cleanup_(freep) uint32_t *gr = calloc(n_groups + 1, sizeof *gr);
        _cleanup_(freep) HandoffRange *ranges = calloc(n_groups, sizeof *ranges);
        if (!gr || !ranges) {
                handoff_obj_free(o);
                return -ENOMEM;
        }
        for (uint32_t g = 0; g < n_groups; g++) {
                gr[g] = g;
                ranges[g] = o->layouts[g].ranges[0];
        }
        gr[n_groups] = n_groups;
        HandoffMessage pm = {
                .type = HANDOFF_MSG_PREPARE,
                .request_id = x->rid,
                .token = o->h->token,
                .timeout_usec = x->timeout,
                .page_size = o->page_size,
                .layout_hash = layout_hash(x->worker->layout),
                .n_pages = o->n_pages,
                .n_groups = n_groups,
                .flags = (o->imm ? HANDOFF_PREPARE_F_IMM : 0) |
                         (pipelined ? HANDOFF_PREPARE_F_PIPELINED : targeted ? HANDOFF_PREPARE_F_TARGETED : 0),
                .slot = o->slot,
                .group_ranges = gr,
                .ranges = ranges,
                .n_ranges = n_groups,
        };
        _cleanup_(freep) uint8_t *buf = NULL;
        size_t len;
        r = handoff_message_encode(&pm, &buf, &len);
        if (r >= 0)
                r = peer_send(x->peer, HANDOFF_MSG_PREPARE, buf, len);
        if (r < 0) {
                handoff_obj_free(o);
                return reason_set(why, -EHOSTUNREACH, "Cannot reach peer '%s': %s", a->destination, strerror(-r));
        }
        o->windowed = true;
        o->window_bytes = x->total_bytes;
        o->window_since = now_usec(CLOCK_MONOTONIC);
        x->window->handoffs++;
        x->window->bytes += x->total_bytes;
        handoff_window_publish(hm, x->window);
        hm->counters.prepared++;
        x->worker->stats.handoffs_out++;
        if (!pipelined) {
                /* The answer to Prepare waits for the destination's (PREPARE_OK or
                 * PREPARE_REFUSED: NoSpace to the caller), at most
                 * HANDOFF_PREPARE_ANSWER_USEC: below a client's default call timeout, so
                 * that the caller hears the outcome rather than giving up on a handoff
                 * that may still be prepared after. */
                o->waiter = waiter;
                usec_t bound = now_usec(CLOCK_MONOTONIC) + HANDOFF_PREPARE_ANSWER_USEC;
                if (bound < o->h->deadline_usec)
                        (void)handoff_obj_arm_timer(o, bound);
                return HANDOFF_PREPARE_PENDING;
        }
        /* Pipelined: no round trip. The writes name the slot, and the destination
         * reserves the pages when the PREPARE, sent first, reaches it; a refusal comes
         * back as a rollback. */
        (void)handoff_prepared(o->h);
        o->notified_state = o->h->state;
        r = handoff_journal_prepared(o);
        if (r < 0) {
                log_warning_errno(r, "handoff %s: cannot journal Prepare: %m", o->request_str);
                /* The caller never learns of it: it ends here (and at the destination). */
                (void)handoff_rollback(o->h, HANDOFF_CAUSE_REFUSED, false);
                handoff_manager_release(o);
                return prepare_error(why, r, "Prepare");
        }
        hm->counters.pipelined++;
        return HANDOFF_PREPARED_NOW;
}

int handoff_manager_prepare(HandoffManager *hm, Worker *w, const HandoffPrepareArgs *a,
                            HandoffPrepareWaiter *waiter, HandoffObject **ret, Reason *why) {
        Manager *m = hm->manager;
        _cleanup_(prepare_ctx_done) PrepareCtx x = { .worker = w, .client = w->object.owner };
        HandoffObject *o = NULL;
        int r;

        r = prepare_check(hm, a, &x, why);
        if (r < 0)
                return r;

        /* Idempotence: the same request, still live, from the same client. */
        HandoffObject *old = hashmap_get(hm->sources, x.rid.bytes);
        if (old && handoff_is_live(old->h)) {
                if (!handoff_object_owned_by(old, x.client))
                        return reason_set(why, -EEXIST, "Request %s has a handoff of another client.", a->request_id);
                if (old->waiter)
                        return reason_set(why, -EBUSY, "Request %s: Prepare is in progress.", a->request_id);
                *ret = old;
                return HANDOFF_PREPARED_ALREADY;
        }

        r = prepare_layout(hm, a, &x, why);
        if (r >= 0 && !x.local)
                r = prepare_admit(hm, a, &x, why);
        if (r < 0)
                return r;
        /* A handoff always has a deadline: a caller's timeout may shorten HandoffTimeout=,
         * not lift it (UINT64_MAX was no deadline at all: the pages held for good by a
         * prefill that stalled connected), as a destination on another host cuts it. */
        x.timeout = a->timeout_usec ? MIN(a->timeout_usec, m->config.handoff_timeout_usec)
                                    : m->config.handoff_timeout_usec;
        r = prepare_source(hm, &x, &o, why);
        if (r < 0)
                return r;
        if (!x.local && o->h->deadline_usec != USEC_INFINITY) {
                /* Across hosts the destination decides at the deadline (its COMMIT or its
                 * ROLLBACK): the source waits that long plus four heartbeats (at least 2 s:
                 * the COMMIT also waits for the destination's sync) for its word
                 * before timing out on its own. Two clocks each rolling back at "the"
                 * deadline let a commit that crossed the source's timer leave the source
                 * rolled back and the destination committed. */
                usec_t margin = MAX(4 * m->config.heartbeat_usec, 2 * USEC_PER_SEC);
                if (ADD_OVERFLOW(o->h->deadline_usec, margin, &o->h->deadline_usec))
                        o->h->deadline_usec = USEC_INFINITY;
                (void)handoff_obj_arm_timer(o, o->h->deadline_usec);
        }
        o->release_on_commit = a->release_on_commit;
        r = x.local ? prepare_local(hm, &x, o, why) : prepare_remote(hm, a, &x, o, waiter, why);
        if (r < 0)
                return r;
        *ret = o;
        /* Groups computed already ship now (or once the destination answered). */
        if (a->ready > 0) {
                for (uint32_t g = 0; g < MIN(a->ready, o->h->n_groups); g++)
                        (void)handoff_obj_group_ready(o, g);
                handoff_pump(o);
                handoff_after_event(o);
        }
        return r;
}

int handoff_manager_group_ready(HandoffObject *o, uint32_t group, Reason *why) {
        int r = handoff_obj_group_ready(o, group);
        if (r == -EPERM)
                return reason_set(why, -EINVAL, "LayerGroupReady is the prefill side's.");
        if (r == -ESTALE)
                return reason_set(why, -ESTALE, "Handoff %s was rolled back (%s).", o->request_str,
                                     handoff_cause_to_string(o->h->cause));
        if (r < 0)
                return reason_set(why, -EINVAL,
                                     "Layer group %" PRIu32 " is out of order or range (next: %" PRIu32 " of %" PRIu32 ").",
                                     group, o->h->n_ready, o->h->n_groups);
        if (r > 0)
                handoff_pump(o);
        handoff_after_event(o);
        return 0;
}
