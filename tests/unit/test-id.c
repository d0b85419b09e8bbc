/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epd_id_random()'s pool (common/id.c). getrandom() is replaced below by a stand-in
 * that counts the calls, remembers the buffer it filled (the pool) and, when a test
 * scripts it, returns short or fails, then asks the kernel as getrandom() does. */
#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "id.h"
#include "../check-main.h"

#define IDS_PER_POOL (EPD_ID_POOL_SIZE / sizeof(EpdId))

static unsigned calls;
static uint8_t *last_buf;
static size_t last_len;
/* What the next calls do, in order: 0 as the kernel, > 0 at most that many bytes,
 * < 0 fail with that errno. */
static int script[8];
static size_t n_script;

ssize_t getrandom(void *buf, size_t len, unsigned flags) {
        __atomic_add_fetch(&calls, 1, __ATOMIC_SEQ_CST);
        last_buf = buf;
        last_len = len;
        if (n_script > 0) {
                int what = script[0];
                memmove(script, script + 1, --n_script * sizeof script[0]);
                if (what < 0) {
                        errno = -what;
                        return -1;
                }
                if (what > 0 && len > (size_t)what)
                        len = (size_t)what;
        }
        return syscall(SYS_getrandom, buf, len, flags);
}

static unsigned n_calls(void) {
        return __atomic_load_n(&calls, __ATOMIC_SEQ_CST);
}

/* Draws until the pool is refilled: then it holds IDS_PER_POOL - 1 ids, and last_buf is
 * its first byte. */
static void pool_sync(void) {
        unsigned c = n_calls();
        EpdId id;
        while (n_calls() == c)
                ck_assert_int_eq(epd_id_random(&id), 0);
        ck_assert_uint_eq(last_len, EPD_ID_POOL_SIZE);
}

static bool is_zero(const uint8_t *p, size_t n) {
        for (size_t i = 0; i < n; i++)
                if (p[i])
                        return false;
        return true;
}

START_TEST(test_ids_differ) {
        enum { N = 3 * IDS_PER_POOL + 5 };
        EpdId ids[N];
        pool_sync();
        unsigned c = n_calls();
        for (size_t i = 0; i < N; i++)
                ck_assert_int_eq(epd_id_random(&ids[i]), 0);
        /* IDS_PER_POOL - 1 from the pool, then a refill per IDS_PER_POOL. */
        ck_assert_uint_eq(n_calls() - c, (N - (IDS_PER_POOL - 1) + IDS_PER_POOL - 1) / IDS_PER_POOL);
        for (size_t i = 0; i < N; i++) {
                ck_assert(!epd_id_is_null(&ids[i]));
                for (size_t j = i + 1; j < N; j++)
                        ck_assert(!epd_id_equal(&ids[i], &ids[j]));
        }
}
END_TEST

START_TEST(test_refill_at_boundary) {
        EpdId last, next;
        pool_sync();
        unsigned c = n_calls();
        for (size_t i = 0; i < IDS_PER_POOL - 1; i++)
                ck_assert_int_eq(epd_id_random(&last), 0);
        ck_assert_uint_eq(n_calls(), c); /* the pool's last id: no system call */
        ck_assert(is_zero(last_buf, EPD_ID_POOL_SIZE)); /* all handed out, all wiped */
        ck_assert_int_eq(epd_id_random(&next), 0);
        ck_assert_uint_eq(n_calls(), c + 1);
        ck_assert_uint_eq(last_len, EPD_ID_POOL_SIZE);
        ck_assert(!epd_id_equal(&last, &next));
}
END_TEST

START_TEST(test_handed_out_bytes_wiped) {
        EpdId a, b;
        pool_sync();
        uint8_t *p = last_buf;
        /* The first id went out in pool_sync(): its bytes are zero, the rest is not. */
        ck_assert(is_zero(p, sizeof(EpdId)));
        ck_assert(!is_zero(p + sizeof(EpdId), sizeof(EpdId)));
        uint8_t copy[sizeof(EpdId)];
        memcpy(copy, p + sizeof(EpdId), sizeof copy);
        ck_assert_int_eq(epd_id_random(&a), 0);
        ck_assert_mem_eq(a.bytes, copy, sizeof copy); /* served in order */
        ck_assert(is_zero(p, 2 * sizeof(EpdId)));
        ck_assert(!is_zero(p + 2 * sizeof(EpdId), EPD_ID_POOL_SIZE - 2 * sizeof(EpdId)));
        ck_assert_int_eq(epd_id_random(&b), 0);
        ck_assert(is_zero(p, 3 * sizeof(EpdId)));
}
END_TEST

