/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "cluster/etcd-client.h"

#include <curl/curl.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "macro.h"
#include "time-util.h"

#define STREAM_LINE_MAX (4U << 20)
/* A range read goes in pages (ETCD_RANGE_PAGE_KEYS, etcd-json.h) that fit this with room. */
#define ANSWER_MAX (16U << 20)
/* Past Linux's first SYN retransmission (1 s): one lost SYN is not a failed connect. */
#define CONNECT_TIMEOUT_MS 1500L
/* Less than this short of a whole attempt is a whole attempt (below). */
#define ATTEMPT_SLACK_MS 5L

struct EtcdClient {
        CURL *curl;
        CURLM *multi;          /* drives curl, so that etcd_client_wakeup() can interrupt a wait */
        char **endpoints;
        size_t n_endpoints;
        size_t current;
        const atomic_bool *stop;
        EtcdTls tls;
        /* The attempt in progress: its endpoint and when it began (CLOCK_MONOTONIC; other
         * threads read the start, etcd_client_busy_ending()). */
        size_t attempt;
        _Atomic usec_t attempt_start;
        /* etcd_client_abandon(), from another thread: per endpoint, its attempts begun
         * before this time (CLOCK_MONOTONIC; 0: none) are to end now. */
        _Atomic usec_t *abandon_before;
        bool abandoned;        /* the last attempt ended by it */
        _Atomic ssize_t busy;  /* the endpoint of the attempt in progress, or -1 (other threads read it) */
        ssize_t hung;          /* the last call: the first endpoint that took a whole attempt, or -1 */
        long hung_ms;          /* the attempt it was given */
};

typedef struct Buffer {
        char *data;
        size_t len, cap, max;
        /* streaming */
        EtcdStreamFn fn;
        void *userdata;
        int error;
        bool got_data;
        bool refused; /* the answer was etcd's refusal of the request (4xx): its body says why */
        CURL *curl; /* set by setup(): a stream's lines go to fn only from a 200 answer */
} Buffer;

int etcd_global_init(void) {
        return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 0 : -EIO;
}

EtcdClient *etcd_client_free(EtcdClient *c) {
        if (!c)
                return NULL;
        if (c->curl)
                curl_easy_cleanup(c->curl);
        if (c->multi)
                curl_multi_cleanup(c->multi);
        for (size_t i = 0; i < c->n_endpoints; i++)
                free(c->endpoints[i]);
        free(c->endpoints);
        free(c->abandon_before);
        free(c);
        return NULL;
}

int etcd_client_new(EtcdClient **ret, char *const *endpoints, const EtcdTls *tls, const atomic_bool *stop) {
        EtcdClient *c;
        size_t n = 0;

        while (endpoints && endpoints[n])
                n++;
        if (!ret || n == 0 || !stop)
                return -EINVAL;
        c = calloc(1, sizeof *c);
        if (!c)
                return -ENOMEM;
        c->stop = stop;
        c->busy = -1;
        if (tls)
                c->tls = *tls;
        c->endpoints = calloc(n, sizeof *c->endpoints);
        c->abandon_before = calloc(n, sizeof *c->abandon_before);
        c->curl = curl_easy_init();
        c->multi = curl_multi_init();
        if (!c->endpoints || !c->abandon_before || !c->curl || !c->multi) {
                etcd_client_free(c);
                return -ENOMEM;
        }
        for (size_t i = 0; i < n; i++) {
                c->endpoints[i] = strdup(endpoints[i]);
                if (!c->endpoints[i]) {
                        etcd_client_free(c);
                        return -ENOMEM;
                }
                c->n_endpoints++;
        }
        *ret = c;
        return 0;
}

int etcd_client_new_one(EtcdClient **ret, EtcdClient *like, size_t endpoint) {
        char *one[] = { NULL, NULL };

        if (!like || endpoint >= like->n_endpoints)
                return -EINVAL;
        one[0] = like->endpoints[endpoint];
        return etcd_client_new(ret, one, &like->tls, like->stop);
}

const char *etcd_client_endpoint(EtcdClient *c) {
        return c->endpoints[c->current];
}

static int buffer_add(Buffer *b, const char *p, size_t n) {
        if (b->len + n + 1 > b->max)
                return -EMSGSIZE;
        if (b->len + n + 1 > b->cap) {
                size_t cap = MAX(b->cap * 2, b->len + n + 1);
                char *d = realloc(b->data, MAX(cap, (size_t)4096));
                if (!d)
                        return -ENOMEM;
                b->data = d;
                b->cap = MAX(cap, (size_t)4096);
        }
        memcpy(b->data + b->len, p, n);
        b->len += n;
        b->data[b->len] = 0;
        return 0;
}

