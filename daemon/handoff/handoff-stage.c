/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* GPU pages to another host: a pinned host staging buffer per handoff, registered with
 * the CUDA and the peer transports; each group is copied GPU → buffer on the CUDA
 * transport, then sent buffer → destination by the peer transport. */
#include "handoff/handoff-internal.h"

#include <sys/mman.h>

/* ---- staging buffers (GPU pages to another host) ---- */

void handoff_staging_free(HandoffManager *hm, HandoffStaging *st) {
        Manager *m = hm->manager;
        Transport *t;
        if (!st)
                return;
        if (st->in_peer && (t = peer_manager_transport(m->peers)))
                t->ops->unregister_region(t, &st->region);
        if (st->in_rdma && (t = peer_manager_rdma(m->peers)))
                t->ops->unregister_region(t, &st->region);
        if (st->in_cuda && (t = handoff_gpu_transport(hm)))
                t->ops->unregister_region(t, &st->region); /* unpins */
        if (st->region.host_base) {
                (void)munmap(st->region.host_base, st->region.size);
                hm->staging_bytes -= st->region.size;
        }
        hm->staging[st->slot] = NULL;
        free(st);
}

/* An idle buffer of at least `size` bytes, or a new one (pinned and registered with
 * both transports), within HANDOFF_STAGING_BYTES_MAX in all: idle buffers go to make
 * room. -ENOSPC when busy ones fill it. */
int handoff_staging_acquire(HandoffManager *hm, uint64_t size, HandoffStaging **ret) {
        Manager *m = hm->manager;
        HandoffStaging *best = NULL;
        uint32_t slot = HANDOFF_STAGING_MAX;
        int r;

        size = ALIGN_TO(size, (uint64_t)(2U << 20));
        if (size == 0 || size > HANDOFF_STAGING_BYTES_MAX)
                return -ENOSPC;
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX; i++) {
                HandoffStaging *st = hm->staging[i];
                if (st && !st->busy && st->region.size >= size && (!best || st->region.size < best->region.size))
                        best = st;
        }
        if (best) {
                best->busy = true;
                *ret = best;
                return 0;
        }
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX && hm->staging_bytes + size > HANDOFF_STAGING_BYTES_MAX; i++)
                if (hm->staging[i] && !hm->staging[i]->busy)
                        handoff_staging_free(hm, hm->staging[i]);
        if (hm->staging_bytes + size > HANDOFF_STAGING_BYTES_MAX)
                return -ENOSPC;
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX && slot == HANDOFF_STAGING_MAX; i++)
                if (!hm->staging[i])
                        slot = i;
        /* Every slot taken: an idle buffer (too small for this one) gives its slot up. */
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX && slot == HANDOFF_STAGING_MAX; i++)
                if (!hm->staging[i]->busy) {
                        handoff_staging_free(hm, hm->staging[i]);
                        slot = i;
                }
        if (slot == HANDOFF_STAGING_MAX)
                return -ENOSPC;

        HandoffStaging *st = calloc(1, sizeof *st);
        if (!st)
                return -ENOMEM;
        st->slot = slot;
        hm->staging[slot] = st;
        void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) {
                r = -errno;
                handoff_staging_free(hm, st);
                return r;
        }
        st->region = (TransportRegion) { .id = HANDOFF_STAGING_REGION_BASE + slot, .domain = MEMORY_HOST,
                                         .host_base = p, .size = size, .source_only = true };
        hm->staging_bytes += size;
        Transport *gt = handoff_gpu_transport(hm), *nt = peer_manager_transport(m->peers);
        r = gt && nt ? 0 : -ENOTCONN;
        if (r >= 0)
                r = gt->ops->register_region(gt, &st->region);
        if (r >= 0) {
                st->in_cuda = true;
                r = nt->ops->register_region(nt, &st->region);
        }
        /* GPU pages to a peer on RDMA go through this pinned host buffer too (the
         * registration is an ibv_reg_mr on each open device). */
        Transport *rt = peer_manager_rdma(m->peers);
        if (r >= 0 && rt) {
                st->in_peer = true;
                r = rt->ops->register_region(rt, &st->region);
                if (r >= 0)
                        st->in_rdma = true;
        }
        if (r < 0) {
                log_warning_errno(r, "handoff: cannot set up a staging buffer of %" PRIu64 " bytes: %m", size);
                handoff_staging_free(hm, st);
                return r;
        }
        st->in_peer = true;
        st->busy = true;
        log_debug("handoff: staging buffer %u of %" PRIu64 " bytes (%" PRIu64 " in all)", slot, size,
                  hm->staging_bytes);
        *ret = st;
        return 0;
}

