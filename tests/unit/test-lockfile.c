/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* core/lockfile: one holder at a time, the second told who holds it, the lock gone with
 * the holder however it ends. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/lockfile.h"
#include "../check-main.h"

static char dir[64], path[128];

static void setup(void) {
        strcpy(dir, "/tmp/epd-lockfile-XXXXXX");
        ck_assert_ptr_nonnull(mkdtemp(dir));
        snprintf(path, sizeof path, "%s/x.lock", dir);
}

static void teardown(void) {
        unlink(path);
        rmdir(dir);
}

/* A child that takes the lock, says so on the pipe, and waits to be killed. */
static pid_t holder(void) {
        int p[2];
        ck_assert_int_eq(pipe2(p, O_CLOEXEC), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                int fd = lockfile_take(path, NULL);
                char c = fd >= 0 ? 'y' : 'n';
                if (write(p[1], &c, 1) != 1)
                        _exit(2);
                for (;;)
                        pause();
        }
        close(p[1]);
        char c = 0;
        ck_assert_int_eq(read(p[0], &c, 1), 1);
        close(p[0]);
        ck_assert_int_eq(c, 'y');
        return pid;
}

START_TEST(test_second_refused_names_holder) {
        pid_t pid = holder();
        pid_t who = -1;
        ck_assert_int_eq(lockfile_take(path, &who), -EBUSY);
        ck_assert_int_eq(who, pid);
        /* The file says the holder's pid too. */
        char buf[32] = { 0 };
        FILE *f = fopen(path, "re");
        ck_assert_ptr_nonnull(f);
        ck_assert_ptr_nonnull(fgets(buf, sizeof buf, f));
        fclose(f);
        ck_assert_int_eq(atoi(buf), pid);

        /* SIGKILL: the kernel drops the lock, the next one gets it. */
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        int fd = lockfile_take(path, &who);
        ck_assert_int_ge(fd, 0);
        ck_assert_int_eq(fcntl(fd, F_GETFD), FD_CLOEXEC);
        close(fd);
}
END_TEST

START_TEST(test_missing_directory) {
        char p[200];
        snprintf(p, sizeof p, "%s/none/x.lock", dir);
        ck_assert_int_eq(lockfile_take(p, NULL), -ENOENT);
}
END_TEST

int main(void) {
        Suite *s = suite_create("lockfile");
        TCase *tc = tcase_create("lockfile");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_second_refused_names_holder);
        tcase_add_test(tc, test_missing_directory);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