static size_t write_cb(char *p, size_t size, size_t nmemb, void *userdata) {
        Buffer *b = userdata;
        size_t n = size * nmemb;

        b->got_data = true;
        b->error = buffer_add(b, p, n);
        if (b->error < 0)
                return 0; /* aborts the transfer */
        if (!b->fn)
                return n;
        long status = 0;
        curl_easy_getinfo(b->curl, CURLINFO_RESPONSE_CODE, &status);
        if (status != 200)
                return n; /* an error's body: kept for the message, not a stream's event */
        /* Streaming: hand out every complete line. */
        for (;;) {
                char *nl = memchr(b->data, '\n', b->len);
                size_t k;
                if (!nl)
                        break;
                k = (size_t)(nl - b->data);
                if (k > 0) {
                        b->error = b->fn(b->userdata, b->data, k);
                        if (b->error < 0)
                                return 0;
                }
                memmove(b->data, nl + 1, b->len - k - 1);
                b->len -= k + 1;
                b->data[b->len] = 0;
        }
        return n;
}

/* Whether the attempt in progress is to end: stopping, or its endpoint abandoned since
 * it began (an attempt begun after the abandon is that endpoint's next chance). */
static bool attempt_ends(EtcdClient *c) {
        if (atomic_load(c->stop))
                return true;
        if (atomic_load(&c->abandon_before[c->attempt]) > atomic_load(&c->attempt_start)) {
                c->abandoned = true;
                return true;
        }
        return false;
}

static int progress_cb(void *userdata, curl_off_t dltotal, curl_off_t dlnow, curl_off_t ultotal,
                       curl_off_t ulnow) {
        return attempt_ends(userdata) ? 1 : 0;
}

void etcd_client_wakeup(EtcdClient *c) {
        if (c && c->multi)
                (void)curl_multi_wakeup(c->multi);
}

void etcd_client_abandon(EtcdClient *c, size_t endpoint, usec_t begun_before) {
        if (!c || endpoint >= c->n_endpoints)
                return;
        usec_t old = atomic_load(&c->abandon_before[endpoint]);
        while (old < begun_before && !atomic_compare_exchange_weak(&c->abandon_before[endpoint], &old, begun_before))
                ;
        etcd_client_wakeup(c);
}

ssize_t etcd_client_hung(EtcdClient *c, long *ret_attempt_ms) {
        if (ret_attempt_ms)
                *ret_attempt_ms = c->hung >= 0 ? c->hung_ms : 0;
        return c->hung;
}

ssize_t etcd_client_busy(EtcdClient *c) {
        return c ? atomic_load(&c->busy) : -1;
}

bool etcd_client_busy_ending(EtcdClient *c) {
        ssize_t w = c ? atomic_load(&c->busy) : -1;
        /* Read after busy: an attempt begun in between is newer, and not said ending. */
        return w >= 0 && (size_t)w < c->n_endpoints &&
               atomic_load(&c->abandon_before[w]) > atomic_load(&c->attempt_start);
}

size_t etcd_client_current(EtcdClient *c) {
        return c->current;
}

const char *etcd_client_endpoint_at(EtcdClient *c, size_t i) {
        return i < c->n_endpoints ? c->endpoints[i] : "";
}

/* curl_easy_perform(), through the multi handle: a stop is seen at once (wakeup), not
 * at the next progress callback. */
static CURLcode run(EtcdClient *c) {
        CURLcode result = CURLE_OK;
        CURLMsg *msg;
        int running = 1, left;

        if (curl_multi_add_handle(c->multi, c->curl) != CURLM_OK)
                return CURLE_OUT_OF_MEMORY;
        while (running) {
                if (curl_multi_perform(c->multi, &running) != CURLM_OK) {
                        result = CURLE_RECV_ERROR;
                        break;
                }
                if (!running)
                        break;
                if (attempt_ends(c)) {
                        result = CURLE_ABORTED_BY_CALLBACK;
                        break;
                }
                if (curl_multi_poll(c->multi, NULL, 0, 1000, NULL) != CURLM_OK) {
                        result = CURLE_RECV_ERROR;
                        break;
                }
        }
        while ((msg = curl_multi_info_read(c->multi, &left)))
                if (msg->msg == CURLMSG_DONE && msg->easy_handle == c->curl)
                        result = msg->data.result;
        curl_multi_remove_handle(c->multi, c->curl);
        return result;
}

