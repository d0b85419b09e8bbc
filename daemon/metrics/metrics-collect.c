/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "metrics/metrics-collect.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/worker.h"
#include "feature/feature-manager.h"
#include "feature/feature-spill.h"
#include "feature/feature.h"
#include "gpu/gpu-manager.h"
#include "handoff/handoff-manager.h"
#include "histogram.h"
#include "macro.h"
#include "pages/pages.h"
#include "peer/peer-manager.h"
#include "sched/scheduler.h"
#include "telemetry/telemetry.h"
#include "time-util.h"
#include "wal/wal-manager.h"
#include "wal/wal-writer.h"

#define L METRIC_LABELS

static void collect_daemon(Manager *m, MetricsWriter *w, uint64_t scrapes) {
        metrics_family(w, "epd_build", METRIC_INFO, NULL, "The epdd version serving.");
        metrics_sample_u64(w, L({ "version", EPD_VERSION }, { "host", m->config.host_id }), 1);
        metrics_family(w, "epd_start_time_seconds", METRIC_GAUGE, "seconds",
                       "When this epdd started, in seconds since the epoch.");
        metrics_sample(w, METRIC_NO_LABELS, (double)m->started_usec / 1e6);
        metrics_family(w, "epd_clients", METRIC_GAUGE, NULL, "Clients with state in the daemon.");
        metrics_sample_u64(w, METRIC_NO_LABELS, hashmap_size(m->clients));
        unsigned by_role[_WORKER_ROLE_MAX] = {};
        Worker *wk;
        size_t it = 0;
        while (hashmap_iterate(m->workers, &it, (void **)&wk, NULL))
                if ((unsigned)wk->role < _WORKER_ROLE_MAX)
                        by_role[wk->role]++;
        metrics_family(w, "epd_workers", METRIC_GAUGE, NULL, "Registered workers, by role.");
        for (int r = 0; r < _WORKER_ROLE_MAX; r++)
                metrics_sample_u64(w, L({ "role", worker_role_to_string((WorkerRole)r) }), by_role[r]);
        metrics_family(w, "epd_loop_stalls", METRIC_COUNTER, NULL,
                       "Dispatches of the event loop that held it 1 ms or longer (every other call waited).");
        metrics_sample_u64(w, METRIC_NO_LABELS, m->loop_stalls);
        metrics_family(w, "epd_loop_stall_longest_seconds", METRIC_GAUGE, "seconds",
                       "The longest such dispatch, and what it was (a bus call by name, or an event source).");
        if (m->loop_stalls > 0)
                metrics_sample(w, L({ "what", m->loop_stall_max_what }), (double)m->loop_stall_max_usec / 1e6);
        metrics_family(w, "epd_metrics_scrapes", METRIC_COUNTER, NULL,
                       "Scrapes of this endpoint rendered (past 20 a second, a scrape gets the last body).");
        metrics_sample_u64(w, METRIC_NO_LABELS, scrapes);
}

