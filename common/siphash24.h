/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

#include <stddef.h>
#include <stdint.h>

/* SipHash-2-4 (Aumasson & Bernstein), keyed with 16 bytes: the hash tables use it
 * with a random per-process key so that keys chosen by clients cannot force
 * collisions. It is a table hash, not a MAC: peer authentication uses libcrypto. */
uint64_t siphash24(const void *in, size_t len, const uint8_t k[16]);
