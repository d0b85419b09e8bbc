#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
# Embeds the pack/unpack fatbin built by nvcc into a C source file.
import sys

data = open(sys.argv[1], 'rb').read()
with open(sys.argv[2], 'w') as f:
    f.write('/* Generated from %s by gpu/embed-fatbin.py. Do not edit. */\n' % sys.argv[1].split('/')[-1])
    f.write('#include <stddef.h>\n\n')
    # Aligned: cuModuleLoadData reads the fatbin header in place.
    # Hidden: a program that links this library and libepd.so (which holds a copy too)
    # keeps two separate copies instead of one interposing the other.
    f.write('__attribute__((visibility("hidden"))) const unsigned char epd_pack_fatbin[] __attribute__((aligned(8))) = {\n')
    for i in range(0, len(data), 16):
        f.write('        ' + ', '.join('0x%02x' % b for b in data[i:i + 16]) + ',\n')
    f.write('};\n')
    f.write('__attribute__((visibility("hidden"))) const size_t epd_pack_fatbin_size = sizeof(epd_pack_fatbin);\n')
