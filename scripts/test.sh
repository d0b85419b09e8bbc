#!/bin/bash
# The whole test suite: installs dependencies, builds warning-free with -Werror, and
# runs every test under ASan+UBSan (unit, integration, fuzz regressions, systemd
# boot). Tests that need something this machine lacks exit 77 and say why.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

# 1. A plain optimized build must be warning-free (-Werror).
if [ ! -d build-release ]; then
        meson setup build-release -Dbuildtype=release -Dwerror=true >/dev/null
fi
ninja -C build-release

# 2. Everything again under the sanitizers, and every test run there.
if [ ! -d build-asan ]; then
        meson setup build-asan -Dbuildtype=debug -Dwerror=true -Db_sanitize=address,undefined \
                -Db_lundef=false >/dev/null
fi
ninja -C build-asan
rc=0
meson test -C build-asan --print-errorlogs --num-processes 2 "$@" || rc=$?

# The closing line, counted from meson's own log.
python3 - build-asan/meson-logs/testlog.json <<'PY'
import json, sys
n = {"OK": 0, "FAIL": 0, "SKIP": 0}
for line in open(sys.argv[1]):
    r = json.loads(line).get("result", "")
    if r in ("OK", "EXPECTEDFAIL"):
        n["OK"] += 1
    elif r == "SKIP":
        n["SKIP"] += 1
    else:
        n["FAIL"] += 1
print(f"tests: {n['OK']} passed, {n['FAIL']} failed, {n['SKIP']} skipped")
PY
exit $rc
