/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <bpf/bpf.h>
#include <bpf/libbpf.h>

#include "epd-telemetry.skel.h"
#include "log.h"
#include "macro.h"
#include "telemetry/telemetry-bpf.h"

struct TelemetryBpf {
        struct epd_telemetry_bpf *skel;
        struct ring_buffer *ring;
        TelemetryBpfEventFn fn;
        void *userdata;
        char *pin_dir;       /* NULL when not pinned */
        int pin_lock;        /* the pin directory, flock()ed while pinned (-1: none) */
        int n_cpus;
};

static const char *const pinned_maps[] = { "tracked", "conns", "settings", "counters" };

static int libbpf_print(enum libbpf_print_level level, const char *fmt, va_list ap) {
        /* libbpf is chatty and its warnings are explained where we handle the error. */
        if (log_get_max_level() < LOG_DEBUG)
                return 0;
        char buf[512];
        vsnprintf(buf, sizeof buf, fmt, ap);
        buf[strcspn(buf, "\n")] = '\0';
        log_debug("libbpf: %s", buf);
        return 0;
}

static char *why(const char *fmt, ...) _printf_(1, 2);
static char *why(const char *fmt, ...) {
        char *s = NULL;
        va_list ap;
        va_start(ap, fmt);
        if (vasprintf(&s, fmt, ap) < 0)
                s = NULL;
        va_end(ap);
        return s;
}

static struct bpf_map *map_by_name(struct epd_telemetry_bpf *skel, const char *name) {
        return bpf_object__find_map_by_name(skel->obj, name);
}

static void unpin_all(TelemetryBpf *b) {
        if (!b->pin_dir)
                return;
        for (size_t i = 0; i < ELEMENTSOF(pinned_maps); i++) {
                char path[4096];
                snprintf(path, sizeof path, "%s/%s", b->pin_dir, pinned_maps[i]);
                (void)unlink(path);
        }
        (void)rmdir(b->pin_dir);
        if (b->pin_lock >= 0)
                b->pin_lock = (close(b->pin_lock), -1);
}

