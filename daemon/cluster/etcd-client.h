/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* HTTP to etcd's v3 JSON gateway with libcurl (one easy handle per client, so one
 * client per thread). Every call blocks: only the cluster manager's threads use it,
 * never the event loop. A call goes to the endpoint that answered last and moves on to
 * the next one when it cannot be reached. Calls end early when *stop becomes true. */

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "time-util.h"

typedef struct EtcdClient EtcdClient;

typedef struct EtcdTls {
        const char *ca_file;   /* verify etcd's certificate against this CA */
        const char *cert_file; /* client certificate and key, where etcd asks for one */
        const char *key_file;
} EtcdTls;

/* libcurl's global setup: once, from the main thread, before any client. */
int etcd_global_init(void);

int etcd_client_new(EtcdClient **ret, char *const *endpoints, const EtcdTls *tls, const atomic_bool *stop);
EtcdClient *etcd_client_free(EtcdClient *c);
/* A client of `like`'s endpoint i alone, with its TLS files and stop flag. */
int etcd_client_new_one(EtcdClient **ret, EtcdClient *like, size_t endpoint);

/* POST body to path (e.g. "/v3/kv/put"); the answer's body in *ret (malloc'ed,
 * NUL-terminated). -EHOSTUNREACH when no endpoint answered (err says why), -EIO for an
 * HTTP error status (where etcd refused the request, 4xx, its answer is in *ret all the
 * same: its error code), -EMSGSIZE for an answer past 16 MiB, -ECANCELED when stopped. */
int etcd_client_call(EtcdClient *c, const char *path, const char *body, long timeout_ms, char **ret,
                     size_t *ret_len, char *err, size_t err_size);
/* The same, each endpoint given attempt_ms (<= 0: the time left) and the whole call
 * total_ms (> 0): no attempt begins or lasts past it (-ETIMEDOUT when the call's time
 * ran out before an endpoint answered). What a lease's keepalive needs: the next
 * endpoint asked while the lease still lives. */
int etcd_client_call_within(EtcdClient *c, const char *path, const char *body, long attempt_ms, long total_ms,
                            char **ret, size_t *ret_len, char *err, size_t err_size);

/* A streaming POST (the watch): fn gets every newline-separated message as it arrives;
 * returns when the stream ends (-ECONNRESET), stops, or fn returns a negative errno
 * (returned). -EHOSTUNREACH when no endpoint could be reached. */
typedef int (*EtcdStreamFn)(void *userdata, const char *msg, size_t len);
int etcd_client_stream(EtcdClient *c, const char *path, const char *body, EtcdStreamFn fn, void *userdata,
                       char *err, size_t err_size);

/* Wakes a call in progress so that it sees *stop (thread-safe). */
void etcd_client_wakeup(EtcdClient *c);

/* From another thread (another client found endpoint i hung: connected, nothing
 * answered): an attempt on it begun before begun_before (CLOCK_MONOTONIC) ends at once,
 * its call returning -ETIMEDOUT ("stopped answering") with the next endpoint as the
 * current one. A watch stream open on a hung member stays open and silent (the kernel
 * still acknowledges) until this. Attempts begun after are not affected; requests for
 * different endpoints do not replace each other. */
void etcd_client_abandon(EtcdClient *c, size_t endpoint, usec_t begun_before);

/* The last call's first endpoint that let a whole attempt pass without an answer (one
 * cut short by the call's time does not count), or that etcd_client_abandon() ended,
 * or -1; *ret_attempt_ms: the time that attempt had. */
ssize_t etcd_client_hung(EtcdClient *c, long *ret_attempt_ms);
const char *etcd_client_endpoint_at(EtcdClient *c, size_t i);
/* The endpoint of the attempt in progress (a watch's stream, say), or -1 (thread-safe). */
ssize_t etcd_client_busy(EtcdClient *c);
/* Whether that attempt was abandoned (etcd_client_abandon()) and is ending: true from the
 * abandon until its thread has seen it, a poll later (thread-safe). */
bool etcd_client_busy_ending(EtcdClient *c);
/* The index of etcd_client_endpoint(). */
size_t etcd_client_current(EtcdClient *c);

/* The endpoint in use (the last that answered). */
const char *etcd_client_endpoint(EtcdClient *c);