/* The handoff is done with its buffer (every write of it completed, and none can come:
 * committed or ended): idle again, for the next handoff, though the handoff object
 * lives on until its owner releases it. */
void handoff_staging_put(HandoffObject *o) {
        if (!o->staging)
                return;
        o->staging->busy = false;
        o->staging = NULL;
}

void handoff_staging_count(const HandoffManager *hm, uint64_t *ret_buffers, uint64_t *ret_busy) {
        uint64_t n = 0, busy = 0;
        for (uint32_t i = 0; i < HANDOFF_STAGING_MAX; i++)
                if (hm->staging[i]) {
                        n++;
                        busy += hm->staging[i]->busy;
                }
        *ret_buffers = n;
        *ret_busy = busy;
}

/* ---- shipping groups (source) ---- */

int handoff_plan_collect(const HandoffSlice *s, void *userdata) {
        PlanCtx *c = userdata;
        if (c->n == c->cap) {
                /* A small layer group is a write or a few (one per page and range, cut
                 * into slices): 8 to start with keeps the common plan a small
                 * allocation, doubling after that. */
                size_t cap = c->cap ? c->cap * 2 : 8;
                TransportWrite *p = reallocarray(c->w, cap, sizeof *p);
                if (!p)
                        return -ENOMEM;
                c->w = p;
                c->cap = cap;
        }
        c->w[c->n++] = (TransportWrite) {
                .src_region = c->o->arena,
                .src_offset = s->src_offset,
                .dst_region = c->o->dst_region,
                .dst_offset = s->dst_offset,
                .length = s->length,
        };
        return 0;
}

/* A remote handoff of GPU pages, group g: the group's bytes of every page are copied
 * into the staging buffer (page i at i × page_size, one batch on the CUDA transport);
 * once that batch completed, handoff_stage_landed() posts the peer writes planned here, from
 * the staging buffer to the destination's pages. The group counts both kinds of write;
 * the staging copies count no bytes. */
int handoff_post_group_staged(HandoffObject *o, uint32_t g) {
        HandoffManager *hm = o->hm;
        Transport *gt = handoff_gpu_transport(hm);
        uint32_t stage_id = o->staging->region.id;
        int r;

        if (!gt || !o->peer)
                return -ENOTCONN;
        _cleanup_(freep) uint64_t *src = calloc(o->n_pages, sizeof *src);
        _cleanup_(freep) uint64_t *mid = calloc(o->n_pages, sizeof *mid);
        if (!src || !mid)
                return -ENOMEM;
        for (uint32_t i = 0; i < o->n_pages; i++) {
                src[i] = page_offset(o->pool, o->pages[i]);
                mid[i] = (uint64_t)i * o->page_size;
        }
        PlanCtx a = { .o = o, .group = g }, b = { .o = o, .group = g };
        r = handoff_plan_group(&o->layouts[g], src, mid, o->n_pages, 0, handoff_plan_collect, &a);
        if (r >= 0)
                r = handoff_plan_group(&o->layouts[g], mid, o->dst_offsets, o->n_pages, hm->slice_size,
                                       handoff_plan_collect, &b);
        if (r >= 0 && (a.n == 0 || b.n == 0))
                r = -EINVAL;
        OutWrite *ow = r >= 0 ? malloc(sizeof *ow) : NULL;
        if (r >= 0 && !ow)
                r = -ENOMEM;
        if (r >= 0) {
                *ow = (OutWrite) { .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g, .obj = o, .group = g,
                                   .pending = a.n, .stage = true };
                r = hashmap_put(hm->writes, &ow->cookie, ow);
                if (r < 0)
                        free(ow);
        }
        if (r >= 0) {
                for (size_t k = 0; k < a.n; k++) {
                        a.w[k].dst_region = stage_id;
                        a.w[k].cookie = ow->cookie;
                }
                for (size_t k = 0; k < b.n; k++)
                        b.w[k].src_region = stage_id;
                r = gt->ops->post(gt, NULL, a.w, a.n);
                if (r < 0)
                        free(hashmap_remove(hm->writes, &ow->cookie));
        }
        free(a.w);
        if (r < 0) {
                free(b.w);
                return r;
        }
        o->net_writes[g] = b.w;
        o->n_net[g] = b.n;
        (void)handoff_group_posted(o->h, g, (uint32_t)(a.n + b.n));
        hm->counters.batches++;
        return 0;
}

