/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* The Prometheus endpoint over libmicrohttpd, driven by epdd's sd-event loop: MHD runs
 * in "external epoll" mode (no thread of its own): the loop watches MHD's epoll fd and
 * calls MHD_run() when it is readable or when MHD's own timeout (idle connections)
 * comes, and the request handler renders the answer right there, on the loop, from the
 * subsystems' counters. MHD_run() never blocks: every socket is non-blocking, a slow
 * scraper only leaves bytes queued. HTTP parsing is MHD's. */
#include <errno.h>
#include <microhttpd.h>
#include <netdb.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <systemd/sd-event.h>
#include <unistd.h>

#include "log.h"
#include "macro.h"
#include "metrics/metrics-manager.h"
#include "metrics/metrics.h"
#include "time-util.h"

#define METRICS_CONNECTIONS_MAX 32
#define METRICS_CONNECTIONS_PER_ADDRESS 8
#define METRICS_IDLE_TIMEOUT_SEC 10
/* A connection must send a whole request within this time of opening (or of its last
 * answer): MHD's idle timeout restarts at every byte, so clients trickling a header line
 * at a time could otherwise hold every slot and lock the scraper out. An idle keep-alive
 * connection is closed by it too; the scraper just reconnects. */
#define METRICS_REQUEST_DEADLINE_USEC (3 * USEC_PER_SEC)
/* And the answer must be sent within this time of the request coming in, for the same
 * reason: a client reading a few bytes every few seconds restarts the idle timeout at
 * each and would hold its slot as long as it likes. The answers to requests sent ahead
 * (pipelined: the next one is in before the last answer is out) count as one, from the
 * first: a client could otherwise send a thousand and read each answer within the
 * bound. The clock starts again once the connection is seen waiting for a request
 * between two (a scraper's keep-alive, a client scraping in a loop). An answer past the
 * bound is aborted (a reset, its unsent bytes dropped); Prometheus gives up on a scrape
 * long before (scrape_timeout, 10 s by default). */
#define METRICS_ANSWER_DEADLINE_USEC (30 * USEC_PER_SEC)

typedef struct MetricsConn {
        struct MHD_Connection *connection;
        usec_t waiting_since;   /* for a whole request; 0: inside a request (headers in, being answered) */
        usec_t answering_since; /* the first request answered since the reaper last saw it wait; 0: none */
        struct MetricsConn *next, *prev;
} MetricsConn;

struct MetricsHttp {
        MetricsServer *server;
        struct MHD_Daemon *mhd;
        sd_event_source *io, *timer, *reaper;
        MetricsConn *conns;
        unsigned n_conns;
        int listen_fd;           /* MHD's: only looked at */
};

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe) {
        MetricsHttp *h = cls;
        MetricsConn *x = *socket_context;
        if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
                x = calloc(1, sizeof *x);
                if (!x)
                        return; /* not watched: the idle timeout still applies */
                x->connection = c;
                x->waiting_since = now_usec(CLOCK_MONOTONIC);
                x->next = h->conns;
                if (h->conns)
                        h->conns->prev = x;
                h->conns = x;
                h->n_conns++;
                *socket_context = x;
        } else if (toe == MHD_CONNECTION_NOTIFY_CLOSED && x) {
                if (x->prev)
                        x->prev->next = x->next;
                else
                        h->conns = x->next;
                if (x->next)
                        x->next->prev = x->prev;
                h->n_conns--;
                free(x);
                *socket_context = NULL;
        }
}

/* A request answered: the connection waits for its next one from now. */
static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls, enum MHD_RequestTerminationCode toe) {
        const union MHD_ConnectionInfo *i = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        MetricsConn *x = i ? i->socket_context : NULL;
        if (x)
                x->waiting_since = now_usec(CLOCK_MONOTONIC);
}

static void pump(MetricsHttp *h);

/* Shuts a connection down (MHD closes it on its next run); `abort`: with a reset, the
 * bytes still queued dropped. */
static void reap(MetricsConn *x, bool abort) {
        const union MHD_ConnectionInfo *i = MHD_get_connection_info(x->connection, MHD_CONNECTION_INFO_CONNECTION_FD);
        if (!i || i->connect_fd < 0)
                return;
        if (abort) {
                struct linger l = { .l_onoff = 1, .l_linger = 0 };
                (void)setsockopt(i->connect_fd, SOL_SOCKET, SO_LINGER, &l, sizeof l);
        }
        (void)shutdown(i->connect_fd, SHUT_RDWR);
}

/* Every second: connections past the deadline without a whole request, or with answers
 * not sent in time, are shut down. The reaper runs on the loop, between two MHD_run():
 * a request already in when the last answer went out (pipelined) is taken in the same
 * run, and the connection is never seen waiting between the two. */
