/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes workflow record decoding and application: WAL payloads come from disk. The
 * input is a sequence of records, each prefixed with a 16-bit little-endian length. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "workflow/workflow.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int no_clone(void *u, const EpdId *s, size_t n, EpdId *r, void **put, size_t *put_len) {
        return -ESTALE;
}
static int no_release(void *u, const EpdId *s) {
        return -ENOENT;
}
static int no_check(void *u, const EpdId *s, size_t *p, size_t *b) {
        return -ESTALE;
}

/* The sequence part of a record reaches the pages only once it is well-formed. */
static int check_sequence(void *u, bool put, const void *p, size_t n) {
        if (!put && n != 16)
                __builtin_trap();
        return put ? 0 : -ENOENT;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        WorkflowOps ops = { .clone = no_clone, .release = no_release, .check = no_check,
                            .apply_sequence = check_sequence };
        WorkflowManager *wm;

        if (workflow_manager_new(&ops, 16, &wm) < 0)
                return 0;
        while (size >= 2) {
                size_t n = (size_t)data[0] | (size_t)data[1] << 8;
                data += 2;
                size -= 2;
                n = n < size ? n : size;
                (void)workflow_apply_record(wm, data, n);
                data += n;
                size -= n;
        }
        workflow_manager_free(wm);
        return 0;
}
