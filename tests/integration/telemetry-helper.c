/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Drives the telemetry subsystem over a real TCP connection, for the integration tests
 * (test-telemetry-netns.sh) until the peer subsystem's connections are on main:
 *
 *   telemetry-helper sink PORT
 *        accepts connections and discards what they send
 *   telemetry-helper send ADDR PORT [--seconds N] [--rate BYTES_PER_SEC] [--peer NAME]
 *                              [--set Section.Key=Value]...
 *        connects, tracks the socket with telemetry_track_socket(), sends for N seconds
 *        (rate 0: as fast as the path takes it) inside an sd-event loop, and prints one
 *        JSON object per line: "sample" every 250 ms, "signal" on every backpressure
 *        change (what the Backpressure D-Bus signal carries), and a final "summary".
 *        With --daemon ADDR, the socket is handed to a running epdd instead
 *        (org.epd1.Telemetry.TrackSocket) and "signal" lines are the daemon's
 *        Backpressure D-Bus signals, received through libepd.
 * Exit status 77 when kernel telemetry cannot load here (the reason is printed). */

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "epd-internal.h"
#include "epd/epd-telemetry.h"
#include "log.h"
#include "core/manager.h"
#include "telemetry/telemetry-manager.h"

typedef struct Sender {
        Manager m;
        int fd;
        sd_event_source *io, *tick, *report, *stop;
        uint64_t rate;      /* bytes/s, 0: unlimited */
        double tokens;
        usec_t last_tick;
        uint64_t written;
        unsigned n_signals;
        BackpressureLevel max_level;
        BackpressureReason max_reason;
        const char *peer;
        epd_client *daemon;
        usec_t start;
        char buf[256 * 1024];
} Sender;

static void print_daemon_summary(Sender *s) {
        printf("{\"type\":\"summary\",\"daemon\":true,\"peer\":\"%s\",\"written\":%llu,\"signals\":%u,"
               "\"max_level\":\"%s\",\"max_reason\":\"%s\"}\n",
               s->peer, (unsigned long long)s->written, s->n_signals, backpressure_level_to_string(s->max_level),
               backpressure_reason_to_string(s->max_reason));
        fflush(stdout);
}

static void on_daemon_backpressure(epd_client *c, const char *peer, unsigned level, const char *reason,
                                   void *userdata) {
        Sender *s = userdata;
        s->n_signals++;
        if (level > (unsigned)s->max_level && level < _BACKPRESSURE_LEVEL_MAX) {
                s->max_level = (BackpressureLevel)level;
                for (int i = 0; i < _BACKPRESSURE_REASON_MAX; i++)
                        if (strcmp(reason, backpressure_reason_to_string(i)) == 0)
                                s->max_reason = (BackpressureReason)i;
        }
        printf("{\"type\":\"signal\",\"source\":\"dbus\",\"t_ms\":%llu,\"peer\":\"%s\",\"level\":\"%s\","
               "\"reason\":\"%s\"}\n",
               (unsigned long long)((now_usec(CLOCK_MONOTONIC) - s->start) / 1000), peer,
               level < _BACKPRESSURE_LEVEL_MAX ? backpressure_level_to_string(level) : "?", reason);
        fflush(stdout);
}

static void print_stats(Sender *s, const char *what) {
        TelemetryPeerStats p;
        TelemetryCounters c;
        if (s->daemon)
                return;
        telemetry_get_counters(s->m.telemetry, &c);
        if (telemetry_peer_stats(&s->m, s->peer, &p) < 0)
                return;
        printf("{\"type\":\"%s\",\"t_ms\":%llu,\"peer\":\"%s\",\"kernel\":%s,\"conns\":%u,"
               "\"srtt_us\":%u,\"min_rtt_us\":%u,\"cwnd\":%u,\"bytes_sent\":%llu,\"bytes_acked\":%llu,"
               "\"retransmits\":%llu,\"segs_out\":%llu,\"send_queue\":%llu,\"inflight\":%llu,"
               "\"level\":\"%s\",\"reason\":\"%s\",\"rtt_inflation\":%.3f,\"retransmit_rate\":%.4f,"
               "\"written\":%llu,\"ring_events\":%llu,\"ring_wakeups\":%llu,\"kernel_events\":%llu,"
               "\"kernel_dropped\":%llu,\"signals\":%u,\"max_level\":\"%s\",\"max_reason\":\"%s\"}\n",
               what, (unsigned long long)((now_usec(CLOCK_MONOTONIC) - s->start) / 1000), p.name,
               p.kernel ? "true" : "false", p.path.n_conns, p.path.srtt_usec, p.path.min_rtt_usec,
               p.path.cwnd, (unsigned long long)p.path.bytes_sent, (unsigned long long)p.path.bytes_acked,
               (unsigned long long)p.path.retransmits, (unsigned long long)p.path.segs_out,
               (unsigned long long)p.path.send_queue, (unsigned long long)p.path.inflight,
               backpressure_level_to_string(p.level), backpressure_reason_to_string(p.reason),
               p.rtt_inflation, p.retransmit_rate, (unsigned long long)s->written,
               (unsigned long long)c.ring_events, (unsigned long long)c.ring_wakeups,
               (unsigned long long)c.kernel_events, (unsigned long long)c.kernel_dropped, s->n_signals,
               backpressure_level_to_string(s->max_level), backpressure_reason_to_string(s->max_reason));
        fflush(stdout);
}

