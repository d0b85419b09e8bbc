/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the WAL's record and file parsing: the bytes of wal.log and wal.snapshot come
 * from disk, which a crash, a bad disk or another process may have mangled. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "wal/wal.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int touch(void *userdata, const WalRecord *r, bool from_snapshot) {
        uint64_t *sum = userdata;
        const uint8_t *p = r->payload;
        /* Read every payload byte, so the sanitizers see any overrun. */
        for (uint32_t i = 0; i < r->length; i++)
                *sum += p[i];
        *sum += r->lsn + r->type + from_snapshot;
        return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        WalParseResult pr;
        WalRecord rec;
        uint64_t sum = 0;
        size_t n;

        /* Bare records, as a stream. */
        for (size_t off = 0; off < size; off += n)
                if (wal_record_parse(data + off, size - off, &rec, &n) < 0)
                        break;
                else
                        (void)touch(&sum, &rec, false);

        /* Whole files, as log and as snapshot, with and without a skip point. */
        for (int snap = 0; snap < 2; snap++)
                if (wal_parse_buffer(data, size, snap ? 0 : 3, touch, &sum, snap, &pr) == 0) {
                        if (pr.good_bytes > size || pr.good_bytes < WAL_FILE_HEADER_SIZE)
                                __builtin_trap();
                        if (pr.tail == 0 && pr.good_bytes != size)
                                __builtin_trap();
                }
        return sum == 42 ? 0 : 0;
}
