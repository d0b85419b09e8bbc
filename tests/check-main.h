/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* The tail of every check test's main(): runs the suite and turns its verdict into the
 * exit status. fork_status: CK_FORK_GETENV (check's default: each test in a child
 * unless CK_FORK=no) or CK_NOFORK (integration tests: one process, one daemon). */

#include <check.h>
#include <stdlib.h>

static inline int check_run(Suite *s, enum fork_status fork_status) {
        SRunner *sr = srunner_create(s);
        srunner_set_fork_status(sr, fork_status);
        srunner_run_all(sr, CK_NORMAL);
        int failed = srunner_ntests_failed(sr);
        srunner_free(sr);
        return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
