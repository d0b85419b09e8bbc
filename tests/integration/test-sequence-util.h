/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* What integration tests read of a sequence through a client's own connection. */

#include <check.h>
#include <stdint.h>
#include <string.h>
#include <systemd/sd-bus.h>

#include "epd-internal.h"

/* The arena offsets of sequence `path`'s n pages (its Offsets property); fails the test
 * unless it has exactly n. */
static inline void sequence_offsets(epd_client *c, const char *path, uint64_t *offs, uint32_t n) {
        sd_bus_error e = SD_BUS_ERROR_NULL;
        sd_bus_message *reply = NULL;
        const void *o;
        size_t sz;
        ck_assert_int_ge(sd_bus_get_property(c->bus, NULL, path, "org.epd1.Sequence", "Offsets", &e, &reply, "at"), 0);
        ck_assert_int_ge(sd_bus_message_read_array(reply, 't', &o, &sz), 0);
        ck_assert_uint_eq(sz / 8, n);
        memcpy(offs, o, sz);
        sd_bus_message_unref(reply);
}
