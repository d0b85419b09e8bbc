/* SPDX-License-Identifier: LGPL-2.1-or-later */
/* Built without nvcc: no kernels. gpu_kernels_load() reports -EOPNOTSUPP and the copy
 * paths use the copy engine alone. */
#include <stddef.h>

__attribute__((visibility("hidden"))) const unsigned char epd_pack_fatbin[] = { 0 };
__attribute__((visibility("hidden"))) const size_t epd_pack_fatbin_size = 0;
