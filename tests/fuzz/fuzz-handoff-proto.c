/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the handoff payload parser: byte 0 picks the message type (0x0100 + byte),
 * the rest is the payload. What decodes must re-encode to the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "handoff/handoff-proto.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        if (size < 1)
                return 0;
        uint16_t type = (uint16_t)(HANDOFF_MSG_FIRST + data[0]);
        HandoffMessage m;
        if (handoff_message_decode(type, data + 1, size - 1, &m) < 0)
                return 0;

        uint8_t *buf = NULL;
        size_t len = 0;
        if (handoff_message_encode(&m, &buf, &len) < 0)
                abort(); /* what decoded is valid, so it must encode */
        if (len != size - 1 || memcmp(buf, data + 1, len) != 0)
                abort(); /* the encoding is canonical */
        if (m.type == HANDOFF_MSG_PREPARE)
                for (uint32_t g = 0; g < m.n_groups; g++) {
                        HandoffGroupLayout l;
                        if (handoff_message_group_layout(&m, g, &l) < 0 ||
                            handoff_group_layout_validate(&l, m.page_size) < 0)
                                abort();
                }
        free(buf);
        handoff_message_done(&m);
        return 0;
}
