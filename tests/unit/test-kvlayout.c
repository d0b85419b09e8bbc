/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <check.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "pages/kvlayout.h"
#include "../check-main.h"

START_TEST(test_init_and_ranges) {
        KvLayout l;
        const char *err = NULL;
        uint64_t off, len, ko, kl, vo, vl;

        /* 32 layers, 16 tokens, 8 KV heads x 128 dims x bf16 = 2048 bytes each. */
        ck_assert_int_eq(kv_layout_init(&l, 32, 16, 2048, 2048, "bfloat16", &err), 0);
        ck_assert_uint_eq(l.layer_bytes, 16 * 4096);
        ck_assert_uint_eq(l.layer_stride, 16 * 4096);
        ck_assert_uint_eq(l.page_size, 32 * 16 * 4096);

        ck_assert_int_eq(kv_layout_layer_range(&l, 0, &off, &len), 0);
        ck_assert_uint_eq(off, 0);
        ck_assert_uint_eq(len, 65536);
        ck_assert_int_eq(kv_layout_layer_range(&l, 31, &off, &len), 0);
        ck_assert_uint_eq(off, 31 * 65536);
        ck_assert_uint_eq(off + len, l.page_size);
        ck_assert_int_eq(kv_layout_layer_range(&l, 32, &off, &len), -EINVAL);

        ck_assert_int_eq(kv_layout_layer_kv(&l, 3, &ko, &kl, &vo, &vl), 0);
        ck_assert_uint_eq(ko, 3 * 65536);
        ck_assert_uint_eq(kl, 16 * 2048);
        ck_assert_uint_eq(vo, ko + kl);
        ck_assert_uint_eq(vl, 16 * 2048);

        ck_assert_int_eq(kv_layout_group_range(&l, 8, 8, &off, &len), 0);
        ck_assert_uint_eq(off, 8 * 65536);
        ck_assert_uint_eq(len, 8 * 65536);
        ck_assert_int_eq(kv_layout_group_range(&l, 30, 3, &off, &len), -EINVAL);
        ck_assert_int_eq(kv_layout_group_range(&l, 0, 0, &off, &len), -EINVAL);
        ck_assert_int_eq(kv_layout_group_range(&l, UINT32_MAX, 2, &off, &len), -EINVAL);
}
END_TEST

START_TEST(test_padding) {
        KvLayout l;
        uint64_t off, len;

        /* 3 layers x 3 tokens x (10+6) bytes = 48 bytes per layer, padded to 256. */
        ck_assert_int_eq(kv_layout_init(&l, 3, 3, 10, 6, "uint8", NULL), 0);
        ck_assert_uint_eq(l.layer_bytes, 48);
        ck_assert_uint_eq(l.layer_stride, KV_LAYER_ALIGN);
        ck_assert_uint_eq(l.page_size, 3 * KV_LAYER_ALIGN);
        ck_assert_int_eq(kv_layout_group_range(&l, 1, 2, &off, &len), 0);
        ck_assert_uint_eq(off, 256);
        ck_assert_uint_eq(len, 256 + 48);
        /* Every layer's range is inside the page and disjoint from the others. */
        for (uint32_t i = 0; i < l.layers; i++) {
                ck_assert_int_eq(kv_layout_layer_range(&l, i, &off, &len), 0);
                ck_assert_uint_eq(off % KV_LAYER_ALIGN, 0);
                ck_assert_uint_le(off + len, l.page_size);
                if (i + 1 < l.layers)
                        ck_assert_uint_le(off + len, (i + 1) * l.layer_stride);
        }
}
END_TEST