static void collect_arenas(Manager *m, MetricsWriter *w) {
        metrics_family(w, "epd_arena_size_bytes", METRIC_GAUGE, "bytes", "Size of each arena, its header included.");
        for (size_t i = 0; i < m->n_arenas; i++) {
                Arena *a = m->arenas[i];
                metrics_sample_u64(w,
                                   L({ "arena", a->name }, { "domain", memory_domain_to_string(a->domain) },
                                     { "usage", arena_usage_to_string(a->usage) }),
                                   a->size);
        }
        /* Page pools exist once a KV layout (or PageSize=) fixed the page size. */
        PagePoolStats st[64];
        const char *names[64];
        size_t n = 0;
        for (size_t i = 0; i < m->n_arenas && n < ELEMENTSOF(st); i++)
                if (m->arenas[i]->pages) {
                        page_pool_stats(m->arenas[i]->pages, &st[n]);
                        names[n++] = m->arenas[i]->name;
                }
        metrics_family(w, "epd_arena_page_size_bytes", METRIC_GAUGE, "bytes", "Size of a KV page of the arena.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].page_size);
        metrics_family(w, "epd_arena_pages", METRIC_GAUGE, NULL,
                       "KV pages by state: free, live (held by a sequence or a handoff), idle (cached, evictable).");
        for (size_t i = 0; i < n; i++) {
                metrics_sample_u64(w, L({ "arena", names[i] }, { "state", "free" }), st[i].free);
                metrics_sample_u64(w, L({ "arena", names[i] }, { "state", "live" }), st[i].live);
                metrics_sample_u64(w, L({ "arena", names[i] }, { "state", "idle" }), st[i].cached_idle);
        }
        metrics_family(w, "epd_arena_pages_leased", METRIC_GAUGE, NULL,
                       "KV pages leased by a transfer or offload in flight.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].leased);
        metrics_family(w, "epd_arena_pages_shared", METRIC_GAUGE, NULL, "KV pages referenced by two sequences or more.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].shared);
        metrics_family(w, "epd_arena_shared_saved_bytes", METRIC_GAUGE, "bytes",
                       "Bytes that sharing pages saves over copying them.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].bytes_saved);
        metrics_family(w, "epd_arena_cow_copies", METRIC_COUNTER, NULL, "KV pages copied on write.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].cow_copies);
        metrics_family(w, "epd_arena_page_evictions", METRIC_COUNTER, NULL, "Idle cached KV pages evicted.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].evictions);
        metrics_family(w, "epd_arena_page_alloc_failures", METRIC_COUNTER, NULL,
                       "KV page allocations refused for want of free pages.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "arena", names[i] }), st[i].alloc_failures);
}

static void collect_workers(Manager *m, MetricsWriter *w) {
        Worker *wk;
        size_t it;
        metrics_family(w, "epd_worker", METRIC_INFO, NULL, "A registered worker: role, model, device, name.");
        it = 0;
        while (hashmap_iterate(m->workers, &it, (void **)&wk, NULL))
                metrics_sample_u64(w,
                                   L({ "worker", wk->id_str }, { "role", worker_role_to_string(wk->role) },
                                     { "model", wk->model }, { "device", wk->device }, { "name", wk->name ?: "" }),
                                   1);
        /* Each family needs all its samples together: one pass per family. */
        static const struct {
                const char *name;
                MetricType type;
                const char *help;
        } fam[] = {
                { "epd_worker_sequences", METRIC_GAUGE, "Sequences the worker owns." },
                { "epd_worker_pages", METRIC_GAUGE, "KV pages the worker's sequences hold (shared ones included)." },
                { "epd_worker_handoffs", METRIC_COUNTER, "Handoffs the worker prepared (out) or accepted (in)." },
                { "epd_worker_features_produced", METRIC_COUNTER, "Features the worker published." },
                { "epd_worker_feature_acquires", METRIC_COUNTER,
                  "The worker's feature Acquires: hit (found, or read back) or miss (told to produce)." },
        };
        for (size_t f = 0; f < ELEMENTSOF(fam); f++) {
                metrics_family(w, fam[f].name, fam[f].type, NULL, fam[f].help);
                it = 0;
                while (hashmap_iterate(m->workers, &it, (void **)&wk, NULL)) {
                        WorkerStats st;
                        manager_worker_stats(m, wk, &st);
                        switch (f) {
                        case 0:
                                metrics_sample_u64(w, L({ "worker", wk->id_str }), st.sequences);
                                break;
                        case 1:
                                metrics_sample_u64(w, L({ "worker", wk->id_str }), st.pages);
                                break;
                        case 2:
                                metrics_sample_u64(w, L({ "worker", wk->id_str }, { "direction", "out" }),
                                                   st.handoffs_out);
                                metrics_sample_u64(w, L({ "worker", wk->id_str }, { "direction", "in" }),
                                                   st.handoffs_in);
                                break;
                        case 3:
                                metrics_sample_u64(w, L({ "worker", wk->id_str }), st.features_produced);
                                break;
                        default:
                                metrics_sample_u64(w, L({ "worker", wk->id_str }, { "result", "hit" }),
                                                   st.feature_hits);
                                metrics_sample_u64(w, L({ "worker", wk->id_str }, { "result", "miss" }),
                                                   st.feature_misses);
                                break;
                        }
                }
        }
}

/* Peers, but not members that left the membership: a target that went away is gone
 * from the exposition (Prometheus marks its series stale), and a daemon that saw hosts
 * come and go under new ids for months does not export five series for each of them.
 * A member that comes back is exported again, its counters where they were. */
static void collect_peers(Manager *m, MetricsWriter *w) {
        PeerManager *pm = m->peers;
        size_t n = pm ? peer_manager_n_peers(pm) : 0, n_live = 0;
        _cleanup_(freep) Peer **live = NULL;
        Peer *p;

        /* Once through every peer ever known, then five times through the live ones. */
        if (n > 0) {
                live = malloc(n * sizeof *live);
                if (!live)
                        n = 0; /* the families alone */
        }
        for (size_t i = 0; i < n && (p = peer_manager_peer(pm, i)); i++)
                if (!peer_is_retired(p))
                        live[n_live++] = p;

        metrics_family(w, "epd_peer_up", METRIC_GAUGE, NULL,
                       "1 when the peer's control connection is up and authenticated; the transport its bytes take.");
        for (size_t i = 0; i < n_live; i++) {
                Transport *t = peer_manager_transport_for(pm, live[i]);
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }, { "transport", t ? t->ops->name : "tcp" }),
                                   peer_is_up(live[i]));
        }
        metrics_family(w, "epd_peer_connects", METRIC_COUNTER, NULL, "Times the peer came up.");
        for (size_t i = 0; i < n_live; i++)
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }), peer_stats(live[i])->connects);
        metrics_family(w, "epd_peer_disconnects", METRIC_COUNTER, NULL, "Times the peer went down.");
        for (size_t i = 0; i < n_live; i++)
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }), peer_stats(live[i])->disconnects);
        metrics_family(w, "epd_peer_heartbeats_missed", METRIC_COUNTER, NULL,
                       "Times the peer was declared down for missed heartbeats.");
        for (size_t i = 0; i < n_live; i++)
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }), peer_stats(live[i])->heartbeats_missed);
        metrics_family(w, "epd_peer_control_bytes", METRIC_COUNTER, "bytes",
                       "Bytes of control frames to (out) and from (in) the peer.");
        for (size_t i = 0; i < n_live; i++) {
                const PeerStats *st = peer_stats(live[i]);
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }, { "direction", "out" }), st->bytes_out);
                metrics_sample_u64(w, L({ "peer", peer_host_id(live[i]) }, { "direction", "in" }), st->bytes_in);
        }
}

