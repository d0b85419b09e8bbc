/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "reason.h"
#include "utf8.h"

#include <stdarg.h>
#include <stdio.h>

int reason_set(Reason *r, int error, const char *fmt, ...) {
        if (r) {
                va_list ap;
                va_start(ap, fmt);
                (void)vsnprintf(r->text, sizeof r->text, fmt, ap);
                va_end(ap);
                utf8_make_valid(r->text); /* it becomes a D-Bus error message */
        }
        return error;
}
