/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Helpers shared by the transport implementations (pure). */

#include "transport.h"

int transport_kind_from_string(const char *s);
/* 0 if [offset, offset+length) is a non-empty range inside the region; -ERANGE if not,
 * -ENOENT for no region. */
int transport_region_check(const TransportRegion *r, uint64_t offset, uint64_t length);
