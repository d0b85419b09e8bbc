#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# epd under real systemd: boots systemd (from this machine's /usr) in a throw-away
# systemd-nspawn container with a volatile root, with epd installed into it (this
# build's `meson install --destdir` tree overlaid on the container's /usr: unit,
# sysusers, tmpfiles, bus policy, activation file, polkit actions, epdd, epdctl,
# libepd), and runs boot/driver.sh there as a oneshot unit: systemctl start, the name
# on the system bus, the sandbox as the kernel sees it, workers through libepd over
# the bus and the direct socket, group epd and strangers, reload, the watchdog and
# Restart=, stop, D-Bus activation. The container ends itself with the result.
#
# Exit: 0 all checks passed; 1 a check failed or something was left behind; 77 this
# machine cannot boot a container at all (said why; checked with a bare boot).
# Artefacts of the last run stay in $BUILD_ROOT/test-boot.last/.
set -u
SRC=${SOURCE_ROOT:?SOURCE_ROOT is set by meson}
: "${BUILD_ROOT:?BUILD_ROOT is set by meson}"
MESON=${MESON:-meson}
LIMIT=${EPD_BOOT_LIMIT:-180}     # backstop for one boot, seconds (a run takes 20-50 s here)

skip() { echo "SKIP: $*"; exit 77; }
fail() { echo "FAIL: $*"; exit 1; }

[ "$(id -u)" = 0 ] || skip "systemd-nspawn needs root"
command -v systemd-nspawn >/dev/null || skip "systemd-nspawn is not installed (package systemd-container)"
[ -x /usr/lib/systemd/systemd ] || skip "systemd is not installed in /usr"
[ -x /usr/bin/dbus-daemon ] || [ -x /usr/bin/dbus-broker ] || skip "no D-Bus broker is installed"
command -v setpriv >/dev/null || skip "setpriv (util-linux) is not installed"
[ -x "${EPD_TEST_WORKER:-}" ] || fail "EPD_TEST_WORKER is not set to the built epd-test-worker"

WORK=$(mktemp -d "$BUILD_ROOT/test-boot.XXXXXX")
NAME=epd-boot-$$-$RANDOM
CGDIRS=()
BOOT_PID=
cleanup() {
        local d p
        # Interrupted while the container runs: SIGTERM makes nspawn halt it cleanly.
        if [ -n "$BOOT_PID" ] && kill -0 "$BOOT_PID" 2>/dev/null; then
                kill -TERM "$BOOT_PID" 2>/dev/null
                for _ in $(seq 50); do kill -0 "$BOOT_PID" 2>/dev/null || break; sleep 0.2; done
        fi
        # Whatever is still in this run's cgroups was started by this run: end it by pid.
        for d in "${CGDIRS[@]}"; do
                find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null |
                        while read -r p; do kill -KILL "$p" 2>/dev/null; done
        done
        for d in "${CGDIRS[@]}"; do
                for _ in 1 2 3 4 5 6 7 8 9 10; do
                        find "$d" -depth -type d -exec rmdir {} + 2>/dev/null
                        [ -d "$d" ] || break
                        sleep 0.2
                done
        done
        # nspawn's mount-propagation directory, left behind when nspawn was killed.
        rmdir "/run/systemd/nspawn/propagate/$NAME" 2>/dev/null
        umount "$WORK/bpffs" 2>/dev/null
        rm -rf "$WORK/dest"
        rm -rf "$BUILD_ROOT/test-boot.last"
        mv "$WORK" "$BUILD_ROOT/test-boot.last" 2>/dev/null || rm -rf "$WORK"
}
trap cleanup EXIT
# A signal (meson's timeout, ^C) ends the run through cleanup, which ends nspawn and
# the container by pid (they are in this run's cgroups).
trap 'echo "interrupted"; exit 130' INT TERM

"$MESON" install -C "$BUILD_ROOT" --destdir "$WORK/dest" --no-rebuild --quiet >"$WORK/install.log" 2>&1 ||
        { cat "$WORK/install.log"; fail "meson install --destdir"; }
[ -x "$WORK/dest/usr/libexec/epdd" ] && [ -f "$WORK/dest/usr/lib/systemd/system/epd.service" ] ||
        fail "the install tree lacks /usr/libexec/epdd or /usr/lib/systemd/system/epd.service (prefix must be /usr)"

# What the container gets besides the install: the driver, its unit, the preset, the
# test worker, and whether this is a sanitizer build.
mkdir -p "$WORK/opt" "$WORK/results"
cp "$SRC/tests/integration/boot/driver.sh" "$EPD_TEST_WORKER" "$WORK/opt/"
case "${B_SANITIZE:-none}" in none | "") ;; *) touch "$WORK/opt/sanitized" ;; esac

# A bpf filesystem for the container's /sys/fs/bpf, mounted as systemd mounts it on a
# host (mode=700, root): systemd does not mount one inside a container, and the unit's
# pinning setup is what is tested (the driver's section_pins). Without one, the driver
# checks that epdd says why it does not pin.
BPF_ARGS=()
mkdir -p "$WORK/bpffs"
# (EPD_BOOT_NO_BPFFS=1: boot without one, to see that path.)
if [ -z "${EPD_BOOT_NO_BPFFS:-}" ] && mount -t bpf -o mode=700 bpf "$WORK/bpffs" 2>"$WORK/bpffs.err"; then
        BPF_ARGS=(--bind="$WORK/bpffs:/sys/fs/bpf")
        touch "$WORK/opt/bpffs"
