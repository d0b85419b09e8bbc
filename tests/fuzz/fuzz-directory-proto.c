/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the directory's peer messages (pages/directory-proto.c): byte 0 picks the type
 * (0x0200 + byte), the rest is the payload. What parses must re-encode to the same bytes,
 * and what the owner's records and placement make of it must hold their bounds. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pages/directory-proto.h"
#include "pages/directory-shard.h"
#include "sched/placement.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        DirectoryMessage m;
        uint8_t *buf = NULL;
        size_t len = 0;
        int r;

        if (size < 1)
                return 0;
        uint16_t type = (uint16_t)(DIRECTORY_MSG_FIRST + data[0]);
        if (directory_message_parse(type, data + 1, size - 1, &m) < 0)
                return 0;
        switch (type) {
        case DIRECTORY_MSG_PUBLISH:
        case DIRECTORY_MSG_UNPUBLISH:
                r = directory_publish_encode(type, m.arena, m.worker, m.hashes, m.count, &buf, &len);
                break;
        case DIRECTORY_MSG_LOOKUP:
                r = directory_lookup_encode(m.request, m.hashes, m.count, &buf, &len);
                break;
        default:
                r = directory_answer_encode(m.request, m.entries, m.count, &buf, &len);
                break;
        }
        if (r < 0)
                abort(); /* what parsed is valid, so it must encode */
        if (len != size - 1 || memcmp(buf, data + 1, len) != 0)
                abort(); /* the encoding is canonical */
        free(buf);

        if (type == DIRECTORY_MSG_PUBLISH) {
                DirectoryShard *sh;
                DirectoryAnswerEntry e;
                if (directory_shard_new(&sh, 64) < 0)
                        abort();
                for (uint32_t i = 0; i < m.count; i++)
                        (void)directory_shard_put(sh, m.hashes[i], "fuzz", m.arena, m.worker);
                if (directory_shard_records(sh) > 64)
                        abort();
                directory_shard_get(sh, m.hashes[0], &e);
                if (e.n_holders > DIRECTORY_HOLDERS_MAX)
                        abort();
                size_t before = directory_shard_records(sh);
                if (directory_shard_drop_host(sh, "fuzz") != before || directory_shard_records(sh) != 0)
                        abort();
                directory_shard_free(sh);
        } else if (type == DIRECTORY_MSG_ANSWER) {
                PlacementCandidate *c = NULL;
                size_t n = 0;
                if (placement_rank(m.entries, m.count, "self", &c, &n) < 0)
                        abort();
                for (size_t i = 0; i < n; i++)
                        if (c[i].n_blocks == 0 || c[i].n_blocks > m.count || (i > 0 && c[i].n_blocks > c[i - 1].n_blocks))
                                abort();
                free(c);
        }
        directory_message_done(&m);
        return 0;
}
