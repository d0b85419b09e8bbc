/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include "reason.h"

#include <stdarg.h>
#include <stdio.h>

int reason_set(Reason *r, int error, const char *fmt, ...) {
        if (r) {
                va_list ap;
                va_start(ap, fmt);
                (void)vsnprintf(r->text, sizeof r->text, fmt, ap);
                va_end(ap);
        }
        return error;
}