static int pin_maps(TelemetryBpf *b, const char *pin_dir) {
        struct statfs sfs;

        /* The directory itself may be on a bpf filesystem already: made for us and bound
         * into the service's namespace (epd.service: /sys/fs/bpf is a private tmpfs
         * there holding only /sys/fs/bpf/epd; docs/systemd.md, "BPF pins"). Otherwise
         * its parent must be a bpf filesystem, and the directory is created. */
        int k = statfs(pin_dir, &sfs) < 0 ? -errno : 0;
        if (k == -EACCES)
                return log_warning_errno(EACCES, "Cannot pin telemetry maps: %s: %m (a directory on the way is "
                                                 "not searchable by uid %u)", pin_dir, (unsigned)geteuid());
        if (k < 0 || (unsigned long)sfs.f_type != (unsigned long)BPF_FS_MAGIC) {
                _cleanup_(freep) char *parent = strdup(pin_dir);
                if (!parent)
                        return -ENOMEM;
                char *slash = strrchr(parent, '/');
                if (slash && slash != parent)
                        *slash = '\0';

                if (statfs(parent, &sfs) < 0)
                        return log_warning_errno(errno, "Cannot pin telemetry maps: %s: %m%s", parent,
                                                 errno == EACCES ? " (a bpffs is mounted mode 0700 root; under "
                                                                   "systemd the unit binds a directory made for "
                                                                   "epd, see docs/systemd.md)" : "");
                if ((unsigned long)sfs.f_type != (unsigned long)BPF_FS_MAGIC)
                        return log_warning_errno(ENOTSUP,
                                                 "Cannot pin telemetry maps: neither %s nor %s is on a bpf "
                                                 "filesystem (mount -t bpf bpf %s).", pin_dir, parent, parent);

                if (mkdir(pin_dir, 0755) < 0 && errno != EEXIST)
                        return log_warning_errno(errno, "Cannot pin telemetry maps: cannot create %s: %m", pin_dir);
        }

        /* One epdd per directory: another one's pins (the host's service, say) are not
         * replaced, nor removed when this one stops. The lock is the directory's own,
         * held while pinned; one left by a daemon that died goes with its process. */
        int lock = -1;
        for (unsigned attempt = 0;; attempt++) {
                struct stat locked, now;
                lock = open(pin_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
                if (lock < 0)
                        return log_warning_errno(errno, "Cannot pin telemetry maps: cannot open %s: %m", pin_dir);
                if (flock(lock, LOCK_EX | LOCK_NB) < 0) {
                        int e = errno;
                        close(lock);
                        if (e == EWOULDBLOCK)
                                return log_warning_errno(EBUSY,
                                                         "Cannot pin telemetry maps: another epdd pins its maps in %s "
                                                         "(give this one its own [Telemetry] PinDirectory=, or no).",
                                                         pin_dir);
                        return log_warning_errno(e, "Cannot pin telemetry maps: cannot lock %s: %m", pin_dir);
                }
                /* The directory locked is still the one of that name (a stopping epdd
                 * removes its own, another may make it anew): else again, a few times. */
                if (fstat(lock, &locked) == 0 && stat(pin_dir, &now) == 0 && locked.st_dev == now.st_dev &&
                    locked.st_ino == now.st_ino)
                        break;
                close(lock);
                if (attempt == 3)
                        return log_warning_errno(EBUSY, "Cannot pin telemetry maps: %s keeps being replaced.", pin_dir);
                if (mkdir(pin_dir, 0755) < 0 && errno != EEXIST)
                        return log_warning_errno(errno, "Cannot pin telemetry maps: cannot create %s: %m", pin_dir);
        }
        b->pin_lock = lock;
        b->pin_dir = strdup(pin_dir);
        if (!b->pin_dir) {
                b->pin_lock = (close(b->pin_lock), -1);
                return -ENOMEM;
        }

        for (size_t i = 0; i < ELEMENTSOF(pinned_maps); i++) {
                char path[4096];
                snprintf(path, sizeof path, "%s/%s", pin_dir, pinned_maps[i]);
                /* A previous epdd that died left its pins; the maps are ours now. */
                if (unlink(path) < 0 && errno != ENOENT)
                        return log_warning_errno(errno, "Cannot replace stale pin %s: %m", path);
                int r = bpf_map__pin(map_by_name(b->skel, pinned_maps[i]), path);
                if (r < 0)
                        return log_warning_errno(r, "Cannot pin %s: %m", path);
        }
        return 0;
}

static int ring_cb(void *ctx, void *data, size_t size) {
        TelemetryBpf *b = ctx;
        return b->fn ? b->fn(b->userdata, data, size) : 0;
}

int telemetry_bpf_open(TelemetryBpf **ret, const char *pin_dir, uint64_t sample_interval_nsec,
                       uint32_t wakeup_bytes, TelemetryBpfEventFn fn, void *userdata,
                       char **ret_why) {
        _cleanup_(telemetry_bpf_freep) TelemetryBpf *b = NULL;
        char *reason = NULL;
        int r;

        libbpf_set_print(libbpf_print);

        if (access("/sys/kernel/btf/vmlinux", R_OK) < 0) {
                r = -errno;
                reason = why("the kernel exposes no BTF (/sys/kernel/btf/vmlinux: %s); "
                             "CO-RE programs need CONFIG_DEBUG_INFO_BTF", strerror(-r));
                goto fail;
        }

        b = calloc(1, sizeof *b);
        if (!b) {
                r = -ENOMEM;
                goto fail;
        }
        b->pin_lock = -1;
        b->fn = fn;
        b->userdata = userdata;
        b->n_cpus = libbpf_num_possible_cpus();
        if (b->n_cpus <= 0) {
                r = b->n_cpus < 0 ? b->n_cpus : -EINVAL;
                reason = why("cannot count possible CPUs: %s", strerror(-r));
                goto fail;
        }

        b->skel = epd_telemetry_bpf__open();
        if (!b->skel) {
                r = -errno;
                reason = why("cannot open the BPF object: %s", strerror(-r));
                goto fail;
        }

        r = epd_telemetry_bpf__load(b->skel);
        if (r < 0) {
                if (r == -EPERM || r == -EACCES)
                        reason = why("not privileged to load BPF programs (needs CAP_BPF, "
                                     "CAP_PERFMON and CAP_SYS_RESOURCE or root): %s", strerror(-r));
                else
                        reason = why("the kernel refused the BPF programs: %s "
                                     "(run with --log-level=debug for the verifier log)", strerror(-r));
                goto fail;
        }

        struct epd_telemetry_config cfg = {
                .sample_interval_ns = sample_interval_nsec,
                .wakeup_bytes = wakeup_bytes,
                .abi = EPD_TELEMETRY_ABI,
        };
        uint32_t zero = 0;
        r = bpf_map__update_elem(b->skel->maps.settings, &zero, sizeof zero, &cfg, sizeof cfg, BPF_ANY);
        if (r < 0) {
                reason = why("cannot configure the BPF programs: %s", strerror(-r));
                goto fail;
        }

        r = epd_telemetry_bpf__attach(b->skel);
        if (r < 0) {
                reason = why("cannot attach to the tcp/sock tracepoints: %s", strerror(-r));
                goto fail;
        }

        b->ring = ring_buffer__new(bpf_map__fd(b->skel->maps.events), ring_cb, b, NULL);
        if (!b->ring) {
                r = -errno;
                reason = why("cannot set up the ring buffer: %s", strerror(-r));
                goto fail;
        }

        /* Pins are a convenience for tools: failing to pin is not failing to load. */
        if (pin_dir && pin_maps(b, pin_dir) < 0 && b->pin_dir) {
                unpin_all(b); /* all or nothing: a tool finds every map or none */
                free(b->pin_dir);
                b->pin_dir = NULL;
        }

        *ret = TAKE_PTR(b);
        if (ret_why)
                *ret_why = NULL;
        return 0;

fail:
        if (ret_why)
                *ret_why = reason;
        else
                free(reason);
        return r < 0 ? r : -EIO;
}

TelemetryBpf *telemetry_bpf_free(TelemetryBpf *b) {
        if (!b)
                return NULL;
        ring_buffer__free(b->ring);
        unpin_all(b);
        if (b->pin_lock >= 0)
                close(b->pin_lock);
        epd_telemetry_bpf__destroy(b->skel);
        free(b->pin_dir);
        free(b);
        return NULL;
}

const char *telemetry_bpf_pin_dir(TelemetryBpf *b) {
        return b->pin_dir;
}

int telemetry_bpf_ring_fd(TelemetryBpf *b) {
        return ring_buffer__epoll_fd(b->ring);
}

int telemetry_bpf_consume(TelemetryBpf *b) {
        return ring_buffer__consume(b->ring);
}

int telemetry_bpf_track(TelemetryBpf *b, uint64_t cookie, uint32_t peer_id, const char *peer) {
        struct epd_conn_info info = { .peer_id = peer_id };
        if (peer)
                strncpy(info.peer, peer, sizeof info.peer - 1);
        /* Drop a stale record of an earlier socket with the same cookie (cannot happen
         * with kernel cookies, but keeps the map consistent if it ever does). */
        (void)bpf_map__delete_elem(b->skel->maps.conns, &cookie, sizeof cookie, 0);
        return bpf_map__update_elem(b->skel->maps.tracked, &cookie, sizeof cookie, &info, sizeof info,
                                    BPF_ANY);
}

int telemetry_bpf_untrack(TelemetryBpf *b, uint64_t cookie) {
        int r = bpf_map__delete_elem(b->skel->maps.tracked, &cookie, sizeof cookie, 0);
        (void)bpf_map__delete_elem(b->skel->maps.conns, &cookie, sizeof cookie, 0);
        return r;
}

int telemetry_bpf_prune(TelemetryBpf *b, bool (*keep)(void *userdata, uint64_t cookie), void *userdata) {
        uint64_t key, next, gone[256];
        size_t n = 0;
        const void *prev = NULL;
        int deleted = 0;

        /* Keys collected first (deleting while walking restarts the walk), a bounded
         * number per call: the next call takes the rest. */
        while (n < ELEMENTSOF(gone) &&
               bpf_map__get_next_key(b->skel->maps.conns, prev, &next, sizeof next) == 0) {
                if (!keep(userdata, next))
                        gone[n++] = next;
                key = next;
                prev = &key;
        }
        for (size_t i = 0; i < n; i++)
                if (bpf_map__delete_elem(b->skel->maps.conns, &gone[i], sizeof gone[i], 0) == 0)
                        deleted++;
        return deleted;
}

int telemetry_bpf_conn_stats(TelemetryBpf *b, uint64_t cookie, struct epd_conn_stats *ret) {
        return bpf_map__lookup_elem(b->skel->maps.conns, &cookie, sizeof cookie, ret, sizeof *ret, 0);
}

int telemetry_bpf_counters(TelemetryBpf *b, uint64_t ret[_EPD_COUNTER_MAX]) {
        _cleanup_(freep) uint64_t *v = calloc((size_t)b->n_cpus, sizeof *v);
        if (!v)
                return -ENOMEM;
        for (uint32_t i = 0; i < _EPD_COUNTER_MAX; i++) {
                int r = bpf_map__lookup_elem(b->skel->maps.counters, &i, sizeof i, v,
                                             sizeof *v * (size_t)b->n_cpus, 0);
                if (r < 0)
                        return r;
                ret[i] = 0;
                for (int c = 0; c < b->n_cpus; c++)
                        ret[i] += v[c];
        }
        return 0;
}

int telemetry_bpf_prog_stats(TelemetryBpf *b, uint64_t *ret_run_nsec, uint64_t *ret_runs) {
        struct bpf_program *progs[] = { b->skel->progs.epd_tcp_probe, b->skel->progs.epd_tcp_retransmit,
                                        b->skel->progs.epd_sock_set_state };
        uint64_t ns = 0, runs = 0;
        for (size_t i = 0; i < ELEMENTSOF(progs); i++) {
                struct bpf_prog_info info = {};
                uint32_t len = sizeof info;
                int r = bpf_obj_get_info_by_fd(bpf_program__fd(progs[i]), &info, &len);
                if (r < 0)
                        return r;
                ns += info.run_time_ns;
                runs += info.run_cnt;
        }
        *ret_run_nsec = ns;
        *ret_runs = runs;
        return 0;
}

int telemetry_bpf_enable_stats(void) {
        int fd = bpf_enable_stats(BPF_STATS_RUN_TIME);
        return fd < 0 ? (errno > 0 ? -errno : fd) : fd;
}