static int on_reaper(sd_event_source *es, uint64_t usec, void *userdata) {
        MetricsHttp *h = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        bool any = false;
        for (MetricsConn *x = h->conns; x; x = x->next)
                if (x->waiting_since) {
                        x->answering_since = 0; /* waits for its next request: the answers' clock starts again */
                        if (now - x->waiting_since > METRICS_REQUEST_DEADLINE_USEC) {
                                reap(x, false);
                                x->waiting_since = 0;
                                h->server->refused++;
                                any = true;
                        }
                } else if (x->answering_since && now - x->answering_since > METRICS_ANSWER_DEADLINE_USEC) {
                        reap(x, true);
                        x->answering_since = 0;
                        h->server->refused++;
                        any = true;
                }
        if (any)
                pump(h);
        (void)sd_event_source_set_time(es, now + USEC_PER_SEC);
        (void)sd_event_source_set_enabled(es, SD_EVENT_ONESHOT);
        return 0;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
        char msg[512];
        vsnprintf(msg, sizeof msg, fmt, ap);
        msg[strcspn(msg, "\n")] = 0;
        log_debug("metrics: %s", msg);
}

static enum MHD_Result answer(struct MHD_Connection *c, unsigned status, const char *type, char *body,
                              size_t len, bool must_free, const char *allow) {
        struct MHD_Response *r = MHD_create_response_from_buffer(len, body,
                                                                 must_free ? MHD_RESPMEM_MUST_FREE
                                                                           : MHD_RESPMEM_PERSISTENT);
        if (!r) {
                if (must_free)
                        free(body);
                return MHD_NO;
        }
        (void)MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
        if (allow)
                (void)MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
        enum MHD_Result ret = MHD_queue_response(c, status, r);
        MHD_destroy_response(r);
        return ret;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url, const char *method,
                                  const char *version, const char *upload_data, size_t *upload_data_size,
                                  void **req_cls) {
        MetricsHttp *h = cls;
        MetricsServer *s = h->server;
        /* The first call comes when the headers are in: answering then ("early", before
         * MHD read the whole request) makes MHD close the connection afterwards. So the
         * first call only marks the request, and the answer goes out on the next one,
         * which keeps the connection open for the scraper's next request (Prometheus
         * reuses it). A body, which no GET has, is read and dropped. */
        static int seen;
        if (!*req_cls) {
                *req_cls = &seen;
                return MHD_YES;
        }
        if (*upload_data_size > 0) {
                *upload_data_size = 0;
                return MHD_YES;
        }
        /* Headers and body are in (the first call came with the headers only): from
         * here the answer goes out, within the answer's deadline. */
        const union MHD_ConnectionInfo *ci = MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
        MetricsConn *x = ci ? ci->socket_context : NULL;
        if (x) {
                x->waiting_since = 0;
                if (!x->answering_since)
                        x->answering_since = now_usec(CLOCK_MONOTONIC);
        }
        static char not_allowed[] = "Only GET and HEAD.\n", not_found[] = "Not found: the metrics are at /metrics.\n",
                    index_text[] = "epdd: Prometheus metrics at /metrics\n";
        const char *text = "text/plain; charset=utf-8";

        if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
                s->refused++;
                return answer(c, MHD_HTTP_METHOD_NOT_ALLOWED, text, not_allowed, strlen(not_allowed), false,
                              "GET, HEAD");
        }
        if (strcmp(url, "/") == 0)
                return answer(c, MHD_HTTP_OK, text, index_text, strlen(index_text), false, NULL);
        if (strcmp(url, "/metrics") != 0) {
                s->refused++;
                return answer(c, MHD_HTTP_NOT_FOUND, text, not_found, strlen(not_found), false, NULL);
        }
        const char *accept = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_ACCEPT);
        MetricsFormat format = metrics_format_from_accept(accept);
        char *body;
        size_t len;
        if (metrics_server_render(s, format, &body, &len) < 0) {
                static char failed[] = "The metrics could not be rendered; see epdd's log.\n";
                return answer(c, MHD_HTTP_INTERNAL_SERVER_ERROR, text, failed, strlen(failed), false, NULL);
        }
        return answer(c, MHD_HTTP_OK, metrics_format_content_type(format), body, len, true, NULL);
}

static void rearm(MetricsHttp *h) {
        MHD_UNSIGNED_LONG_LONG ms;
        if (MHD_get_timeout(h->mhd, &ms) == MHD_YES) {
                (void)sd_event_source_set_time(h->timer, now_usec(CLOCK_MONOTONIC) + ms * USEC_PER_MSEC);
                (void)sd_event_source_set_enabled(h->timer, SD_EVENT_ONESHOT);
        } else
                (void)sd_event_source_set_enabled(h->timer, SD_EVENT_OFF);
}

/* MHD_run(), again while connections wait in the listen backlog and slots are free: MHD
 * accepts a bounded number per run, and the listen socket's readiness (edge-triggered
 * in MHD's epoll) does not come back for the ones left, which then waited for an
 * unrelated event (seconds, behind slots just freed). */
static void pump(MetricsHttp *h) {
        for (unsigned i = 0; i < 8; i++) {
                (void)MHD_run(h->mhd);
                struct pollfd p = { .fd = h->listen_fd, .events = POLLIN };
                if (h->listen_fd < 0 || h->n_conns >= METRICS_CONNECTIONS_MAX || poll(&p, 1, 0) <= 0)
                        break;
        }
        rearm(h);
}