static void setup(EtcdClient *c, const char *url, const char *body, Buffer *b, long timeout_ms,
                  struct curl_slist *headers) {
        CURL *h = c->curl;

        curl_easy_reset(h);
        b->curl = h;
        curl_easy_setopt(h, CURLOPT_URL, url);
        curl_easy_setopt(h, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(h, CURLOPT_HTTPHEADER, headers);
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, write_cb);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, b);
        curl_easy_setopt(h, CURLOPT_NOPROGRESS, 0L);
        curl_easy_setopt(h, CURLOPT_XFERINFOFUNCTION, progress_cb);
        curl_easy_setopt(h, CURLOPT_XFERINFODATA, c);
        curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
        curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, CONNECT_TIMEOUT_MS);
        curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
        curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
        curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
        /* A dead etcd ends a quiet watch within a few seconds. */
        curl_easy_setopt(h, CURLOPT_TCP_KEEPALIVE, 1L);
        curl_easy_setopt(h, CURLOPT_TCP_KEEPIDLE, 1L);
        curl_easy_setopt(h, CURLOPT_TCP_KEEPINTVL, 1L);
        if (c->tls.ca_file)
                curl_easy_setopt(h, CURLOPT_CAINFO, c->tls.ca_file);
        if (c->tls.cert_file)
                curl_easy_setopt(h, CURLOPT_SSLCERT, c->tls.cert_file);
        if (c->tls.key_file)
                curl_easy_setopt(h, CURLOPT_SSLKEY, c->tls.key_file);
}

/* One request, trying each endpoint once starting with the current one: the next is
 * tried when one cannot be reached, does not answer within timeout_ms (0: no limit, a
 * stream), or answers 5xx or 429; the first that answers otherwise becomes the current
 * one. No attempt begins or lasts past `deadline` (CLOCK_MONOTONIC; 0: none): -ETIMEDOUT
 * then. An attempt ended by etcd_client_abandon() ends the call (-ETIMEDOUT) with the
 * next endpoint as the current one. After all failed, err tells an answer's status
 * (-EIO) over an endpoint that could not be reached. */
