/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The local transport: moves bytes between host regions of this daemon with memcpy on
 * a small pool of worker threads, which post completions to an eventfd that the event
 * loop watches (completion_fd). Writes within one region are memmove()d, and a write
 * onto itself (same region, same offset) completes without touching a byte: the
 * handoff code hands pages of one arena over by reference and posts no write at all.
 * GPU regions are refused (-EOPNOTSUPP): they take the CUDA transport. A batch of at
 * most 64 writes and 64 KiB in all is copied by post() itself, on the caller's thread
 * (a thread's wake-up costs more than such a copy); its completions still come through
 * completion_fd and poll(). */

#include "transport/transport.h"

#define LOCAL_TRANSPORT_REGIONS_MAX 64U
#define LOCAL_TRANSPORT_THREADS_MAX 16U

/* n_threads 0: one per CPU, at most 4. */
int local_transport_new(unsigned n_threads, Transport **ret);
/* Writes queued or running, not yet returned by poll(). */
uint64_t local_transport_inflight(Transport *t);