static int on_io(sd_event_source *es, int fd, uint32_t revents, void *userdata) {
        pump(userdata);
        return 0;
}

static int on_timer(sd_event_source *es, uint64_t usec, void *userdata) {
        return on_io(NULL, -1, 0, userdata);
}

/* HOST:PORT ([V6]:PORT) to a bound, listening, non-blocking socket. */
static int listen_on(const char *listen_address, char **ret_url) {
        _cleanup_(freep) char *host = strdup(listen_address);
        if (!host)
                return -ENOMEM;
        char *colon = strrchr(host, ':');
        if (!colon)
                return -EINVAL;
        *colon = 0;
        const char *port = colon + 1, *node = host;
        if (host[0] == '[') {
                size_t n = strlen(host);
                if (n < 2 || host[n - 1] != ']')
                        return -EINVAL;
                host[n - 1] = 0;
                node = host + 1;
        }
        struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                                  .ai_flags = AI_PASSIVE | AI_NUMERICSERV }, *ai = NULL;
        int r = getaddrinfo(node, port, &hints, &ai);
        if (r != 0) {
                log_error("[Metrics] Listen=%s: %s", listen_address, gai_strerror(r));
                return -EADDRNOTAVAIL;
        }
        int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
                r = -errno;
                freeaddrinfo(ai);
                return log_error_errno(r, "[Metrics] Listen=%s: socket(): %m", listen_address);
        }
        int one = 1;
        (void)setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, 16) < 0) {
                r = -errno;
                freeaddrinfo(ai);
                safe_close(fd);
                return log_error_errno(r, "Cannot serve metrics on %s: %m", listen_address);
        }
        freeaddrinfo(ai);
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        char h[NI_MAXHOST], p[NI_MAXSERV];
        if (getsockname(fd, (struct sockaddr *)&sa, &len) < 0 ||
            getnameinfo((struct sockaddr *)&sa, len, h, sizeof h, p, sizeof p, NI_NUMERICHOST | NI_NUMERICSERV) != 0 ||
            asprintf(ret_url, sa.ss_family == AF_INET6 ? "http://[%s]:%s/metrics" : "http://%s:%s/metrics", h, p) < 0) {
                safe_close(fd);
                return -ENOMEM;
        }
        return fd;
}

int metrics_http_start(MetricsServer *s, const char *listen_address, MetricsHttp **ret, char **ret_url) {
        _cleanup_(freep) char *url = NULL;
        int fd = listen_on(listen_address, &url);
        if (fd < 0)
                return fd == -ENOMEM ? log_oom() : fd;
        MetricsHttp *h = calloc(1, sizeof *h);
        if (!h) {
                safe_close(fd);
                return log_oom();
        }
        h->server = s;
        h->listen_fd = fd;
        /* MHD owns the socket from here (and closes it at stop). */
        h->mhd = MHD_start_daemon(MHD_USE_EPOLL | MHD_USE_ERROR_LOG, 0, NULL, NULL, on_request, h,
                                  MHD_OPTION_LISTEN_SOCKET, (MHD_socket)fd,
                                  MHD_OPTION_CONNECTION_LIMIT, (unsigned)METRICS_CONNECTIONS_MAX,
                                  MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)METRICS_CONNECTIONS_PER_ADDRESS,
                                  MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)METRICS_IDLE_TIMEOUT_SEC,
                                  MHD_OPTION_NOTIFY_CONNECTION, on_connection, h,
                                  MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
                                  MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                                  MHD_OPTION_END);
        if (!h->mhd) {
                safe_close(fd);
                free(h);
                log_error("Cannot start the metrics HTTP server on %s (libmicrohttpd refused).", listen_address);
                return -EIO;
        }
        const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_EPOLL_FD);
        int r = info ? 0 : -EIO;
        if (r >= 0)
                r = sd_event_add_io(s->manager->event, &h->io, info->epoll_fd, EPOLLIN, on_io, h);
        if (r >= 0)
                r = sd_event_add_time(s->manager->event, &h->timer, CLOCK_MONOTONIC, USEC_INFINITY, 0, on_timer, h);
        if (r >= 0)
                r = sd_event_add_time_relative(s->manager->event, &h->reaper, CLOCK_MONOTONIC, USEC_PER_SEC, 0,
                                               on_reaper, h);
        if (r < 0) {
                metrics_http_stop(h);
                return log_error_errno(r, "Cannot watch the metrics server: %m");
        }
        (void)sd_event_source_set_description(h->io, "metrics-http");
        rearm(h);
        *ret = h;
        *ret_url = TAKE_PTR(url);
        return 0;
}

MetricsHttp *metrics_http_stop(MetricsHttp *h) {
        if (!h)
                return NULL;
        h->io = sd_event_source_disable_unref(h->io);
        h->timer = sd_event_source_disable_unref(h->timer);
        h->reaper = sd_event_source_disable_unref(h->reaper);
        if (h->mhd)
                MHD_stop_daemon(h->mhd); /* closes every connection: on_connection frees them */
        while (h->conns) { /* none normally */
                MetricsConn *x = h->conns;
                h->conns = x->next;
                free(x);
        }
        free(h);
        return NULL;
}
