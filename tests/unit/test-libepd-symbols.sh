#!/bin/sh
# SPDX-License-Identifier: LGPL-2.1-or-later
# libepd exports its public API (epd_*) and the few epd__* helpers that epdctl and the
# integration tests call (client/libepd.sym), nothing else: not the code of the static
# libraries it is built from (log_internal, cuda_*, gpu_*, feature_desc_*, ...), which
# would clash with a worker's own symbols. Usage: test-libepd-symbols.sh LIBEPD.so
set -u
lib=$1
command -v nm >/dev/null 2>&1 || { echo "SKIP: no nm"; exit 77; }
syms=$(nm -D --defined-only "$lib") || exit 1
# Each line: VALUE TYPE NAME[@VERSION]; the version node itself is an absolute symbol (A).
bad=$(printf '%s\n' "$syms" | awk '$2 != "A" { sub(/@.*/, "", $3); print $3 }' |
      grep -Ev '^epd_[A-Za-z0-9]' |
      grep -Evx 'epd__call|epd__new_call|epd__error|epd__clear_error|epd__feature_wait_signal')
n=$(printf '%s\n' "$syms" | awk '$2 != "A"' | wc -l)
if [ -n "$bad" ]; then
        echo "FAIL: $lib exports symbols outside its API:"
        printf '%s\n' "$bad"
        exit 1
fi
echo "$lib exports $n symbols, all of its API"
