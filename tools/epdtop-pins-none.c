/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* epdtop built without BPF support: the daemon's bus view only. */
#include <errno.h>

#include "epdtop-pins.h"

int top_pins_read_why(const char *dir, TopSnapshot *s, char *why, size_t why_size) {
        if (why && why_size > 0)
                why[0] = '\0';
        return -EOPNOTSUPP;
}
