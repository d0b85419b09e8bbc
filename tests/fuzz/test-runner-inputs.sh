#!/bin/sh
# SPDX-License-Identifier: LGPL-2.1-or-later
# The fuzz runner feeds every stored input of a directory, not the first alone (it ran
# only the first of each directory, and the suite's fuzz tests the rest never).
#   test-runner-inputs.sh RUNNER SEED_DIR
set -eu
runner=$1
dir=$2
n=$(find "$dir" -mindepth 1 -maxdepth 1 -type f ! -name '.*' | wc -l)
out=$("$runner" --mutations 0 "$dir")
echo "$out"
case "$out" in
"$n inputs "*) exit 0 ;;
esac
echo "expected $n inputs of $dir" >&2
exit 1
