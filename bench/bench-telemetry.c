/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* What kernel telemetry costs a transfer, and how many events its ring buffer carries.
 *
 * One TCP connection over loopback (in a private network namespace when possible),
 * a sender thread writing as fast as it can and a receiver thread draining, for
 * `seconds` per run. Runs alternate between three modes, several rounds, and the
 * median of each is reported:
 *   off        no BPF programs loaded (the limit: what the transfer does without us)
 *   untracked  programs attached, this socket not tracked (what every other socket
 *              on the host pays: one hash lookup per ACK)
 *   tracked    programs attached and the socket tracked, ring consumed in the
 *              sd-event loop exactly as epdd does
 * Then a ring-buffer run with per-ACK samples (SampleInterval=0): events/s delivered
 * to user space against tcp_probe hits offered (the limit), and drops.
 *
 * On a small shared machine throughput varies run to run by far more than 2%, so the
 * cost is judged in two ways that do resolve it:
 *   - paired ratios: each round runs every mode back to back (order rotating), and the
 *     ratio tracked/off of the same round is one sample; the median of those ratios
 *     and its distribution-free 95% confidence interval (order statistics of the
 *     binomial) are reported;
 *   - CPU time per GiB moved (the process's CPU time, all threads, from the start of a
 *     run until its threads are joined, over every byte received): work per byte does
 *     not depend on how long the threads waited for a CPU, which is what the other
 *     load on the machine changes most.
 * The verdict says whether the interval lies below the 2% goal, above it, or across it
 * (then: more rounds).
 *
 * Usage: bench-telemetry [SECONDS_PER_RUN] [ROUNDS]   (default 1, 3; ROUNDS <= 400) */

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "telemetry/telemetry-bpf.h"
#include "telemetry/telemetry-manager.h"

typedef enum Mode { MODE_OFF, MODE_UNTRACKED, MODE_TRACKED, _MODE_MAX } Mode;
static const char *const mode_names[] = { "off", "untracked", "tracked" };

typedef struct Run {
        int fd_send, fd_recv;
        double seconds;
        size_t chunk;           /* bytes per write */
        atomic_bool stop;
        uint64_t sent, received;
} Run;

static void *sender(void *p) {
        Run *r = p;
        static char buf[256 * 1024];
        while (!atomic_load(&r->stop)) {
                ssize_t n = write(r->fd_send, buf, r->chunk);
                if (n <= 0)
                        break;
                r->sent += (uint64_t)n;
        }
        shutdown(r->fd_send, SHUT_WR);
        return NULL;
}

static void *receiver(void *p) {
        Run *r = p;
        static char buf[256 * 1024];
        for (;;) {
                ssize_t n = read(r->fd_recv, buf, sizeof buf);
                if (n <= 0)
                        break;
                r->received += (uint64_t)n;
        }
        return NULL;
}

