#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# Assembles the development files a GPU machine without them needs to build epd and its
# tests (docs/gpu.md): libsystemd's headers and a pkg-config file that links the
# machine's own libsystemd.so.0, and check (headers + static libraries, with subunit).
# Run it on a Debian/Ubuntu x86-64 machine that has libsystemd-dev and check installed
# (scripts/install-deps.sh); it writes DIR (default .device/sysroot, which git ignores).
# The device scripts find it as EPD_DEVICE_SYSROOT or .device/sysroot.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.device/sysroot}
libdir=$(pkg-config --variable=libdir libsystemd)
incdir=$(pkg-config --variable=includedir libsystemd)
rm -rf "$dir"
mkdir -p "$dir/include" "$dir/lib/pkgconfig"
cp -r "$incdir/systemd" "$dir/include/"
cp "$incdir/check.h" "$dir/include/"
[ -f "$incdir/check_stdint.h" ] && cp "$incdir/check_stdint.h" "$dir/include/"
cp "$libdir/libcheck_pic.a" "$libdir/libsubunit.a" "$dir/lib/"
cat >"$dir/lib/pkgconfig/libsystemd.pc" <<PC
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: systemd
Description: systemd Library (headers carried; the machine's libsystemd.so.0)
Version: $(pkg-config --modversion libsystemd)
Libs: -L\${libdir} -lsystemd
Cflags: -I\${includedir}
PC
cat >"$dir/lib/pkgconfig/check.pc" <<PC
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: Check
Description: A unit test framework for C (static, carried)
Version: $(pkg-config --modversion check)
Libs: \${libdir}/libcheck_pic.a \${libdir}/libsubunit.a -lrt -lm -pthread
Cflags: -I\${includedir} -pthread
PC
echo "$dir: $(du -sh "$dir" | cut -f1)"
