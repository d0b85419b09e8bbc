/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* CRC-32C (Castagnoli), as used by iSCSI, ext4 and LevelDB/RocksDB logs: the SSE4.2
 * instruction where the CPU has it, slicing-by-8 tables otherwise. Pure. */

#include <stddef.h>
#include <stdint.h>

/* Continues a CRC: start with crc = 0. crc32c("123456789") == 0xE3069283. */
uint32_t crc32c(uint32_t crc, const void *buf, size_t n);
/* The table implementation alone (tests check that both paths agree). */
uint32_t crc32c_portable(uint32_t crc, const void *buf, size_t n);