static void on_backpressure(Telemetry *t, const char *peer, BackpressureLevel level,
                            BackpressureReason reason, void *userdata) {
        Sender *s = userdata;
        s->n_signals++;
        if (level > s->max_level) {
                s->max_level = level;
                s->max_reason = reason;
        }
        printf("{\"type\":\"signal\",\"t_ms\":%llu,\"peer\":\"%s\",\"level\":\"%s\",\"reason\":\"%s\"}\n",
               (unsigned long long)((now_usec(CLOCK_MONOTONIC) - s->start) / 1000), peer,
               backpressure_level_to_string(level), backpressure_reason_to_string(reason));
        fflush(stdout);
}

static int write_some(Sender *s, size_t max) {
        while (max > 0) {
                ssize_t n = write(s->fd, s->buf, MIN(max, sizeof s->buf));
                if (n < 0) {
                        if (errno == EAGAIN || errno == EINTR)
                                return 0;
                        return -errno;
                }
                s->written += (uint64_t)n;
                max -= (size_t)n;
                if (s->rate > 0)
                        s->tokens -= (double)n;
        }
        return 0;
}

static int on_io(sd_event_source *es, int fd, uint32_t revents, void *userdata) {
        Sender *s = userdata;
        int r = write_some(s, s->rate ? (size_t)MAX(s->tokens, 0.0) : SIZE_MAX);
        if (r < 0) {
                log_notice_errno(r, "Write failed: %m");
                return sd_event_source_set_enabled(es, SD_EVENT_OFF);
        }
        if (s->rate > 0 && s->tokens < 1.0)
                (void)sd_event_source_set_enabled(es, SD_EVENT_OFF);
        return 0;
}

static int on_tick(sd_event_source *es, uint64_t usec, void *userdata) {
        Sender *s = userdata;
        usec_t now = now_usec(CLOCK_MONOTONIC);
        s->tokens = MIN(s->tokens + (double)s->rate * (double)(now - s->last_tick) / 1e6,
                        (double)s->rate / 200.0 + sizeof s->buf / 4);
        s->last_tick = now;
        if (s->tokens >= 1.0)
                (void)sd_event_source_set_enabled(s->io, SD_EVENT_ON);
        (void)sd_event_source_set_time_relative(es, 5 * USEC_PER_MSEC);
        return sd_event_source_set_enabled(es, SD_EVENT_ONESHOT);
}

static int on_report(sd_event_source *es, uint64_t usec, void *userdata) {
        print_stats(userdata, "sample");
        (void)sd_event_source_set_time_relative(es, 250 * USEC_PER_MSEC);
        return sd_event_source_set_enabled(es, SD_EVENT_ONESHOT);
}

static int on_stop(sd_event_source *es, uint64_t usec, void *userdata) {
        Sender *s = userdata;
        return sd_event_exit(s->m.event, 0);
}

static int run_sink(const char *port) {
        int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        int one = 1;
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port)) };
        if (l < 0 || setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
            bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 16) < 0) {
                perror("sink");
                return 1;
        }
        printf("listening\n");
        fflush(stdout);
        signal(SIGCHLD, SIG_IGN);
        for (;;) {
                int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
                if (c < 0)
                        continue;
                if (fork() == 0) {
                        static char buf[1 << 16];
                        while (read(c, buf, sizeof buf) > 0)
                                ;
                        _exit(0);
                }
                close(c);
        }
}

