#!/bin/sh
# SPDX-License-Identifier: LGPL-2.1-or-later
# Every public header of libepd (client/include/epd/*.h) compiles on its own as C99 and
# as C++17: workers include them from C++ too. Usage: test-libepd-headers.sh INCLUDE_DIR
# CC [CXX]; without a C++ compiler the C++ half is skipped (exit 77 after the C half).
set -u
inc=$1
cc=$2
cxx=${3:-}
fail=0
for h in "$inc"/epd/*.h; do
        name=epd/$(basename "$h")
        if ! printf '#include "%s"\n' "$name" |
                "$cc" -std=c99 -fsyntax-only -Wall -Wextra -Werror -I"$inc" -x c - ; then
                echo "FAIL: $name does not compile as C99"
                fail=1
        fi
done
if [ -z "$cxx" ] || ! command -v "$cxx" >/dev/null 2>&1; then
        [ "$fail" = 0 ] || exit 1
        echo "SKIP: no C++ compiler: the headers were not compiled as C++"
        exit 77
fi
for h in "$inc"/epd/*.h; do
        name=epd/$(basename "$h")
        if ! printf '#include "%s"\n' "$name" |
                "$cxx" -std=c++17 -fsyntax-only -Wall -Wextra -Werror -I"$inc" -x c++ - ; then
                echo "FAIL: $name does not compile as C++17"
                fail=1
        fi
done
[ "$fail" = 0 ] && echo "every header of $inc/epd compiles as C99 and C++17"
exit $fail
