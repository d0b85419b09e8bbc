# SPDX-License-Identifier: LGPL-2.1-or-later
# Sourced by the GPU machine's scripts (bench/gpu/run-device.sh, bench/e2e/run-device.sh)
# from the repository root ($ROOT): nvcc on PATH, meson as MESON=(...), and the
# development files the machine may lack (it has libsystemd.so.0 but no headers, and no
# check): a folder with include/ and lib/pkgconfig/ (libsystemd.pc, check.pc), made by
# scripts/device-sysroot.sh and carried as .device/sysroot (EPD_DEVICE_SYSROOT
# overrides); see docs/gpu.md.
for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do
        [ -x "$d/nvcc" ] && case ":$PATH:" in *":$d:"*) ;; *) PATH=$PATH:$d ;; esac
done
export PATH
if command -v meson >/dev/null; then MESON=(meson); else MESON=(python3 -m mesonbuild.mesonmain); fi
SYSROOT=${EPD_DEVICE_SYSROOT:-$ROOT/.device/sysroot}
if ! pkg-config --exists libsystemd && [ -d "$SYSROOT/lib/pkgconfig" ]; then
        lib=$(ldconfig -p | awk '/libsystemd\.so\.0 .*x86-64/ {print $NF; exit}')
        [ -n "$lib" ] && ln -sf "$lib" "$SYSROOT/lib/libsystemd.so"
        export PKG_CONFIG_PATH=$SYSROOT/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
        echo "using development files from $SYSROOT (libsystemd: $lib)"
fi
