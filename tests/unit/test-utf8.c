/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* utf8_make_valid(): what a cut at a byte count, or a client's bytes, leave is made valid
 * UTF-8 (sd-bus refuses a message with an invalid string), byte for byte. */
#include <check.h>
#include <string.h>

#include "utf8.h"
#include "../check-main.h"

static void check(const char *in, const char *want) {
        char buf[64];
        strcpy(buf, in);
        utf8_make_valid(buf);
        ck_assert_str_eq(buf, want);
}

START_TEST(test_make_valid) {
        check("plain text", "plain text");
        check("10 \xe2\x82\xac, na\xc3\xafve, \xf0\x9f\x98\x80", "10 \xe2\x82\xac, na\xc3\xafve, \xf0\x9f\x98\x80");
        check("cut \xe2\x82", "cut ??");                  /* a euro sign cut after 2 of 3 bytes */
        check("cut \xf0\x9f\x98", "cut ???");
        check("lone \x80 and \xbf", "lone ? and ?");       /* continuation bytes alone */
        check("overlong \xc0\xaf \xe0\x80\xaf", "overlong ?? ???");
        check("surrogate \xed\xa0\x80", "surrogate ???");
        check("past U+10FFFF \xf4\x90\x80\x80", "past U+10FFFF ????");
        check("\xff\xfe", "??");
        check("tab\tnew\nline\x7f", "tab?new?line?");     /* control characters */
        check("", "");
        utf8_make_valid(NULL);
}
END_TEST

int main(void) {
        Suite *s = suite_create("utf8");
        TCase *tc = tcase_create("utf8");
        tcase_add_test(tc, test_make_valid);
        suite_add_tcase(s, tc);
        return check_run(s, CK_FORK_GETENV);
}