static int perform(EtcdClient *c, const char *path, const char *body, long timeout_ms, usec_t deadline, Buffer *b,
                   char *err, size_t err_size) {
        struct curl_slist *headers = curl_slist_append(NULL, "Content-Type: application/json");
        int r = -EHOSTUNREACH;

        c->hung = -1;

        if (!headers)
                return -ENOMEM;
        if (b->fn) {
                /* A watch only on a member that has a leader: a member cut off from the
                 * others cancels it ("no leader") rather than keeping it open and silent,
                 * and the watch thread resyncs through another endpoint. */
                struct curl_slist *more = curl_slist_append(headers, "Grpc-Metadata-hasleader: true");
                if (!more) {
                        curl_slist_free_all(headers);
                        return -ENOMEM;
                }
                headers = more;
        }
        for (size_t k = 0; k < c->n_endpoints; k++) {
                size_t i = (c->current + k) % c->n_endpoints;
                char url[512];
                CURLcode cc;
                long status = 0;

                if (atomic_load(c->stop)) {
                        r = -ECANCELED;
                        break;
                }
                long attempt_ms = timeout_ms;
                bool whole = true; /* the attempt gets all of timeout_ms */
                usec_t now = now_usec(CLOCK_MONOTONIC);
                if (deadline) {
                        if (now + 1000 > deadline) {
                                /* The endpoints before took the time: their error stays
                                 * the one said (this one was not asked). */
                                if (err && err_size && (k == 0 || !err[0]))
                                        snprintf(err, err_size, "%s: not asked, the call's time was spent%s",
                                                 c->endpoints[i], k == 0 ? "" : " on the endpoints before");
                                r = -ETIMEDOUT;
                                break;
                        }
                        long left = (long)((deadline - now) / 1000);
                        /* 0 is no timeout at all to libcurl: the time left, then. A
                         * call given as long as one attempt is one whole attempt (the
                         * microseconds since it began are not a cut). */
                        whole = timeout_ms > 0 && left + ATTEMPT_SLACK_MS >= timeout_ms;
                        attempt_ms = whole ? timeout_ms : left;
                }
                c->attempt = i;
                atomic_store(&c->attempt_start, now); /* before busy: see etcd_client_busy_ending() */
                c->abandoned = false;
                atomic_store(&c->busy, (ssize_t)i);
                snprintf(url, sizeof url, "%s%s", c->endpoints[i], path);
                b->len = 0;
                if (b->data)
                        b->data[0] = 0; /* no earlier endpoint's body in this one's message */
                b->error = 0;
                b->got_data = false;
                b->refused = false;
                setup(c, url, body, b, attempt_ms, headers);
                cc = run(c);
                atomic_store(&c->busy, -1);
                curl_easy_getinfo(c->curl, CURLINFO_RESPONSE_CODE, &status);
                if (b->error < 0) {
                        r = b->error;
                        c->current = i;
                        break;
                }
                if (cc == CURLE_ABORTED_BY_CALLBACK && c->abandoned) {
                        /* Another thread found this endpoint hung: the next one is
                         * the current one now; the caller starts over with it. */
                        c->hung = (ssize_t)i;
                        c->hung_ms = attempt_ms;
                        c->current = (i + 1) % c->n_endpoints;
                        if (err && err_size)
                                snprintf(err, err_size, "%s: stopped answering", c->endpoints[i]);
                        r = -ETIMEDOUT;
                        break;
                }
                if (cc == CURLE_ABORTED_BY_CALLBACK) {
                        r = -ECANCELED;
                        break;
                }
                if (cc == CURLE_OPERATION_TIMEDOUT && status == 0) {
                        long took_ms = (long)((now_usec(CLOCK_MONOTONIC) - now) / 1000);
                        if (whole && c->hung < 0 && took_ms + ATTEMPT_SLACK_MS >= attempt_ms) {
                                /* Connected or not, nothing came back in the whole
                                 * attempt (one cut short by the call's time says
                                 * nothing of the endpoint, nor does a connect that
                                 * timed out sooner: that endpoint is down, not hung). */
                                c->hung = (ssize_t)i;
                                c->hung_ms = attempt_ms;
                        } else if (!whole)
                                r = -ETIMEDOUT; /* the call's time ran out on it */
                }
                if (status >= 500 || status == 429) {
                        /* It answered, but cannot serve (no leader, a learner, a gateway
                         * that cannot reach its own member, overloaded): another
                         * endpoint may. */
                        if (err && err_size)
                                snprintf(err, err_size, "%s: HTTP %ld: %.200s", c->endpoints[i], status,
                                         b->data ?: "");
                        r = -EIO;
                        continue;
                }
                if (status != 0) {
                        /* It answered: this endpoint is the one to keep using. */
                        c->current = i;
                        if (status != 200) {
                                b->refused = true;
                                if (err && err_size)
                                        snprintf(err, err_size, "%s: HTTP %ld: %.200s", c->endpoints[i], status,
                                                 b->data ?: "");
                                r = -EIO;
                        } else if (cc != CURLE_OK) {
                                if (err && err_size)
                                        snprintf(err, err_size, "%s: %s", c->endpoints[i], curl_easy_strerror(cc));
                                r = b->fn ? -ECONNRESET : -EIO;
                        } else {
                                /* An earlier endpoint's failure is not this call's. */
                                if (err && err_size)
                                        err[0] = 0;
                                r = b->fn ? -ECONNRESET : 0; /* a stream that ended */
                        }
                        break;
                }
                if (r != -EIO && err && err_size)
                        snprintf(err, err_size, "%s: %s", c->endpoints[i], curl_easy_strerror(cc));
        }
        curl_slist_free_all(headers);
        return r;
}

int etcd_client_call_within(EtcdClient *c, const char *path, const char *body, long attempt_ms, long total_ms,
                            char **ret, size_t *ret_len, char *err, size_t err_size) {
        Buffer b = { .max = ANSWER_MAX };
        int r;

        if (err && err_size)
                err[0] = 0;
        r = perform(c, path, body, attempt_ms,
                    total_ms > 0 ? now_usec(CLOCK_MONOTONIC) + (usec_t)total_ms * USEC_PER_MSEC : 0, &b, err,
                    err_size);
        if (r == -EIO && b.refused && b.data) {
                /* etcd's error answer, for the caller to tell its code (a compacted
                 * revision is read again, anything else is a failure). */
                *ret = b.data;
                if (ret_len)
                        *ret_len = b.len;
                return r;
        }
        if (r < 0 || !b.data) {
                free(b.data);
                return r < 0 ? r : -EBADMSG;
        }
        *ret = b.data;
        if (ret_len)
                *ret_len = b.len;
        return 0;
}

int etcd_client_call(EtcdClient *c, const char *path, const char *body, long timeout_ms, char **ret,
                     size_t *ret_len, char *err, size_t err_size) {
        return etcd_client_call_within(c, path, body, timeout_ms, 0, ret, ret_len, err, err_size);
}

int etcd_client_stream(EtcdClient *c, const char *path, const char *body, EtcdStreamFn fn, void *userdata,
                       char *err, size_t err_size) {
        Buffer b = { .max = STREAM_LINE_MAX, .fn = fn, .userdata = userdata };
        int r;

        if (err && err_size)
                err[0] = 0;
        /* No overall timeout: a watch lasts as long as etcd serves it. */
        r = perform(c, path, body, 0, 0, &b, err, err_size);
        free(b.data);
        return r;
}