else
        echo "no bpffs for the container ($(cat "$WORK/bpffs.err")): checking that epdd says why it does not pin"
fi

# A cgroup of its own for this run (in every hierarchy that nspawn uses here), so
# that nspawn's payload/supervisor cgroups (--keep-unit) never collide with another
# run's and anything left over can be found and ended.
while IFS=: read -r _ ctrl path; do
        case "$ctrl" in
        name=systemd) h=/sys/fs/cgroup/systemd ;;
        "") if [ -d /sys/fs/cgroup/unified ]; then h=/sys/fs/cgroup/unified; else h=/sys/fs/cgroup; fi ;;
        *) continue ;;
        esac
        [ -f "$h$path/cgroup.procs" ] || continue
        mkdir "$h${path%/}/$NAME" && CGDIRS+=("$h${path%/}/$NAME")
done </proc/self/cgroup

# boot LIMIT RESULTS-DIR [extra nspawn args...] -- [kernel command line...]
# Runs in the background and waits, so that a trapped signal is handled at once.
boot() {
        local limit=$1 res=$2; shift 2
        local args=() cmdline=()
        while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
        shift
        cmdline=("$@")
        (
                for d in "${CGDIRS[@]}"; do echo "$BASHPID" >"$d/cgroup.procs"; done
                exec env TERM=dumb SYSTEMD_COLORS=0 timeout -k 15 "$limit" \
                        systemd-nspawn --quiet -D / --volatile=yes -M "$NAME" \
                        --register=no --keep-unit --private-network --console=read-only \
                        --capability=CAP_BPF,CAP_PERFMON,CAP_IPC_LOCK,CAP_NET_ADMIN \
                        --system-call-filter="bpf perf_event_open" \
                        --bind="$res:/results" "${args[@]}" \
                        -b -- systemd.firstboot=off systemd.unit=multi-user.target "${cmdline[@]}" \
                        </dev/null >"$res/console.log" 2>&1
        ) &
        BOOT_PID=$!
        wait "$BOOT_PID"
        local rc=$?
        BOOT_PID=
        return "$rc"
}

t0=$(date +%s%N)
boot "$LIMIT" "$WORK/results" \
        --overlay-ro="/usr:$WORK/dest/usr:/usr" \
        --bind-ro="$WORK/opt:/opt/epd-test" "${BPF_ARGS[@]}" \
        --bind-ro="$SRC/tests/integration/boot/epd-boot-driver.service:/etc/systemd/system/epd-boot-driver.service" \
        --bind-ro="$SRC/tests/integration/boot/00-epd-boot.preset:/etc/systemd/system-preset/00-epd-boot.preset" \
        -- systemd.wants=epd-boot-driver.service
rc=$?
t1=$(date +%s%N)
R=$WORK/results
status=$(cat "$R/status" 2>/dev/null || echo MISSING)

ms() { echo "$((($2 - $1) / 1000000)) ms"; }
echo "container exit status: $rc after $(ms "$t0" "$t1")"
[ -s "$R/t_driver_start" ] && [ -s "$R/t_driver_end" ] &&
        echo "boot to driver $(ms "$t0" "$(cat "$R/t_driver_start")"), checks $(ms "$(cat "$R/t_driver_start")" "$(cat "$R/t_driver_end")")"
[ -f "$R/checks" ] && sed 's/^/    /' "$R/checks"

# Anything still in this run's cgroups after nspawn returned is a leftover.
sleep 0.3
left=""
for d in "${CGDIRS[@]}"; do
        p=$(find "$d" -name cgroup.procs -exec cat {} + 2>/dev/null | tr '\n' ' ')
        [ -n "${p// /}" ] && left="$left $d: $p"
done

if [ ! -s "$R/t_driver_start" ]; then
        # The driver never ran. Either nspawn cannot boot here at all (skip), or epd's
        # additions broke the boot (fail): a bare boot tells which.
        echo "--- console (last 40 lines)"; tail -n 40 "$R/console.log"
        mkdir -p "$WORK/bare"
        boot 60 "$WORK/bare" -- systemd.unit=poweroff.target
        brc=$?
        [ "$brc" -eq 0 ] || { echo "--- bare boot console"; tail -n 20 "$WORK/bare/console.log";
                             skip "systemd-nspawn cannot boot a container here (bare boot: exit $brc)"; }
        fail "a bare container boots, but the one with epd installed did not reach the driver (exit $rc)"
fi
if [ "$status" != PASS ] || [ "$rc" -ne 0 ]; then
        echo "--- driver log (last 120 lines)"; tail -n 120 "$R/driver.log"
        [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && fail "the container ran past ${LIMIT}s"
        fail "status $status, container exit $rc"
fi
[ -z "$left" ] || fail "left behind:$left"
echo "PASS: epd under systemd ($(grep -c '^PASS' "$R/checks") checks)"