START_TEST(test_fork_resets) {
        int fds[2];
        EpdId mine, theirs;
        struct {
                EpdId id;
                unsigned calls;
        } child;

        pool_sync(); /* IDS_PER_POOL - 1 ids left, which the child must not hand out again */
        ck_assert_int_eq(pipe(fds), 0);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
                unsigned c = n_calls();
                int r = epd_id_random(&child.id);
                child.calls = n_calls() - c;
                if (r < 0 || write(fds[1], &child, sizeof child) != (ssize_t)sizeof child)
                        _exit(1);
                _exit(0);
        }
        close(fds[1]);
        ck_assert_int_eq(read(fds[0], &child, sizeof child), (ssize_t)sizeof child);
        close(fds[0]);
        int status;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        ck_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        ck_assert_uint_eq(child.calls, 1); /* an empty pool: refilled */
        theirs = child.id;
        unsigned c = n_calls();
        ck_assert_int_eq(epd_id_random(&mine), 0);
        ck_assert_uint_eq(n_calls(), c); /* the parent keeps its pool */
        ck_assert(!epd_id_equal(&mine, &theirs));
}
END_TEST

static void *draw_one(void *userdata) {
        unsigned c = n_calls();
        EpdId *id = userdata;
        if (epd_id_random(id) < 0 || n_calls() != c + 1)
                return (void *)1;
        return NULL;
}

START_TEST(test_pool_per_thread) {
        pthread_t t;
        void *ret;
        EpdId theirs, mine;
        pool_sync();
        /* Another thread's first id refills its own pool, not ours. */
        ck_assert_int_eq(pthread_create(&t, NULL, draw_one, &theirs), 0);
        ck_assert_int_eq(pthread_join(t, &ret), 0);
        ck_assert_ptr_null(ret);
        unsigned c = n_calls();
        ck_assert_int_eq(epd_id_random(&mine), 0);
        ck_assert_uint_eq(n_calls(), c);
        ck_assert(!epd_id_equal(&mine, &theirs));
}
END_TEST

START_TEST(test_failures) {
        EpdId id, before;
        pool_sync();
        for (size_t i = 0; i < IDS_PER_POOL - 1; i++)
                ck_assert_int_eq(epd_id_random(&before), 0);

        /* An error is returned as before, and nothing of a partial fill stays. */
        script[0] = 100;
        script[1] = -EIO;
        n_script = 2;
        unsigned c = n_calls();
        ck_assert_int_eq(epd_id_random(&id), -EIO);
        ck_assert_uint_eq(n_calls(), c + 2);
        ck_assert(is_zero(last_buf - 100, EPD_ID_POOL_SIZE));

        /* The next call fills again; EINTR and short reads are retried. */
        script[0] = -EINTR;
        script[1] = 7;
        n_script = 2;
        c = n_calls();
        ck_assert_int_eq(epd_id_random(&id), 0);
        ck_assert_uint_eq(n_calls(), c + 3);
        ck_assert(!epd_id_equal(&id, &before));
        c = n_calls();
        for (size_t i = 0; i < IDS_PER_POOL - 1; i++)
                ck_assert_int_eq(epd_id_random(&id), 0);
        ck_assert_uint_eq(n_calls(), c); /* the whole pool was filled */
}
END_TEST

int main(void) {
        Suite *s = suite_create("id");
        TCase *tc = tcase_create("pool");
        tcase_add_test(tc, test_ids_differ);
        tcase_add_test(tc, test_refill_at_boundary);
        tcase_add_test(tc, test_handed_out_bytes_wiped);
        tcase_add_test(tc, test_fork_resets);
        tcase_add_test(tc, test_pool_per_thread);
        tcase_add_test(tc, test_failures);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
