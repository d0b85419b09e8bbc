/* SPDX-License-Identifier: LGPL-2.1-or-later */
#include <errno.h>
#include <string.h>

#include "macro.h"
#include "transport.h"
#include "transport-util.h"

static const char *const kind_table[_TRANSPORT_KIND_MAX] = {
        [TRANSPORT_LOCAL] = "local",
        [TRANSPORT_TCP] = "tcp",
        [TRANSPORT_CUDA] = "cuda",
        [TRANSPORT_RDMA] = "rdma",
};

const char *transport_kind_to_string(TransportKind k) {
        return k >= 0 && k < _TRANSPORT_KIND_MAX ? kind_table[k] : NULL;
}

int transport_kind_from_string(const char *s) {
        if (!s)
                return -EINVAL;
        for (int i = 0; i < _TRANSPORT_KIND_MAX; i++)
                if (strcmp(kind_table[i], s) == 0)
                        return i;
        return -EINVAL;
}

int transport_region_check(const TransportRegion *r, uint64_t offset, uint64_t length) {
        uint64_t end;
        if (!r)
                return -ENOENT;
        if (length == 0 || ADD_OVERFLOW(offset, length, &end) || end > r->size)
                return -ERANGE;
        return 0;
}
