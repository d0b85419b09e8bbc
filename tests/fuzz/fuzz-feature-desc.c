/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Fuzzes the FeatureBundle descriptor parser (the `ay` of org.epd1.Feature.Reserve and
 * the descriptor inside every store file). Whatever the bytes, parsing either fails
 * with a named error or yields a descriptor that validates, serializes, and parses
 * back to the same thing. The region size comes from the input too. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/feature-desc.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
        static const uint64_t regions[] = { 0, 4096, 1ull << 30, UINT64_MAX };
        uint64_t region = regions[size % 4];

        for (int pass = 0; pass < 2; pass++, region = UINT64_MAX) {
                FeatureDesc *d = NULL, *back = NULL;
                FeatureDescIssue issue;
                void *bin = NULL;
                size_t bin_size;
                char text[256];

                int r = feature_desc_parse(data, size, region, &d, &issue);
                feature_desc_issue_format(&issue, d, text, sizeof text);
                if (r < 0) {
                        if (d || issue.error == FEATURE_DESC_OK ||
                            !feature_desc_error_to_string(issue.error))
                                abort();
                        continue;
                }
                if (feature_desc_validate(d, region, NULL) < 0)
                        abort();
                for (size_t i = 0; i < d->n_tensors; i++) {
                        uint64_t span;
                        if (feature_tensor_span(&d->tensors[i], &span) < 0 ||
                            (span > 0 && d->tensors[i].offset + span > region))
                                abort();
                }
                if (feature_desc_serialize(d, &bin, &bin_size) < 0 || bin_size != size ||
                    memcmp(bin, data, size) != 0)
                        abort(); /* the binary form is canonical */
                if (feature_desc_parse(bin, bin_size, region, &back, NULL) < 0 ||
                    back->n_tensors != d->n_tensors ||
                    memcmp(back->tensors, d->tensors, d->n_tensors * sizeof(FeatureTensor)) != 0)
                        abort();
                free(bin);
                feature_desc_free(back);
                feature_desc_free(d);
        }
        return 0;
}