int main(int argc, char **argv) {
        static Sender sender;
        Sender *s = &sender;
        TelemetryConfig cfg;
        double seconds = 3;
        int r;

        log_set_max_level(LOG_INFO);
        if (argc >= 3 && strcmp(argv[1], "sink") == 0)
                return run_sink(argv[2]);
        if (argc < 4 || strcmp(argv[1], "send") != 0) {
                fprintf(stderr, "usage: %s sink PORT | send ADDR PORT [options]\n", argv[0]);
                return 2;
        }
        const char *addr = argv[2], *port = argv[3];
        s->peer = "peerB";

        if (telemetry_config_defaults(&cfg) < 0)
                return 1;
        /* Tests use their own pin dir (or none) so parallel runs do not collide. */
        free(cfg.pin_dir);
        cfg.pin_dir = NULL;

        static const struct option options[] = {
                { "seconds", required_argument, NULL, 's' },
                { "rate", required_argument, NULL, 'r' },
                { "peer", required_argument, NULL, 'p' },
                { "set", required_argument, NULL, 'S' },
                { "daemon", required_argument, NULL, 'D' },
                {},
        };
        int c;
        optind = 4;
        while ((c = getopt_long(argc, argv, "", options, NULL)) >= 0) {
                switch (c) {
                case 's':
                        seconds = atof(optarg);
                        break;
                case 'r':
                        s->rate = strtoull(optarg, NULL, 10);
                        break;
                case 'p':
                        s->peer = optarg;
                        break;
                case 'D':
                        r = epd_connect(optarg, &s->daemon);
                        if (r < 0) {
                                fprintf(stderr, "cannot connect to epdd at %s: %s\n", optarg, strerror(-r));
                                return 1;
                        }
                        break;
                case 'S': {
                        char *sec = strdupa(optarg), *key, *val;
                        key = strchr(sec, '.');
                        val = key ? strchr(key, '=') : NULL;
                        if (!val) {
                                fprintf(stderr, "--set Section.Key=Value\n");
                                return 2;
                        }
                        *key++ = '\0';
                        *val++ = '\0';
                        r = telemetry_config_set(&cfg, sec, key, val);
                        if (r < 0) {
                                fprintf(stderr, "--set %s: %s\n", optarg, strerror(-r));
                                return 2;
                        }
                        break;
                }
                default:
                        return 2;
                }
        }
        const char *problem;
        if (telemetry_config_verify(&cfg, &problem) < 0) {
                fprintf(stderr, "bad config: %s\n", problem);
                return 2;
        }

        r = sd_event_default(&s->m.event);
        if (r < 0)
                return 1;
        if (!s->daemon) {
                r = telemetry_new(&s->m.telemetry, s->m.event, &cfg);
                telemetry_config_done(&cfg);
                if (r < 0)
                        return 1;
                r = telemetry_add_backpressure_handler(s->m.telemetry, on_backpressure, s);
                if (r < 0)
                        return 1;
                r = telemetry_start(s->m.telemetry);
                if (r < 0)
                        return 1;
                TelemetryCounters counters;
                telemetry_get_counters(s->m.telemetry, &counters);
                if (!counters.bpf_loaded) {
                        printf("{\"type\":\"skip\",\"why\":\"%s\"}\n", counters.bpf_unavailable);
                        return 77;
                }
        } else {
                telemetry_config_done(&cfg);
                r = sd_bus_attach_event(s->daemon->bus, s->m.event, 0);
                if (r >= 0)
                        r = epd_backpressure_subscribe(s->daemon, on_daemon_backpressure, s);
                if (r < 0) {
                        fprintf(stderr, "cannot subscribe to Backpressure: %s\n", strerror(-r));
                        return 1;
                }
        }

        s->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port)) };
        if (s->fd < 0 || inet_pton(AF_INET, addr, &a.sin_addr) != 1) {
                fprintf(stderr, "bad address %s\n", addr);
                return 2;
        }
        for (int i = 0;; i++) {
                if (connect(s->fd, (struct sockaddr *)&a, sizeof a) == 0)
                        break;
                if (i > 50) {
                        perror("connect");
                        return 1;
                }
                usleep(100000);
        }
        if (s->daemon)
                r = epd_telemetry_track_socket(s->daemon, s->fd, s->peer);
        else
                r = telemetry_track_socket(&s->m, s->fd, s->peer);
        if (r < 0) {
                fprintf(stderr, "track: %s\n", strerror(-r));
                return 1;
        }
        (void)fcntl(s->fd, F_SETFL, fcntl(s->fd, F_GETFL) | O_NONBLOCK);
        memset(s->buf, 0xa5, sizeof s->buf);

        s->start = s->last_tick = now_usec(CLOCK_MONOTONIC);
        if (sd_event_add_io(s->m.event, &s->io, s->fd, EPOLLOUT, on_io, s) < 0 ||
            sd_event_add_time_relative(s->m.event, &s->report, CLOCK_MONOTONIC, 250 * USEC_PER_MSEC, 0,
                                       on_report, s) < 0 ||
            sd_event_add_time_relative(s->m.event, &s->stop, CLOCK_MONOTONIC,
                                       (usec_t)(seconds * 1e6), 0, on_stop, s) < 0)
                return 1;
        if (s->rate > 0 &&
            sd_event_add_time_relative(s->m.event, &s->tick, CLOCK_MONOTONIC, 0, 1, on_tick, s) < 0)
                return 1;

        r = sd_event_loop(s->m.event);
        if (r < 0)
                return 1;
        if (s->daemon) {
                print_daemon_summary(s);
                r = epd_telemetry_untrack_socket(s->daemon, s->fd);
                if (r < 0)
                        fprintf(stderr, "UntrackSocket: %s\n", strerror(-r));
                sd_bus_detach_event(s->daemon->bus);
                s->daemon = epd_disconnect(s->daemon);
        } else {
                telemetry_evaluate(s->m.telemetry);
                print_stats(s, "summary");
                (void)telemetry_untrack_socket(&s->m, s->fd);
        }
        sd_event_source_disable_unref(s->io);
        sd_event_source_disable_unref(s->tick);
        sd_event_source_disable_unref(s->report);
        sd_event_source_disable_unref(s->stop);
        close(s->fd);
        s->m.telemetry = telemetry_free(s->m.telemetry);
        sd_event_unref(s->m.event);
        return 0;
}