/* Group g's peer writes, from the staging buffer: posted, or completed at once with the
 * error (error < 0, or the post failing), so that the group's count of writes in flight
 * comes down either way. -ENOBUFS: the writes in flight to the peer are at the
 * transport's bound; nothing was done and the writes stay for a later try. */
static int stage_send(HandoffObject *o, uint32_t g, int error) {
        HandoffManager *hm = o->hm;
        Transport *nt = o->net ? o->net : peer_manager_transport_for(hm->manager->peers, o->peer);
        TransportWrite *w = o->net_writes ? o->net_writes[g] : NULL;
        size_t n = o->n_net ? o->n_net[g] : 0, i = 0;
        int r = error;

        if (!w)
                return 0;
        if (r >= 0 && (!handoff_is_live(o->h) || !o->peer || !nt))
                r = -ECANCELED;
        OutWrite **ow = r >= 0 ? calloc(n, sizeof *ow) : NULL;
        if (r >= 0 && !ow)
                r = -ENOMEM;
        for (i = 0; r >= 0 && i < n; i++) {
                ow[i] = malloc(sizeof(OutWrite));
                if (!ow[i]) {
                        r = -ENOMEM;
                        break;
                }
                *ow[i] = (OutWrite) { .cookie = (++hm->next_cookie << COOKIE_GROUP_BITS) | g, .obj = o, .group = g,
                                      .pending = 1 };
                w[i].cookie = ow[i]->cookie;
                if (o->slot) {
                        /* Into the attempt's slot (its offsets are the slot's): refused
                         * there once the attempt is rolled back, whoever has its pages. */
                        w[i].flags |= TRANSPORT_WRITE_TARGET;
                        w[i].target = o->slot;
                } else if (nt->ops->caps & TRANSPORT_CAP_ATTEMPT) {
                        /* Real offsets (rdma): taken only while the pages are this
                         * attempt's. */
                        w[i].flags |= TRANSPORT_WRITE_ATTEMPT;
                        w[i].target = o->h->token;
                }
                r = hashmap_put(hm->writes, &ow[i]->cookie, ow[i]);
                if (r < 0) {
                        free(ow[i]);
                        break;
                }
        }
        if (r >= 0 && n > 0)
                handoff_mark_group_end(o, g, &w[n - 1]);
        if (r >= 0)
                r = nt->ops->post(nt, o->peer, w, n);
        if (r >= 0)
                handoff_turn_count(hm, n);
        if (r < 0)
                for (size_t k = 0; k < i; k++)
                        free(hashmap_remove(hm->writes, &ow[k]->cookie));
        free(ow);
        if (r == -ENOBUFS)
                return r; /* kept in net_writes[g] */
        o->net_writes[g] = NULL;
        if (r < 0) {
                if (r != -ECANCELED)
                        log_warning_errno(r, "handoff %s: cannot send staged group %" PRIu32 ": %m", o->request_str, g);
                for (size_t k = 0; k < n; k++)
                        (void)handoff_write_done(o->h, g, 0, r);
        }
        free(w);
        return 0;
}

void handoff_stage_send_landed(HandoffObject *o) {
        if (!o->net_writes || !o->stage_landed)
                return;
        bool live = handoff_is_live(o->h);
        for (uint32_t g = 0; g < o->h->n_groups; g++) {
                if (!o->net_writes[g])
                        continue; /* sent, failed, or not staged yet (nor any after it) */
                if (!o->stage_landed[g]) {
                        if (live)
                                break; /* in order: the groups after it wait for it */
                        continue;      /* it is cancelled when it lands */
                }
                /* This dispatch's writes to other hosts posted: the next dispatch goes
                 * on from g (cancelled ones post nothing). */
                if (live && !handoff_turn_has_room(o->hm) && handoff_yield(o))
                        break;
                if (stage_send(o, g, live ? 0 : -ECANCELED) == -ENOBUFS) {
                        handoff_stall(o);
                        break;
                }
        }
}

/* Group g is in the staging buffer (or failed to get there): its peer writes go, in
 * group order, or complete at once with the error. */
void handoff_stage_landed(HandoffObject *o, uint32_t g, int error) {
        if (!o->net_writes || !o->net_writes[g])
                return;
        if (error < 0 || !o->stage_landed) {
                (void)stage_send(o, g, error < 0 ? error : -ENOMEM);
                return;
        }
        o->stage_landed[g] = true;
        if (!o->stalled)
                handoff_stage_send_landed(o);
}