/* The kernel's view of each peer path (BPF) and its backpressure level. */
static void collect_paths(Manager *m, MetricsWriter *w) {
        /* Every peer (MaxPeers= may be far above 256). */
        _cleanup_(freep) TelemetryPeerStats *s = NULL;
        size_t n = 0, cap = 0, it = 0;
        while (m->telemetry) {
                if (n == cap) {
                        TelemetryPeerStats *g = reallocarray(s, MAX(cap * 2, (size_t)64), sizeof *g);
                        if (!g)
                                break; /* what fits so far */
                        s = g;
                        cap = MAX(cap * 2, (size_t)64);
                }
                if (telemetry_iterate_peers(m->telemetry, &it, &s[n]) <= 0)
                        break;
                /* A member that left keeps its entry until the table needs the room (its
                 * level reads "disconnected"): not exported, as in collect_peers(). */
                if (!peer_is_retired(peer_manager_find(m->peers, s[n].name)))
                        n++;
        }
        metrics_family(w, "epd_peer_backpressure_level", METRIC_GAUGE, NULL,
                       "Backpressure of the path to the peer: 0 none, 1 elevated, 2 high, 3 stalled.");
        for (size_t i = 0; i < n; i++)
                metrics_sample_u64(w, L({ "peer", s[i].name }, { "reason", backpressure_reason_to_string(s[i].reason) }),
                                   s[i].level);
        metrics_family(w, "epd_peer_srtt_seconds", METRIC_GAUGE, "seconds",
                       "Smoothed TCP round-trip time to the peer, as the kernel sees it (largest over its connections).");
        for (size_t i = 0; i < n; i++)
                if (s[i].kernel)
                        metrics_sample(w, L({ "peer", s[i].name }), s[i].path.srtt_usec / 1e6);
        metrics_family(w, "epd_peer_min_rtt_seconds", METRIC_GAUGE, "seconds",
                       "Smallest TCP round-trip time to the peer the kernel measured.");
        for (size_t i = 0; i < n; i++)
                if (s[i].kernel)
                        metrics_sample(w, L({ "peer", s[i].name }), s[i].path.min_rtt_usec / 1e6);
        metrics_family(w, "epd_peer_retransmits", METRIC_COUNTER, NULL, "TCP segments retransmitted to the peer.");
        for (size_t i = 0; i < n; i++)
                if (s[i].kernel)
                        metrics_sample_u64(w, L({ "peer", s[i].name }), s[i].totals.retransmits);
        metrics_family(w, "epd_peer_tcp_bytes", METRIC_COUNTER, "bytes",
                       "TCP bytes to the peer, as the kernel counts them: sent, acked, received, retransmitted.");
        for (size_t i = 0; i < n; i++)
                if (s[i].kernel) {
                        metrics_sample_u64(w, L({ "peer", s[i].name }, { "kind", "sent" }), s[i].totals.bytes_sent);
                        metrics_sample_u64(w, L({ "peer", s[i].name }, { "kind", "acked" }), s[i].totals.bytes_acked);
                        metrics_sample_u64(w, L({ "peer", s[i].name }, { "kind", "received" }),
                                           s[i].totals.bytes_received);
                        metrics_sample_u64(w, L({ "peer", s[i].name }, { "kind", "retransmitted" }),
                                           s[i].totals.bytes_retrans);
                }
        metrics_family(w, "epd_peer_send_queue_bytes", METRIC_GAUGE, "bytes",
                       "Bytes waiting in the send queues of the peer's connections.");
        for (size_t i = 0; i < n; i++)
                if (s[i].kernel)
                        metrics_sample_u64(w, L({ "peer", s[i].name }), s[i].path.send_queue);
        TelemetryCounters c = {};
        if (m->telemetry)
                telemetry_get_counters(m->telemetry, &c);
        metrics_family(w, "epd_kernel_telemetry", METRIC_GAUGE, NULL,
                       "1 when the BPF programs that watch peer connections are loaded.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c.bpf_loaded);
        metrics_family(w, "epd_ring_events", METRIC_COUNTER, NULL, "Events the BPF programs reported.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c.ring_events);
}

static void collect_handoffs(Manager *m, MetricsWriter *w) {
        HandoffManager *hm = m->handoffs;
        const HandoffPath *p;
        if (!hm)
                return;
#define PATH_LABELS(...) L({ "peer", p->peer }, { "transport", p->transport }, ##__VA_ARGS__)
        metrics_family(w, "epd_handoffs", METRIC_COUNTER, NULL,
                       "Handoffs committed, per peer (\"local\": within this host) and transport: out (prepared "
                       "here) and in (from the peer).");
        for (size_t i = 0; (p = handoff_manager_path(hm, i)); i++) {
                metrics_sample_u64(w, PATH_LABELS({ "direction", "out" }), p->handoffs_out);
                metrics_sample_u64(w, PATH_LABELS({ "direction", "in" }), p->handoffs_in);
        }
        metrics_family(w, "epd_handoff_failures", METRIC_COUNTER, NULL, "Handoffs rolled back, per peer and transport.");
        for (size_t i = 0; (p = handoff_manager_path(hm, i)); i++)
                metrics_sample_u64(w, PATH_LABELS(), p->failed);
        metrics_family(w, "epd_handoff_bytes", METRIC_COUNTER, "bytes",
                       "KV bytes of committed handoffs, per peer and transport (0 for zero-copy ones).");
        for (size_t i = 0; (p = handoff_manager_path(hm, i)); i++) {
                metrics_sample_u64(w, PATH_LABELS({ "direction", "out" }), p->bytes_out);
                metrics_sample_u64(w, PATH_LABELS({ "direction", "in" }), p->bytes_in);
        }
        metrics_family(w, "epd_handoff_duration_seconds", METRIC_HISTOGRAM, "seconds",
                       "Prepare to Commit of the handoffs this host prepared, per peer and transport.");
        for (size_t i = 0; (p = handoff_manager_path(hm, i)); i++)
                if (p->handoffs_out > 0)
                        metrics_histogram(w, PATH_LABELS(), histogram_bounds_usec, 1e6, p->duration.counts,
                                          ELEMENTSOF(p->duration.counts), (double)p->duration.sum_usec / 1e6);
#undef PATH_LABELS
        const HandoffCounters *c = &hm->counters;
        metrics_family(w, "epd_handoffs_in_flight", METRIC_GAUGE, NULL, "Handoff sides this daemon holds.");
        metrics_sample_u64(w, METRIC_NO_LABELS, hashmap_size(hm->by_handle));
        metrics_family(w, "epd_handoffs_prepared", METRIC_COUNTER, NULL, "Handoffs prepared.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->prepared);
        metrics_family(w, "epd_handoffs_refused", METRIC_COUNTER, NULL, "Prepares refused by the destination's admission.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->refused);
        metrics_family(w, "epd_handoffs_deferred", METRIC_COUNTER, NULL,
                       "Prepares deferred by the backpressure window of the peer.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->deferred);
        metrics_family(w, "epd_handoff_rollbacks", METRIC_COUNTER, NULL, "Handoffs rolled back, by cause.");
        for (int i = 1; i < _HANDOFF_CAUSE_MAX; i++)
                metrics_sample_u64(w, L({ "cause", handoff_cause_to_string((HandoffCause)i) }), c->failures[i]);
        metrics_family(w, "epd_handoff_groups", METRIC_COUNTER, NULL, "Layer groups handed over.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->groups);
        metrics_family(w, "epd_handoff_zero_copy_groups", METRIC_COUNTER, NULL,
                       "Layer groups handed over without a copy (same arena).");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->zero_copy_groups);
        metrics_family(w, "epd_handoff_merged_groups", METRIC_COUNTER, NULL,
                       "Layer groups moved on the GPU in one batch with others that queued up behind it.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->merged_groups);
        metrics_family(w, "epd_handoff_gpu_slices", METRIC_COUNTER, NULL,
                       "Slices of local GPU batches posted to the copy engine, each planned while the one before copies.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->gpu_slices);
        metrics_family(w, "epd_handoff_journal_waits", METRIC_COUNTER, NULL,
                       "Handoffs whose writes waited for the record that freed their pages to be durable.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->journal_waits);
        metrics_family(w, "epd_handoff_ring_fallbacks", METRIC_COUNTER, NULL,
                       "Notifications sent over D-Bus for want of room on a worker's ring.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->ring_fallbacks);
        metrics_family(w, "epd_handoff_ring_backlogged", METRIC_COUNTER, NULL,
                       "Notifications held back for want of room on a worker's ring, posted once it drained.");
        metrics_sample_u64(w, METRIC_NO_LABELS, handoff_manager_ring_backlogged(hm));
        metrics_family(w, "epd_handoff_rings_lost", METRIC_COUNTER, NULL,
                       "Workers' rings closed because the answer to a submission could not be posted (the worker "
                       "did not take its records) or their completion queue was corrupt.");
        metrics_sample_u64(w, METRIC_NO_LABELS, c->rings_lost);
}

static void collect_features(Manager *m, MetricsWriter *w) {
        if (!m->features)
                return;
        const FeatureStats *s = feature_cache_stats(m->features);
        static const struct {
                const char *name, *help;
                size_t offset;
        } counters[] = {
                { "epd_feature_hits", "Acquires that found the feature ready (in memory or in the store).",
                  offsetof(FeatureStats, hits) },
                { "epd_feature_misses", "Acquires that found nothing.", offsetof(FeatureStats, misses) },
                { "epd_feature_coalesced_waits", "Acquires that waited for a producer already at work.",
                  offsetof(FeatureStats, coalesced_waits) },
                { "epd_feature_produced", "Features published.", offsetof(FeatureStats, produced) },
                { "epd_feature_failed", "Features that failed (producer gone, Fail, announce timeout).",
                  offsetof(FeatureStats, failed) },
                { "epd_feature_evictions", "Features evicted from memory.", offsetof(FeatureStats, evictions) },
                { "epd_feature_spilled", "Features queued for the store at their eviction (written: "
                  "epd_feature_spill_written_total).", offsetof(FeatureStats, spilled) },
                { "epd_feature_loaded", "Features read back from the store.", offsetof(FeatureStats, loaded) },
                { "epd_feature_read_back_timeouts", "Acquires refused while their feature was still being read back.",
                  offsetof(FeatureStats, read_back_timeouts) },
                { "epd_feature_produce_timeouts", "Producers failed for not publishing within [Features] ProduceTimeout=.",
                  offsetof(FeatureStats, produce_timeouts) },
                { "epd_feature_prefetch_requests", "Prefetch requests.", offsetof(FeatureStats, prefetch_requests) },
                { "epd_feature_prefetch_hits",
                  "Prefetches that found the feature ready, or read it back from the store (counted when its bytes land).",
                  offsetof(FeatureStats, prefetch_hits) },
        };
        for (size_t i = 0; i < ELEMENTSOF(counters); i++) {
                metrics_family(w, counters[i].name, METRIC_COUNTER, NULL, counters[i].help);
                metrics_sample_u64(w, METRIC_NO_LABELS, *(const uint64_t *)((const char *)s + counters[i].offset));
        }
        FeatureSpillerStats sp = {};
        FeatureManager *fm = feature_manager_get(m);
        if (fm && fm->spiller)
                feature_spiller_stats(fm->spiller, &sp);
        metrics_family(w, "epd_feature_spill_written", METRIC_COUNTER, NULL, "Evicted features written to the store.");
        metrics_sample_u64(w, METRIC_NO_LABELS, sp.written);
        metrics_family(w, "epd_feature_spill_failed", METRIC_COUNTER, NULL,
                       "Evicted features whose write to the store failed (not kept).");
        metrics_sample_u64(w, METRIC_NO_LABELS, sp.failed);
        metrics_family(w, "epd_feature_spill_dropped", METRIC_COUNTER, NULL,
                       "Evicted features not written to the store: the spill queue was full (its bound is the "
                       "smaller of 256 MiB and CacheSize=) or memory to copy them was short.");
        metrics_sample_u64(w, METRIC_NO_LABELS, sp.dropped);
        metrics_family(w, "epd_feature_spill_pending_bytes", METRIC_GAUGE, "bytes",
                       "Bytes of evicted features queued for the store, not yet written.");
        metrics_sample_u64(w, METRIC_NO_LABELS, sp.pending_bytes);
        metrics_family(w, "epd_feature_encoder_saved_seconds", METRIC_COUNTER, "seconds",
                       "Encoder time the hits saved (the producers' reported encode time, summed over hits).");
        metrics_sample(w, METRIC_NO_LABELS, (double)s->encoder_usec_saved / 1e6);
        metrics_family(w, "epd_feature_cached_bytes", METRIC_GAUGE, "bytes", "Bytes of ready features in memory.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->bytes_cached);
        metrics_family(w, "epd_feature_reserved_bytes", METRIC_GAUGE, "bytes", "Bytes reserved by producers at work.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->bytes_reserved);
        metrics_family(w, "epd_feature_fenced_bytes", METRIC_GAUGE, "bytes",
                       "Bytes free at a restart, held back while workers of before it may still use them.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->bytes_fenced);
        metrics_family(w, "epd_feature_cache_budget_bytes", METRIC_GAUGE, "bytes", "The feature cache's budget.");
        metrics_sample_u64(w, METRIC_NO_LABELS, feature_cache_budget(m->features));
        metrics_family(w, "epd_features", METRIC_GAUGE, NULL, "Features in the cache's key table.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->n_features);
        metrics_family(w, "epd_feature_references", METRIC_GAUGE, NULL, "Live references to features.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->n_refs);
}

static void collect_wal(Manager *m, MetricsWriter *w) {
        /* The writer thread does the log's I/O: its counters, read under its lock. */
        WalManagerStats st;
        if (!m->wal || wal_manager_stats(m, &st) < 0)
                return;
        const WalWriterStats *s = &st.writer;
        metrics_family(w, "epd_wal_appends", METRIC_COUNTER, NULL, "Records appended to the write-ahead log.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->appended);
        metrics_family(w, "epd_wal_appended_bytes", METRIC_COUNTER, "bytes", "Bytes appended to the write-ahead log.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->appended_bytes);
        metrics_family(w, "epd_wal_writes", METRIC_COUNTER, NULL, "Batches of records the WAL's writer thread wrote.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->writes);
        metrics_family(w, "epd_wal_syncs", METRIC_COUNTER, NULL, "fdatasyncs of the write-ahead log (group commits).");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->syncs);
        metrics_family(w, "epd_wal_records_per_sync", METRIC_GAUGE, NULL,
                       "Records each fdatasync made durable, on average since the start (0 before the first).");
        metrics_sample(w, METRIC_NO_LABELS, s->syncs ? (double)s->synced_records / (double)s->syncs : 0);
        metrics_family(w, "epd_wal_max_records_per_sync", METRIC_GAUGE, NULL,
                       "The most records one fdatasync made durable.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->max_batch);
        metrics_family(w, "epd_wal_replies_waiting", METRIC_GAUGE, NULL,
                       "Replies held until their record is durable.");
        metrics_sample_u64(w, METRIC_NO_LABELS, st.replies_waiting);
        metrics_family(w, "epd_wal_failed", METRIC_GAUGE, NULL,
                       "1 once a write or sync of the log failed (no record is accepted after it).");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->error < 0);
        metrics_family(w, "epd_wal_log_size_bytes", METRIC_GAUGE, "bytes", "Size of wal.log now.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->log_bytes);
        metrics_family(w, "epd_wal_compactions", METRIC_COUNTER, NULL, "Compactions of the log into a snapshot.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->compactions);
        metrics_family(w, "epd_wal_compaction_failures", METRIC_COUNTER, NULL,
                       "Compactions that could not write their snapshot (the log went on as it was).");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->compaction_failures);
        metrics_family(w, "epd_wal_full_waits", METRIC_COUNTER, NULL,
                       "Appends that waited for a stalled disk: the pending batch was full (256 MiB).");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->full_waits);
        metrics_family(w, "epd_wal_buffer_bytes", METRIC_GAUGE, "bytes",
                       "Memory of the WAL writer's two batch buffers.");
        metrics_sample_u64(w, METRIC_NO_LABELS, s->buffer_bytes);
}

static void collect_scheduler(Manager *m, MetricsWriter *w) {
        if (!m->scheduler)
                return;
        SchedPoolMetrics pm[_TASK_TYPE_MAX];
        usec_t now = now_usec(CLOCK_MONOTONIC);
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                sched_pool_metrics(m->scheduler, (TaskType)t, now, &pm[t]);
#define POOL(t) L({ "pool", task_type_to_string((TaskType)(t)) })
        metrics_family(w, "epd_scheduler_queue", METRIC_GAUGE, NULL, "Requests outstanding in the pool.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].queue);
        metrics_family(w, "epd_scheduler_queue_peak", METRIC_GAUGE, NULL, "The most requests outstanding at once.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].queue_peak);
        metrics_family(w, "epd_scheduler_rho", METRIC_GAUGE, NULL, "Load: arrival rate over capacity.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample(w, POOL(t), pm[t].rho);
        metrics_family(w, "epd_scheduler_arrival_rate", METRIC_GAUGE, NULL, "Final decisions per second (EWMA).");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample(w, POOL(t), pm[t].arrival_rate);
        metrics_family(w, "epd_scheduler_service_rate", METRIC_GAUGE, NULL, "Completions per second (EWMA).");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample(w, POOL(t), pm[t].service_rate);
        metrics_family(w, "epd_scheduler_capacity", METRIC_GAUGE, NULL,
                       "Requests per second the pool's workers can serve.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample(w, POOL(t), pm[t].capacity);
        metrics_family(w, "epd_scheduler_decisions", METRIC_COUNTER, NULL,
                       "Admission decisions by verdict: admitted, deferred, rejected.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++) {
                const char *pool = task_type_to_string((TaskType)t);
                metrics_sample_u64(w, L({ "pool", pool }, { "verdict", "admitted" }), pm[t].admitted);
                metrics_sample_u64(w, L({ "pool", pool }, { "verdict", "deferred" }), pm[t].deferred);
                metrics_sample_u64(w, L({ "pool", pool }, { "verdict", "rejected" }), pm[t].rejected);
        }
        metrics_family(w, "epd_scheduler_refusals", METRIC_COUNTER, NULL,
                       "Requests deferred or rejected, by reason.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                for (int k = 1; k < _SCHED_REASON_MAX; k++)
                        metrics_sample_u64(w,
                                           L({ "pool", task_type_to_string((TaskType)t) },
                                             { "reason", sched_reason_to_string((SchedReason)k) }),
                                           pm[t].by_reason[k]);
        metrics_family(w, "epd_scheduler_completed", METRIC_COUNTER, NULL, "Requests completed.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].completed);
        metrics_family(w, "epd_scheduler_failed", METRIC_COUNTER, NULL, "Requests that failed.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].failed);
        metrics_family(w, "epd_scheduler_deadline_misses", METRIC_COUNTER, NULL, "Requests done after their deadline.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].deadline_misses);
        metrics_family(w, "epd_scheduler_expired", METRIC_COUNTER, NULL,
                       "Requests dropped: never reported by deadline and grace.");
        for (int t = 0; t < _TASK_TYPE_MAX; t++)
                metrics_sample_u64(w, POOL(t), pm[t].expired);
#undef POOL
}

/* The GPU copy engines (org.epd1.Gpu.CopyCounters): engine "handoff" and "cow"; the
 * families print without samples when the GPU domain is off. */
static void collect_gpu(Manager *m, MetricsWriter *w) {
        const GpuCopyStats *st[2];
        static const char *const engine[2] = { "handoff", "cow" };
        gpu_manager_copy_stats(m, &st[0], &st[1]);
        for (size_t i = 0; i < gpu_copy_counters_n; i++) {
                const GpuCopyCounter *c = &gpu_copy_counters[i];
                if (!c->metric)
                        continue;
                metrics_family(w, c->metric, METRIC_COUNTER, c->unit, c->help);
                for (size_t e = 0; e < ELEMENTSOF(st); e++)
                        if (st[e])
                                metrics_sample_u64(w, L({ "engine", engine[e] }), gpu_copy_counter_value(st[e], c));
        }
}

void metrics_collect(Manager *m, MetricsWriter *w, uint64_t scrapes) {
        collect_daemon(m, w, scrapes);
        collect_arenas(m, w);
        collect_workers(m, w);
        collect_peers(m, w);
        collect_paths(m, w);
        collect_handoffs(m, w);
        collect_features(m, w);
        collect_gpu(m, w);
        collect_wal(m, w);
        collect_scheduler(m, w);
}
