/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The tail of every check test's main(): runs the suite and turns its verdict into the
 * exit status. fork_status: CK_FORK_GETENV (check's default: each test in a child
 * unless CK_FORK=no) or CK_NOFORK (integration tests: one process, one daemon).
 *
 * The run has a directory of its own, CHECK_RUN_PREFIX plus mkdtemp's six characters
 * (EPD_TEST_RUN_DIR), under which the integration harness makes every daemon's directory;
 * it is removed at the end whatever became of the tests. A test that fails or times out in check's forked child
 * ends with _exit() or SIGKILL before its teardown: the epdd and dbus-daemon it started
 * (their pids in their directory's .pids) are killed here, and nothing is left in /tmp. */

#include <check.h>
#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* Where a run's directory goes (mkdtemp adds the rest); the harness checks it too. */
#define CHECK_RUN_PREFIX "/tmp/epd-test-run-"

/* Kills what a harness directory's .pids names, if it is still an epdd or dbus-daemon. */
static inline void check_run_kill_leftovers(const char *dir) {
        char path[600], comm[64];
        snprintf(path, sizeof path, "%s/.pids", dir);
        FILE *f = fopen(path, "re");
        if (!f)
                return;
        long pid;
        while (fscanf(f, "%ld", &pid) == 1) {
                snprintf(path, sizeof path, "/proc/%ld/comm", pid);
                FILE *c = fopen(path, "re");
                if (!c)
                        continue;
                bool ours = fgets(comm, sizeof comm, c) &&
                            (strcmp(comm, "epdd\n") == 0 || strcmp(comm, "dbus-daemon\n") == 0);
                fclose(c);
                /* And started for this directory (its config lies in it): a pid noted
                 * here may have been reused since by another test's daemon. */
                if (ours) {
                        char cmdline[4096] = "";
                        snprintf(path, sizeof path, "/proc/%ld/cmdline", pid);
                        FILE *l = fopen(path, "re");
                        size_t n = l ? fread(cmdline, 1, sizeof cmdline - 1, l) : 0;
                        if (l)
                                fclose(l);
                        for (size_t i = 0; i < n; i++)
                                if (cmdline[i] == 0)
                                        cmdline[i] = ' ';
                        cmdline[n] = 0;
                        ours = strstr(cmdline, dir) != NULL;
                }
                if (ours)
                        (void)kill((pid_t)pid, SIGKILL);
        }
        fclose(f);
}

static inline void check_run_cleanup(const char *run) {
        DIR *d = opendir(run);
        if (d) {
                struct dirent *e;
                char sub[512];
                while ((e = readdir(d)))
                        if (e->d_name[0] != '.') {
                                snprintf(sub, sizeof sub, "%s/%s", run, e->d_name);
                                check_run_kill_leftovers(sub);
                        }
                closedir(d);
        }
        char cmd[600];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", run);
        if (strncmp(run, CHECK_RUN_PREFIX, strlen(CHECK_RUN_PREFIX)) == 0 && system(cmd) != 0)
                fprintf(stderr, "cannot remove %s\n", run);
}

static inline int check_run(Suite *s, enum fork_status fork_status) {
        char run[] = CHECK_RUN_PREFIX "XXXXXX";
        /* 0711: the harness lets other uids reach a daemon's socket (read-surface test). */
        bool have_run = mkdtemp(run) && chmod(run, 0711) == 0 && setenv("EPD_TEST_RUN_DIR", run, 1) == 0;
        SRunner *sr = srunner_create(s);
        srunner_set_fork_status(sr, fork_status);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        if (have_run) {
                check_run_cleanup(run);
                unsetenv("EPD_TEST_RUN_DIR");
        }
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
