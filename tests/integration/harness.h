/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Integration-test harness: starts what a test needs itself (a private dbus-daemon,
 * epdd on a direct socket in a private directory, optionally inside a network
 * namespace) and stops it, checking that epdd exits cleanly. */

#include <stdbool.h>
#include <sys/types.h>
#include <systemd/sd-bus.h>

#include "epd/epd.h"

typedef struct Harness {
        char dir[256];          /* private temporary directory */
        char socket[300];       /* epdd's direct socket */
        char config[300];
        char bus_address[400];  /* private dbus-daemon, when started */
        pid_t dbus_pid;
        pid_t epdd_pid;
        char log[300];          /* epdd's stderr */
} Harness;

/* Path of the built epdd (from the EPDD environment variable set by meson). */
const char *harness_epdd(void);

/* Creates the directory and writes a config with the socket in it, SystemBus=no, plus
 * `extra` (more INI text, may be NULL). */
int harness_init(Harness *h, const char *extra);
/* Notes a process the test started itself (an epdd of its own) in the directory's .pids:
 * the test's main kills it if the test ends before its teardown (check-main.h). */
void harness_note_pid(Harness *h, pid_t pid);
/* A test that runs over a private dbus-daemon calls this in main(), before its suite:
 * without a dbus-daemon in PATH the whole test exits 77 (skip) with its reason, rather
 * than each case failing inside check's forked child. No-op when !over_bus. */
void harness_require_bus(bool over_bus);
/* Whether a dbus-daemon is in PATH (for one test of a binary to skip on its own). */
bool harness_have_dbus_daemon(void);
/* Starts a private dbus-daemon (system-bus-like, but allowing everything), the one
 * found in PATH; -ENOENT when there is none. */
int harness_start_bus(Harness *h);
/* Starts epdd (on the private bus too if one runs) and waits until it serves. Extra
 * arguments, NULL-terminated, are appended. */
int harness_start_epdd(Harness *h, const char *const *extra_args);
/* SIGTERM; waits up to 10 s; returns epdd's exit status (0 = clean). */
int harness_stop_epdd(Harness *h);
/* Whether epdd's log (its stderr) has a line containing `needle`. */
bool harness_log_has(Harness *h, const char *needle);
/* Runs `epdctl -A address args` (the build's, $BUILD_ROOT/tools/epdctl) and returns its
 * output (NUL-terminated, cut at size - 1) in out; fails the test unless it exits 0. */
void harness_epdctl(const char *address, const char *args, char *out, size_t size);
/* Stops everything and removes the directory. */
void harness_done(Harness *h);
/* A test that needs its own configuration: the fixture's epdd stopped and its directory
 * removed, then a fresh one with `extra` started on the direct socket, whose libepd
 * address goes to address. 0 or the first error. */
int harness_restart(Harness *h, const char *extra, char *address, size_t n);

/* harness_start_epdd() with the test library `lib` preloaded into epdd and var=value
 * (var NULL: none) in its environment; the test's own environment is as it was after.
 * Under ASan the preloaded library comes before the runtime, which ASan is told to
 * accept. lib NULL: a plain start. */
int harness_start_epdd_preloaded(Harness *h, const char *lib, const char *var, const char *value);

/* Lets another uid reach epdd as a member of its group would: the test directory
 * searchable, the direct socket (and the private bus's, when one runs) writable by all. */
void harness_let_others_in(Harness *h);
/* fork(); the child runs as uid (and gid) with no supplementary groups (unless uid is the
 * caller's already), or exits 2 when it cannot become it. Returns the child's pid in the
 * parent, 0 in the child. */
pid_t harness_fork_as(uid_t uid);

/* Starts n daemons that name each other's ports in their configurations (a cluster on
 * 127.0.0.1): conf(i, port, buf, size, userdata) writes daemon i's configuration into buf,
 * the cluster's ports being port .. port + n - 1; h[i] is initialized with it and started.
 * The ports are chosen before any daemon binds, so one that another process took in
 * between (tests run in parallel) is not an error of the code under test: every daemon
 * is stopped and another set of ports tried, up to 20 times. Returns 0, or the error of
 * a start that failed for another reason (everything stopped). */
int harness_start_cluster(Harness *const *h, size_t n,
                          void (*conf)(size_t i, unsigned port, char *buf, size_t size, void *userdata),
                          void *userdata);

/* "direct:<socket>" */
const char *harness_direct_address(Harness *h, char *buf, size_t n);

/* Polls `cond` every 10 ms for up to timeout_ms; returns true once it holds. */
bool harness_wait_for(bool (*cond)(void *userdata), void *userdata, unsigned timeout_ms);

/* Raw sd-bus connection to the direct socket (peer to peer). */
int harness_direct_bus(Harness *h, sd_bus **ret);

/* Whether the daemon on bus lists peer in its telemetry (org.epd1.Telemetry.GetPeers). */
bool harness_telemetry_lists(sd_bus *bus, const char *peer);

/* The daemon's handoff counter `name` (org.epd1.Handoffs.Counters); fails the test if
 * there is none of that name. */
uint64_t harness_handoff_counter(sd_bus *bus, const char *name);

/* Compares the interface defined in xml_file with the same interface in the live
 * introspection of `path`; whitespace-insensitive. Returns 0 if equal; otherwise
 * prints both and returns -EBADMSG. */
int harness_check_introspection(sd_bus *bus, const char *destination, const char *path,
                                const char *xml_file);

/* Starts what a test needs: the private dbus-daemon too when over_bus (exits 77 when
 * dbus-daemon is not installed), then epdd; writes the libepd address for it. */
void harness_start(Harness *h, bool over_bus, char *address, size_t n);
/* The same with `lib` preloaded into epdd (harness_start_epdd_preloaded()). */
void harness_start_preloaded(Harness *h, bool over_bus, char *address, size_t n, const char *lib, const char *var,
                             const char *value);
/* A raw sd-bus connection to epdd: the private bus when one runs, else the direct socket. */
int harness_raw_bus(Harness *h, sd_bus **ret);
/* The destination for raw calls: "org.epd1" on the private bus, NULL peer to peer. */
const char *harness_destination(const Harness *h);

/* Number of entries in Manager.Workers. */
int harness_count_workers(sd_bus *bus, const char *destination);
/* The same, asked on a raw connection of its own (opened and closed here). */
int harness_workers(Harness *h);
