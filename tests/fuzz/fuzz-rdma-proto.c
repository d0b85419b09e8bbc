/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the RDMA message parser: byte 0 picks the type (0x0400 + byte), the rest is
 * the payload. What decodes must re-encode to the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "transport/rdma-proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        uint8_t buf[RDMA_PROTO_MAX_PAYLOAD];
        RdmaMessage m;
        int n;

        if (size < 1)
                return 0;
        if (rdma_message_decode((uint16_t)(RDMA_MSG_FIRST + data[0]), data + 1, size - 1, &m) < 0)
                return 0;
        n = rdma_message_encode(&m, buf, sizeof buf);
        if (n < 0)
                abort(); /* what decoded is valid, so it must encode */
        if ((size_t)n != size - 1 || memcmp(buf, data + 1, (size_t)n) != 0)
                abort(); /* the encoding is canonical */
        return 0;
}