START_TEST(test_validate) {
        KvLayout l;
        const char *err;

        err = NULL;
        ck_assert_int_eq(kv_layout_init(&l, 0, 16, 256, 256, "float16", &err), -EINVAL);
        ck_assert_ptr_nonnull(err);
        ck_assert_int_eq(kv_layout_init(&l, 4097, 16, 256, 256, "float16", &err), -EINVAL);
        ck_assert_int_eq(kv_layout_init(&l, 2, 0, 256, 256, "float16", &err), -EINVAL);
        ck_assert_int_eq(kv_layout_init(&l, 2, 16, 0, 256, "float16", &err), -EINVAL);
        ck_assert_int_eq(kv_layout_init(&l, 2, 16, 256, 256, "float13", &err), -EINVAL);
        ck_assert_int_eq(kv_layout_init(&l, 2, 16, 256, 256, NULL, &err), -EINVAL);
        ck_assert_int_eq(kv_layout_init(&l, 2, 16, 256, 256,
                                        "an-extremely-long-dtype-name-beyond-the-limit", &err), -EINVAL);
        /* Odd bytes for a 2-byte element. */
        ck_assert_int_eq(kv_layout_init(&l, 2, 16, 257, 256, "float16", &err), -EINVAL);
        /* MLA: V may be zero. */
        ck_assert_int_eq(kv_layout_init(&l, 61, 64, 1152, 0, "bfloat16", &err), 0);
        ck_assert_uint_eq(l.layer_bytes, 64 * 1152);
        /* Too large a page: 4096 x 65536 x 16 MiB overflows everything. */
        err = NULL;
        ck_assert_int_eq(kv_layout_init(&l, 4096, 65536, 1 << 24, 1 << 24, "uint8", &err), -ERANGE);
        ck_assert_ptr_nonnull(err);
        ck_assert_int_eq(kv_layout_init(&l, 1024, 1024, 1024, 1024, "uint8", &err), -ERANGE);
        ck_assert_int_eq(kv_layout_validate(NULL, &err), -EINVAL);
        /* validate() needs a NUL inside dtype. */
        memset(&l, 0, sizeof l);
        l.layers = 1;
        l.tokens_per_block = 1;
        l.k_bytes_per_token_per_layer = 2;
        memset(l.dtype, 'a', sizeof l.dtype);
        ck_assert_int_eq(kv_layout_validate(&l, &err), -EINVAL);
}
END_TEST

START_TEST(test_equal_and_string) {
        KvLayout a, b;
        char buf[128];

        ck_assert_int_eq(kv_layout_init(&a, 28, 16, 512, 512, "bfloat16", NULL), 0);
        ck_assert_int_eq(kv_layout_init(&b, 28, 16, 512, 512, "bfloat16", NULL), 0);
        ck_assert(kv_layout_equal(&a, &b));
        ck_assert_int_eq(kv_layout_init(&b, 28, 16, 512, 512, "float16", NULL), 0);
        ck_assert(!kv_layout_equal(&a, &b));
        ck_assert(!kv_layout_equal(&a, NULL));
        ck_assert(kv_layout_equal(NULL, NULL));
        kv_layout_to_string(&a, buf, sizeof buf);
        ck_assert_ptr_nonnull(strstr(buf, "bfloat16"));
        ck_assert_ptr_nonnull(strstr(buf, "28 layers"));
        ck_assert_uint_eq(kv_dtype_size("float32"), 4);
        ck_assert_uint_eq(kv_dtype_size("nope"), 0);
}
END_TEST

START_TEST(test_group_ranges) {
        KvLayout l;
        KvRange r[8];
        uint64_t offs[5];
        uint64_t base = 4096;

        ck_assert_int_eq(kv_layout_init(&l, 4, 16, 16, 16, "uint8", NULL), 0);
        ck_assert_uint_eq(l.layer_stride, 512);
        ck_assert_uint_eq(l.page_size, 2048);

        /* Pages 0, 1, 2 adjacent, then 7, then 3. */
        const uint32_t ids[5] = { 0, 1, 2, 7, 3 };
        for (size_t i = 0; i < 5; i++)
                offs[i] = base + ids[i] * l.page_size;

        /* A layer group inside each page: one range per page, none merged. */
        ck_assert_int_eq(kv_layout_group_ranges(&l, 1, 2, offs, 5, r), 5);
        for (size_t i = 0; i < 5; i++) {
                ck_assert_uint_eq(r[i].offset, offs[i] + 512);
                ck_assert_uint_eq(r[i].length, 1024);
        }
        /* All layers: adjacent pages merge into one range. */
        ck_assert_int_eq(kv_layout_group_ranges(&l, 0, 4, offs, 5, r), 3);
        ck_assert_uint_eq(r[0].offset, base);
        ck_assert_uint_eq(r[0].length, 3 * 2048);
        ck_assert_uint_eq(r[1].offset, base + 7 * 2048);
        ck_assert_uint_eq(r[1].length, 2048);
        ck_assert_uint_eq(r[2].offset, base + 3 * 2048);

        ck_assert_int_eq(kv_layout_group_ranges(&l, 0, 4, offs, 0, NULL), 0);
        ck_assert_int_eq(kv_layout_group_ranges(&l, 3, 2, offs, 5, r), -EINVAL);
        offs[0] = UINT64_MAX - 10;
        ck_assert_int_eq(kv_layout_group_ranges(&l, 0, 1, offs, 1, r), -ERANGE);
}
END_TEST

int main(void) {
        Suite *s = suite_create("kvlayout");
        TCase *tc = tcase_create("kvlayout");
        tcase_add_test(tc, test_init_and_ranges);
        tcase_add_test(tc, test_padding);
        tcase_add_test(tc, test_validate);
        tcase_add_test(tc, test_equal_and_string);
        tcase_add_test(tc, test_group_ranges);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
