/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The BPF side of telemetry behind a small interface: load and attach the programs,
 * pin the maps, mark sockets as tracked, read connection records, drain the ring.
 * telemetry-bpf.c implements it with libbpf (linked statically); when epd is built
 * without BPF, telemetry-bpf-none.c answers -EOPNOTSUPP and says why. */

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "bpf/epd-telemetry.h"
#include "macro.h"

typedef struct TelemetryBpf TelemetryBpf;

typedef int (*TelemetryBpfEventFn)(void *userdata, const void *data, size_t size);

/* Loads and attaches. pin_dir NULL: no pins. On failure returns a negative errno and,
 * in *ret_why (caller frees), why in words (no BTF, not privileged, ...). */
int telemetry_bpf_open(TelemetryBpf **ret, const char *pin_dir, uint64_t sample_interval_nsec,
                       uint32_t wakeup_bytes, TelemetryBpfEventFn fn, void *userdata,
                       char **ret_why);
/* Detaches and removes the pins it made. */
TelemetryBpf *telemetry_bpf_free(TelemetryBpf *b);
DEFINE_TRIVIAL_CLEANUP_FUNC(TelemetryBpf *, telemetry_bpf_free);

/* Where the maps are pinned, or NULL. */
const char *telemetry_bpf_pin_dir(TelemetryBpf *b);
/* An fd that polls readable when ring records are ready (an epoll fd). */
int telemetry_bpf_ring_fd(TelemetryBpf *b);
/* Drains the ring, calling fn for each record. Returns the number consumed. */
int telemetry_bpf_consume(TelemetryBpf *b);

int telemetry_bpf_track(TelemetryBpf *b, uint64_t cookie, uint32_t peer_id, const char *peer);
int telemetry_bpf_untrack(TelemetryBpf *b, uint64_t cookie);
/* Deletes the per-connection records of sockets keep() says are not tracked; returns how
 * many. */
int telemetry_bpf_prune(TelemetryBpf *b, bool (*keep)(void *userdata, uint64_t cookie), void *userdata);
/* -ENOENT when the kernel has seen nothing of the connection yet. */
int telemetry_bpf_conn_stats(TelemetryBpf *b, uint64_t cookie, struct epd_conn_stats *ret);
/* Time spent in the programs and how often they ran, summed over all of them; only
 * counted while BPF run-time statistics are enabled (kernel.bpf_stats_enabled=1 or
 * telemetry_bpf_enable_stats()). */
int telemetry_bpf_prog_stats(TelemetryBpf *b, uint64_t *ret_run_nsec, uint64_t *ret_runs);
/* Enables run-time statistics while the returned fd is open (for benchmarks). */
int telemetry_bpf_enable_stats(void);
/* Sums the per-CPU counters (enum epd_counter). */
int telemetry_bpf_counters(TelemetryBpf *b, uint64_t ret[_EPD_COUNTER_MAX]);
