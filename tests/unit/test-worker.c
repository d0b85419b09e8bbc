/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Registration bookkeeping: limits, ownership, and release when a client goes. */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "macro.h"
#include "core/manager.h"
#include "core/worker.h"
#include "../check-main.h"

static Manager *m;

static void setup(void) {
        /* A manager with no bus and no arenas: bookkeeping only. */
        char path[] = "/tmp/epd-worker-test-XXXXXX";
        int fd = mkstemp(path);
        ck_assert_int_ge(fd, 0);
        const char *text = "[Limits]\nMaxWorkers=3\nMaxObjectsPerClient=4\n";
        ck_assert_int_eq(write(fd, text, strlen(text)), (int)strlen(text));
        close(fd);
        ck_assert_int_eq(manager_new(&m, path), 0);
        unlink(path);
}

static void teardown(void) {
        manager_free(m);
}

static Client *fake_client(const char *key) {
        Client *c = calloc(1, sizeof *c);
        c->manager = m;
        c->key = strdup(key);
        ck_assert_int_eq(hashmap_put(m->clients, c->key, c), 0);
        return c;
}

START_TEST(test_validate) {
        const char *why;
        ck_assert_int_eq(worker_validate("prefill", "m", "cuda:0", &why), 0);
        ck_assert_int_eq(worker_validate("janitor", "m", "cpu", &why), -EINVAL);
        ck_assert_ptr_nonnull(strstr(why, "unknown role"));
        char big[300];
        memset(big, 'x', sizeof big - 1);
        big[sizeof big - 1] = 0;
        ck_assert_int_eq(worker_validate("decode", big, "cpu", &why), -EINVAL);
        ck_assert_int_eq(worker_validate("decode", "m", "c\npu", &why), -EINVAL);
        for (int r = 0; r < _WORKER_ROLE_MAX; r++)
                ck_assert_int_eq(worker_role_from_string(worker_role_to_string(r)), r);
}
END_TEST

START_TEST(test_register_limits_release) {
        Client *a = fake_client("a"), *b = fake_client("b"), *c = fake_client("c"), *d = fake_client("d");
        Worker *wa, *wb, *wc, *x;
        ck_assert_int_eq(worker_new(m, a, WORKER_PREFILL, "m", "cpu", &wa), 0);
        ck_assert_ptr_eq(client_get_worker(a), wa);
        ck_assert_ptr_eq(manager_get_worker(m, wa->id_str), wa);
        /* One registration per client. */
        ck_assert_int_eq(worker_new(m, a, WORKER_DECODE, "m", "cpu", &x), -EALREADY);
        ck_assert_int_eq(worker_new(m, b, WORKER_DECODE, "m", "cpu", &wb), 0);
        ck_assert_int_eq(worker_new(m, c, WORKER_ENCODER, "m", "cpu", &wc), 0);
        /* MaxWorkers=3. */
        ck_assert_int_eq(worker_new(m, d, WORKER_ENCODER, "m", "cpu", &x), -EUSERS);
        ck_assert_uint_eq(hashmap_size(m->workers), 3);
        ck_assert_str_ne(wa->id_str, wb->id_str);

        /* A client that goes releases its worker, and nothing else. */
        client_gone(b);
        ck_assert_uint_eq(hashmap_size(m->workers), 2);
        ck_assert_ptr_null(manager_get_worker(m, "00000000000000000000000000000000"));
        ck_assert_ptr_eq(manager_get_worker(m, wa->id_str), wa);
        ck_assert_int_eq(worker_new(m, d, WORKER_ENCODER, "m", "cpu", &x), 0);

        /* Explicit unregistration and the disconnect path are the same function. */
        worker_free(wa);
        ck_assert_ptr_null(client_get_worker(a));
        ck_assert_uint_eq(a->n_objects[CLIENT_OBJECT_WORKER], 0);
        client_gone(a);
        client_gone(c);
        client_gone(d);
        ck_assert_uint_eq(hashmap_size(m->workers), 0);
        ck_assert_uint_eq(hashmap_size(m->clients), 0);
}
END_TEST

typedef struct Thing {
        ClientObject object;
        int *released;
} Thing;

static void thing_release(ClientObject *o) {
        Thing *t = container_of(o, Thing, object);
        client_object_unlink(o);
        (*t->released)++;
        free(t);
}

START_TEST(test_object_limit) {
        Client *a = fake_client("a");
        int released = 0;
        /* MaxObjectsPerClient=4: the fifth object is refused. */
        for (int i = 0; i < 5; i++) {
                Thing *t = calloc(1, sizeof *t);
                t->released = &released;
                int r = client_object_link(a, &t->object, CLIENT_OBJECT_SEQUENCE, thing_release);
                if (i < 4)
                        ck_assert_int_eq(r, 0);
                else {
                        ck_assert_int_eq(r, -EDQUOT);
                        free(t);
                }
        }
        ck_assert_uint_eq(a->n_objects[CLIENT_OBJECT_SEQUENCE], 4);
        client_gone(a);
        ck_assert_int_eq(released, 4);
}
END_TEST

int main(void) {
        Suite *s = suite_create("worker");
        TCase *tc = tcase_create("worker");
        tcase_add_checked_fixture(tc, setup, teardown);
        tcase_add_test(tc, test_validate);
        tcase_add_test(tc, test_register_limits_release);
        tcase_add_test(tc, test_object_limit);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
