/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the daemon's side of a worker's ring: the worker owns the SQ's tail and its
 * records (shared memory), the daemon consumes and validates them. The input is rounds
 * of: a 32-bit little-endian tail value, then up to 8 records of 64 bytes written into
 * the SQ (a round ends at the input's end). After each round every record the daemon
 * takes is checked: consume never hands out more than the queue holds, a corrupt queue
 * stays broken, and a submission that validates is one the handlers may trust (a known
 * opcode, its fields as the ABI says). */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "handoff/ring.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const uint8_t zero_id[16];

static void check_valid(const struct epd_ring_record *rec) {
        if (rec->result != 0 || rec->arg1 != 0 || (rec->flags & ~EPD_RING_F_ACK))
                __builtin_trap();
        switch (rec->opcode) {
        case EPD_RING_OP_NOP:
                return;
        case EPD_RING_OP_LAYER_GROUP_READY:
                if (!memcmp(rec->request_id, zero_id, 16) || rec->token == 0 || rec->count != 0 || rec->arg0 != 0)
                        __builtin_trap();
                return;
        case EPD_RING_OP_ACCEPT:
                if (!memcmp(rec->request_id, zero_id, 16) || rec->token != 0 || rec->group != 0 || rec->count != 0)
                        __builtin_trap();
                return;
        case EPD_RING_OP_COMMIT:
                if (!memcmp(rec->request_id, zero_id, 16) || rec->token == 0 || rec->group != 0 ||
                    rec->count != 0 || rec->arg0 > EPD_RING_COMMIT_RELEASE)
                        __builtin_trap();
                return;
        default:
                __builtin_trap(); /* an opcode the handlers do not know was let through */
        }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        Ring *r;
        if (ring_new(8, 8, &r) < 0)
                return 0;
        uint8_t *sq = (uint8_t *)r->base + EPD_RING_OFF_RECORDS;
        while (size >= 4) {
                unsigned taken = 0;
                uint32_t tail;
                memcpy(&tail, data, 4);
                data += 4;
                size -= 4;
                size_t n = size < 8 * EPD_RING_RECORD_SIZE ? size : 8 * EPD_RING_RECORD_SIZE;
                memcpy(sq, data, n);
                data += n;
                size -= n;
                __atomic_store_n((uint32_t *)((uint8_t *)r->base + EPD_RING_OFF_SQ_TAIL), tail, __ATOMIC_RELEASE);
                for (unsigned i = 0; i < 16; i++) {
                        struct epd_ring_record rec;
                        int e = ring_consume(r, &rec);
                        if (e == -EAGAIN)
                                break;
                        if (e == -EBADMSG) {
                                /* Broken for good: no record comes out of it any more. */
                                if (!r->broken || ring_consume(r, &rec) != -EBADMSG)
                                        __builtin_trap();
                                break;
                        }
                        if (e < 0)
                                __builtin_trap();
                        if (++taken > 8) /* never more than the queue holds */
                                __builtin_trap();
                        if (ring_record_validate_submission(&rec) == 0)
                                check_valid(&rec);
                }
                if (r->broken)
                        break;
        }
        ring_free(r);
        return 0;
}
