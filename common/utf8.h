/* SPDX-License-Identifier: LGPL-2.1-or-later */
#pragma once

/* Text from outside (clients, peers, etcd) that goes out again as a D-Bus string, which
 * must be valid UTF-8: after a cut at a byte count (`%.48s`), a multibyte character may
 * be split, and sd-bus then refuses the whole message. */

/* Makes s valid UTF-8 of printable text in place: each byte of an invalid, overlong or
 * cut-off sequence, and each control character, becomes '?' (the length stays). */
void utf8_make_valid(char *s);
