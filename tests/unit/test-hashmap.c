/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "conf-table.h"
#include "hashmap.h"
#include "id.h"
#include "parse-util.h"
#include "../check-main.h"

START_TEST(test_put_get_remove) {
        Hashmap *h = hashmap_new(HASHMAP_KEY_U64, 0);
        enum { N = 20000 };
        uint64_t *keys = malloc(N * sizeof *keys);
        for (uint64_t i = 0; i < N; i++) {
                keys[i] = i * 2654435761ULL;
                ck_assert_int_eq(hashmap_put(h, &keys[i], &keys[i]), 0);
        }
        ck_assert_int_eq(hashmap_put(h, &keys[5], NULL), -EEXIST);
        ck_assert_uint_eq(hashmap_size(h), N);
        for (uint64_t i = 0; i < N; i++)
                ck_assert_ptr_eq(hashmap_get(h, &keys[i]), &keys[i]);
        /* Remove every other key; the rest must stay reachable (backward shift). */
        for (uint64_t i = 0; i < N; i += 2)
                ck_assert_ptr_eq(hashmap_remove(h, &keys[i]), &keys[i]);
        for (uint64_t i = 0; i < N; i++)
                ck_assert_ptr_eq(hashmap_get(h, &keys[i]), i % 2 ? &keys[i] : NULL);
        size_t it = 0, n = 0;
        void *v;
        while (hashmap_iterate(h, &it, &v, NULL))
                n++;
        ck_assert_uint_eq(n, N / 2);
        hashmap_free(h);
        free(keys);
}
END_TEST

START_TEST(test_string_keys) {
        Hashmap *h = hashmap_new(HASHMAP_KEY_STRING, 0);
        char names[100][16];
        for (int i = 0; i < 100; i++) {
                snprintf(names[i], sizeof names[i], "k%d", i);
                ck_assert_int_eq(hashmap_put(h, names[i], names[i]), 0);
        }
        ck_assert_ptr_eq(hashmap_get(h, "k42"), names[42]);
        ck_assert_ptr_null(hashmap_get(h, "k100"));
        void *old = NULL;
        ck_assert_int_eq(hashmap_replace(h, "k42", NULL, &old), 0);
        ck_assert_ptr_eq(old, names[42]);
        hashmap_free(h);
}
END_TEST

START_TEST(test_ids) {
        EpdId a, b;
        char s[EPD_ID_STRING_MAX];
        ck_assert_int_eq(epd_id_random(&a), 0);
        epd_id_to_string(&a, s);
        ck_assert_uint_eq(strlen(s), 32);
        ck_assert_int_eq(epd_id_from_string(s, &b), 0);
        ck_assert(epd_id_equal(&a, &b));
        ck_assert_int_eq(epd_id_from_string("xyz", &b), -EINVAL);
        ck_assert_int_eq(epd_id_from_string("0123456789abcdef0123456789abcdeg", &b), -EINVAL);
}
END_TEST

START_TEST(test_parse) {
        uint64_t v;
        usec_t u;
        bool b;
        ck_assert_int_eq(parse_size("256M", &v), 0);
        ck_assert_uint_eq(v, 256ULL << 20);
        ck_assert_int_eq(parse_size("2GiB", &v), 0);
        ck_assert_uint_eq(v, 2ULL << 30);
        ck_assert_int_eq(parse_size("12X", &v), -EINVAL);
        ck_assert_int_eq(parse_size("-1", &v), -EINVAL);
        ck_assert_int_eq(parse_size("99999999999999999999", &v), -ERANGE);
        ck_assert_int_eq(parse_size("20000000T", &v), -ERANGE);
        ck_assert_int_eq(parse_duration("500ms", &u), 0);
        ck_assert_uint_eq(u, 500000);
        ck_assert_int_eq(parse_duration("2", &u), 0);
        ck_assert_uint_eq(u, 2000000);
        ck_assert_int_eq(parse_bool("yes", &b), 0);
        ck_assert(b);
        ck_assert_int_eq(parse_bool("maybe", &b), -EINVAL);
        /* format_size() goes to the next unit rather than print 1024.0 of this one. */
        char buf[32];
        ck_assert_str_eq(format_size(buf, sizeof buf, 1048575), "1.0M");
        ck_assert_str_eq(format_size(buf, sizeof buf, 1023), "1023B");
        ck_assert_str_eq(format_size(buf, sizeof buf, 1536), "1.5K");
        /* Ratios are decimal, nothing strtod takes besides. */
        double d;
        ck_assert_int_eq(conf_parse_ratio("0.25", &d), 0);
        ck_assert(d == 0.25);
        ck_assert_int_eq(conf_parse_ratio(" 0.5", &d), -EINVAL);
        ck_assert_int_eq(conf_parse_ratio("0x1p-1", &d), -EINVAL);
        ck_assert_int_eq(conf_parse_ratio("-0", &d), -EINVAL);
        ck_assert_int_eq(conf_parse_ratio("1.2.3", &d), -EINVAL);
        ck_assert_int_eq(conf_parse_ratio("", &d), -EINVAL);
        /* A refused id string leaves the id as it was. */
        EpdId id = {};
        ck_assert_int_eq(epd_id_from_string("ffffffffffffffffffffffffffffffzz", &id), -EINVAL);
        ck_assert(epd_id_is_null(&id));
}
END_TEST

int main(void) {
        Suite *s = suite_create("common");
        TCase *tc = tcase_create("common");
        tcase_add_test(tc, test_put_get_remove);
        tcase_add_test(tc, test_string_keys);
        tcase_add_test(tc, test_ids);
        tcase_add_test(tc, test_parse);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