static int tcp_pair(int *a, int *b) {
        int l = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        struct sockaddr_in sa = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        socklen_t sl = sizeof sa;
        if (l < 0 || bind(l, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(l, 1) < 0 ||
            getsockname(l, (struct sockaddr *)&sa, &sl) < 0)
                return -errno;
        *a = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (*a < 0 || connect(*a, (struct sockaddr *)&sa, sizeof sa) < 0)
                return -errno;
        *b = accept4(l, NULL, NULL, SOCK_CLOEXEC);
        close(l);
        return *b < 0 ? -errno : 0;
}

/* Wall time of the last transfer, its CPU time (all threads) per GiB received, the
 * event loop's own CPU time (this thread: consuming the ring, evaluating), and the
 * GiB received. */
static double last_wall_sec, last_cpu_per_gib, last_loop_cpu_sec, last_gib;

static double thread_cpu_sec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static double process_cpu_sec(void) {
        struct timespec ts;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
        return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static int on_stop(sd_event_source *s, uint64_t usec, void *userdata) {
        return sd_event_exit(sd_event_source_get_event(s), 0);
}

/* Returns bytes/s received. The event loop (with telemetry when given) runs in this
 * thread while the transfer runs in two others, as in epdd. */
static double transfer(sd_event *e, Telemetry *t, double seconds, bool track, size_t chunk) {
        Run r = { .seconds = seconds, .chunk = chunk };
        pthread_t ts, tr;
        if (tcp_pair(&r.fd_send, &r.fd_recv) < 0)
                return -1;
        if (chunk < 4096) {
                /* Small segments, each sent at once: many ACKs, many events. */
                int one = 1;
                (void)setsockopt(r.fd_send, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                (void)setsockopt(r.fd_recv, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof one);
        }
        if (track && telemetry_track(t, r.fd_send, "bench") < 0)
                return -1;
        sd_event_source *stop = NULL;
        (void)sd_event_add_time_relative(e, &stop, CLOCK_MONOTONIC, (usec_t)(seconds * 1e6), 1, on_stop, NULL);
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        double c0 = process_cpu_sec();
        pthread_create(&tr, NULL, receiver, &r);
        pthread_create(&ts, NULL, sender, &r);
        double l0 = thread_cpu_sec();
        (void)sd_event_loop(e);
        last_loop_cpu_sec = thread_cpu_sec() - l0;
        atomic_store(&r.stop, true);
        usec_t t1 = now_usec(CLOCK_MONOTONIC);
        uint64_t got = r.received;
        last_wall_sec = (double)(t1 - t0) / 1e6;
        pthread_join(ts, NULL);
        pthread_join(tr, NULL);
        last_gib = (double)r.received / (1 << 30);
        last_cpu_per_gib = r.received > 0 ? (process_cpu_sec() - c0) / last_gib : 0;
        if (track)
                (void)telemetry_untrack(t, r.fd_send);
        sd_event_source_disable_unref(stop);
        close(r.fd_send);
        close(r.fd_recv);
        return (double)got / ((double)(t1 - t0) / 1e6);
}

static int cmp(const void *a, const void *b) {
        double x = *(const double *)a, y = *(const double *)b;
        return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
        qsort(v, (size_t)n, sizeof *v, cmp);
        return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* log(n choose k) */
static double log_choose(int n, int k) {
        return lgamma(n + 1.0) - lgamma(k + 1.0) - lgamma(n - k + 1.0);
}

/* The distribution-free confidence interval of a median from n sorted samples: the
 * j-th smallest and j-th largest, with j the largest such that
 * P(Binomial(n, 1/2) < j) <= (1 - level) / 2. Returns false when n is too small for
 * the level (the interval is then the whole range). */
static bool median_ci(const double *sorted, int n, double level, double *lo, double *hi) {
        double tail = 0, alpha = (1.0 - level) / 2;
        int j = 0;
        for (int k = 0; k < n; k++) {
                tail += exp(log_choose(n, k) - n * log(2.0));
                if (tail > alpha)
                        break;
                j = k + 1;
        }
        if (j < 1) {
                *lo = sorted[0];
                *hi = sorted[n - 1];
                return false;
        }
        *lo = sorted[j - 1];
        *hi = sorted[n - j];
        return true;
}

static Telemetry *telemetry_on(sd_event *e, usec_t sample_interval) {
        TelemetryConfig c;
        Telemetry *t = NULL;
        if (telemetry_config_defaults(&c) < 0)
                return NULL;
        free(c.pin_dir);
        c.pin_dir = NULL;
        c.sample_interval_usec = sample_interval;
        if (telemetry_new(&t, e, &c) < 0 || telemetry_start(t) < 0)
                t = telemetry_free(t);
        telemetry_config_done(&c);
        return t;
}

int main(int argc, char **argv) {
        double seconds = argc > 1 ? atof(argv[1]) : 1.0;
        int rounds = argc > 2 ? atoi(argv[2]) : 3;
        log_set_max_level(LOG_WARNING);
        if (seconds <= 0 || rounds <= 0 || rounds > 400) {
                fprintf(stderr, "usage: %s [SECONDS_PER_RUN] [ROUNDS]\n", argv[0]);
                return 2;
        }
        /* A private loopback, so other traffic on the host does not share it. */
        if (unshare(CLONE_NEWNET) == 0)
                (void)system("ip link set lo up 2>/dev/null");
        /* An sd_event that has exited cannot run again: one per run. */
        sd_event *e = NULL;
        if (sd_event_new(&e) < 0)
                return 1;
        Telemetry *probe = telemetry_on(e, 10 * USEC_PER_MSEC);
        TelemetryCounters pc = {};
        if (probe)
                telemetry_get_counters(probe, &pc);
        if (!probe || !pc.bpf_loaded) {
                printf("bench-telemetry: kernel telemetry unavailable here (%s); nothing to measure\n",
                       pc.bpf_unavailable ? pc.bpf_unavailable : "setup failed");
                telemetry_free(probe);
                sd_event_unref(e);
                return 77;
        }
        telemetry_free(probe);
        e = sd_event_unref(e);

        static double v[_MODE_MAX][400], run_nsec[_MODE_MAX][400], runs[_MODE_MAX][400], wall[_MODE_MAX][400],
                cpu[_MODE_MAX][400], direct[_MODE_MAX][400];
        /* Run-time statistics of BPF programs, for as long as this fd is open: the
         * kernel time our programs take, measured exactly, whatever else the host does. */
        int stats_fd = telemetry_bpf_enable_stats();
        /* The order rotates every round so that drift (other load, CPU frequency)
         * does not favour one mode. */
        for (int i = 0; i < rounds; i++)
                for (int k = 0; k < _MODE_MAX; k++) {
                        int m = (i + k) % _MODE_MAX;
                        if (sd_event_new(&e) < 0)
                                return 1;
                        Telemetry *t = m == MODE_OFF ? NULL : telemetry_on(e, 10 * USEC_PER_MSEC);
                        TelemetryCounters before = {}, after = {};
                        if (t)
                                telemetry_get_counters(t, &before);
                        v[m][i] = m != MODE_OFF && !t ? -1 : transfer(e, t, seconds, m == MODE_TRACKED, 256 * 1024);
                        if (t) {
                                telemetry_get_counters(t, &after);
                                run_nsec[m][i] = (double)(after.kernel_run_nsec - before.kernel_run_nsec);
                                runs[m][i] = (double)(after.kernel_runs - before.kernel_runs);
                                wall[m][i] = last_wall_sec;
                        }
                        cpu[m][i] = last_cpu_per_gib;
                        /* The telemetry's own CPU time per GiB, measured directly: the
                         * kernel's count of time in our BPF programs (BPF_ENABLE_STATS;
                         * every run, any socket of the host) plus the event loop's
                         * thread time beyond what it costs with telemetry off. */
                        direct[m][i] = last_gib > 0 ? (run_nsec[m][i] / 1e9 + last_loop_cpu_sec) / last_gib : 0;
                        telemetry_free(t);
                        e = sd_event_unref(e);
                        if (v[m][i] <= 0) {
                                fprintf(stderr, "run %s failed\n", mode_names[m]);
                                return 1;
                        }
                }

        double med[_MODE_MAX];
        printf("transfer over loopback TCP, %d rounds x %.1fs per mode, medians (min..max):\n", rounds, seconds);
        for (int m = 0; m < _MODE_MAX; m++) {
                double lo = v[m][0], hi = v[m][0];
                for (int i = 1; i < rounds; i++) {
                        lo = MIN(lo, v[m][i]);
                        hi = MAX(hi, v[m][i]);
                }
                double sorted[400];
                memcpy(sorted, v[m], sizeof(double) * (size_t)rounds); /* v stays in round order, paired */
                med[m] = median(sorted, rounds);
                printf("  %-10s %8.1f MiB/s (%.1f..%.1f)   %.4f of off\n", mode_names[m], med[m] / (1 << 20),
                       lo / (1 << 20), hi / (1 << 20), med[m] / med[MODE_OFF]);
        }
        if (stats_fd >= 0) {
                /* CPU time in our programs over wall time: the cost in CPUs, per mode. */
                for (int m = MODE_UNTRACKED; m < _MODE_MAX; m++) {
                        double ns = 0, n = 0, w = 0;
                        for (int i = 0; i < rounds; i++) {
                                ns += run_nsec[m][i];
                                n += runs[m][i];
                                w += wall[m][i];
                        }
                        printf("  %-10s BPF programs: %.0f runs/s, %.0f ns per run, %.4f%% of one CPU\n",
                               mode_names[m], n / w, n > 0 ? ns / n : 0.0, 100.0 * ns / (w * 1e9));
                }
                safe_close(stats_fd);
        } else
                printf("  (BPF run-time statistics unavailable: %s)\n", strerror(-stats_fd));
        printf("limit (telemetry off): %.1f MiB/s; tracked achieves %.4f of it: cost %.2f%% (goal < 2%%)\n",
               med[MODE_OFF] / (1 << 20), med[MODE_TRACKED] / med[MODE_OFF],
               100.0 * (1.0 - med[MODE_TRACKED] / med[MODE_OFF]));

        /* Paired: the ratio of each round's runs, which ran back to back. */
        static double ratio[_MODE_MAX][400], cratio[_MODE_MAX][400], cpus[_MODE_MAX][400];
        printf("paired per round (%d rounds; median, 95%% confidence interval of the median):\n", rounds);
        for (int m = MODE_UNTRACKED; m < _MODE_MAX; m++) {
                for (int i = 0; i < rounds; i++) {
                        ratio[m][i] = v[m][i] / v[MODE_OFF][i];
                        cratio[m][i] = cpu[m][i] / cpu[MODE_OFF][i];
                }
                double rm = median(ratio[m], rounds), cm = median(cratio[m], rounds), rlo, rhi, clo, chi;
                bool ok1 = median_ci(ratio[m], rounds, 0.95, &rlo, &rhi);
                bool ok2 = median_ci(cratio[m], rounds, 0.95, &clo, &chi);
                printf("  %-10s throughput / off %.4f [%.4f, %.4f]%s   CPU per GiB / off %.4f [%.4f, %.4f]%s\n",
                       mode_names[m], rm, rlo, rhi, ok1 ? "" : " (too few rounds for 95%)", cm, clo, chi,
                       ok2 ? "" : " (too few rounds for 95%)");
        }
        for (int m = 0; m < _MODE_MAX; m++) {
                memcpy(cpus[m], cpu[m], sizeof(double) * (size_t)rounds);
                printf("  %-10s CPU time per GiB moved: %.3f s (median)\n", mode_names[m], median(cpus[m], rounds));
        }
        if (stats_fd >= 0) {
                /* Direct cost of tracked over off's CPU per GiB, paired per round. */
                static double share[400], loop_off[400];
                for (int i = 0; i < rounds; i++)
                        loop_off[i] = direct[MODE_OFF][i];
                double loop_base = median(loop_off, rounds); /* the loop's own idle cost */
                for (int i = 0; i < rounds; i++)
                        share[i] = (direct[MODE_TRACKED][i] - loop_base) / cpu[MODE_OFF][i];
                double sm = median(share, rounds), slo, shi;
                bool ok = median_ci(share, rounds, 0.95, &slo, &shi);
                printf("direct cost, tracked (BPF run time + event-loop CPU above off's, per GiB) over off's CPU per "
                       "GiB: %.3f%% [%.3f%%, %.3f%%]%s: %s\n", 100 * sm, 100 * slo, 100 * shi,
                       ok ? "" : " (too few rounds for 95%)",
                       100 * shi < 2.0 ? "below the 2% goal" : 100 * slo > 2.0 ? "above the 2% goal" : "not resolved");
        }
        {
                double lo, hi, clo, chi;
                (void)median_ci(ratio[MODE_TRACKED], rounds, 0.95, &lo, &hi);
                (void)median_ci(cratio[MODE_TRACKED], rounds, 0.95, &clo, &chi);
                /* Throughput cost = 1 - ratio; CPU cost = ratio - 1. */
                double tput_cost_hi = 100.0 * (1.0 - lo), tput_cost_lo = 100.0 * (1.0 - hi);
                double cpu_cost_lo = 100.0 * (clo - 1.0), cpu_cost_hi = 100.0 * (chi - 1.0);
                const char *tv = tput_cost_hi < 2.0 ? "below the 2% goal" : tput_cost_lo > 2.0 ? "above the 2% goal"
                                                                                            : "not resolved (the interval spans 2%: more rounds)";
                const char *cv = cpu_cost_hi < 2.0 ? "below the 2% goal" : cpu_cost_lo > 2.0 ? "above the 2% goal"
                                                                                          : "not resolved (the interval spans 2%: more rounds)";
                printf("verdict, tracked vs off: throughput cost in [%.2f%%, %.2f%%]: %s; CPU-per-GiB cost in "
                       "[%.2f%%, %.2f%%]: %s\n", tput_cost_lo, tput_cost_hi, tv, cpu_cost_lo, cpu_cost_hi, cv);
        }

        /* Ring throughput: one SAMPLE per ACK, with small segments for many ACKs. */
        if (sd_event_new(&e) < 0)
                return 1;
        Telemetry *t = telemetry_on(e, 0);
        if (!t) {
                sd_event_unref(e);
                return 1;
        }
        usec_t t0 = now_usec(CLOCK_MONOTONIC);
        double bw = transfer(e, t, seconds, true, 512);
        (void)telemetry_evaluate(t);
        double dt = (double)(now_usec(CLOCK_MONOTONIC) - t0) / 1e6;
        TelemetryCounters c;
        telemetry_get_counters(t, &c);
        uint64_t offered = c.kernel_events + c.kernel_dropped;
        printf("ring buffer, a sample per ACK: %.0f events/s consumed in the event loop (%llu events, "
               "%llu wakeups, %.1f events per wakeup), %llu dropped; limit (events offered by "
               "tcp_probe): %.0f/s; consumed/offered %.4f; 512-byte segments at %.1f MiB/s meanwhile\n",
               (double)c.ring_events / dt, (unsigned long long)c.ring_events,
               (unsigned long long)c.ring_wakeups,
               c.ring_wakeups ? (double)c.ring_events / (double)c.ring_wakeups : 0.0,
               (unsigned long long)c.kernel_dropped, (double)offered / dt,
               offered ? (double)c.ring_events / (double)offered : 0.0, bw / (1 << 20));
        telemetry_free(t);
        sd_event_unref(e);
        return 0;
}
