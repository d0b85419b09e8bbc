#!/bin/bash
# SPDX-License-Identifier: LGPL-2.1-or-later
# The boot test's checks, run inside the booted container (real systemd as PID 1, a
# real system bus) by epd-boot-driver.service, with epd installed from the build
# (meson install --destdir, overlaid on /usr). Results go to /results: one line per
# check in "checks", a log in "driver.log", the journal in "journal.txt", and
# "status" (PASS or FAIL (n)). Sections are functions; add new ones at the end of
# main.
set -u
OUT=/results
T=/opt/epd-test
W=$T/epd-test-worker
SVC=epd.service
fails=0
exec >>"$OUT/driver.log" 2>&1

log()  { echo "[$(cut -d' ' -f1 /proc/uptime)] $*"; }
ok()   { log "PASS: $*"; echo "PASS: $*" >>"$OUT/checks"; }
bad()  { log "FAIL: $*"; echo "FAIL: $*" >>"$OUT/checks"; fails=$((fails + 1)); }
check() { local d=$1; shift; if "$@"; then ok "$d"; else bad "$d"; fi; }
# wait_for SECONDS COMMAND...: polls every 50 ms.
wait_for() {
        local end=$((SECONDS + $1)); shift
        until "$@"; do [ "$SECONDS" -ge "$end" ] && return 1; sleep 0.05; done
}
prop() { systemctl show -P "$1" "$SVC"; }
main_pid() { prop MainPID; }
active() { systemctl -q is-active "$SVC"; }
# Workers registered, as epdctl sees them over the given address.
workers() { epdctl -A "$1" --json status | sed -n 's/.*"workers":\([0-9]*\).*/\1/p'; }
workers_are() { [ "$(workers "$1")" = "$2" ]; }
# As uid nobody, with or without supplementary group epd.
as_member()   { setpriv --reuid=65534 --regid=65534 --groups="$EPD_GID" --inh-caps=-all "$@"; }
as_stranger() { setpriv --reuid=65534 --regid=65534 --clear-groups --inh-caps=-all "$@"; }

section_boot() {
        log "PID1=$(cat /proc/1/comm) virt=$(systemd-detect-virt) state=$(systemctl is-system-running)"
        check "dbus.service active" systemctl -q is-active dbus.service
        check "sysusers created user epd" getent passwd epd
        check "sysusers created group epd" getent group epd
        EPD_UID=$(id -u epd)
        EPD_GID=$(getent group epd | cut -d: -f3)
        check "epd.service is installed, disabled by preset" bash -c '[ "$(systemctl is-enabled epd.service)" = disabled ]'
        check "systemctl enable/disable epd ([Install])" \
                bash -c 'systemctl -q enable epd.service && [ -L /etc/systemd/system/multi-user.target.wants/epd.service ] && systemctl -q disable epd.service'
        check "the fd store is configured (FileDescriptorStoreMax=1024)" bash -c "[ \$(systemctl show -P FileDescriptorStoreMax $SVC) = 1024 ]"
        if [ -e "$T/sanitized" ]; then
                # LeakSanitizer's exit-time check needs ptrace(), which the unit's
                # SystemCallFilter= forbids (as it should): it would turn every clean
                # stop into exit status 1. Everything else of ASan/UBSan stays on.
                mkdir -p /run/systemd/system/$SVC.d
                printf '[Service]\nEnvironment=ASAN_OPTIONS=detect_leaks=0\n' \
                        >/run/systemd/system/$SVC.d/50-sanitizer.conf
                systemctl daemon-reload
                log "sanitized build: leak detection off inside the service"
        fi
        mkdir -p /etc/epd
        printf '[Daemon]\nHostId=boot-test\nLogLevel=debug\n' >/etc/epd/epd.conf
}

section_start() {
        check "systemctl start $SVC" timeout 60 systemctl start "$SVC"
        check "$SVC is active" active
        log "$(systemctl show -p Type,NotifyAccess,SubState,MainPID,StatusText,WatchdogUSec $SVC | tr '\n' ' ')"
        check "StatusText came from STATUS=" bash -c "systemctl show -P StatusText $SVC | grep -q '^Serving'"
        local pid; pid=$(main_pid)
        local st=/proc/$pid/status
        check "epdd runs as user and group epd" \
                bash -c "grep -qP '^Uid:\t$EPD_UID\t$EPD_UID\t$EPD_UID\t$EPD_UID$' $st && grep -qP '^Gid:\t$EPD_GID\t$EPD_GID\t$EPD_GID\t$EPD_GID$' $st"
        # CAP_IPC_LOCK (14), CAP_PERFMON (38), CAP_BPF (39), nothing else.
        local caps=000000c000004000
        check "capabilities are exactly CAP_BPF CAP_PERFMON CAP_IPC_LOCK" \
                bash -c "for c in CapPrm CapEff CapBnd CapAmb; do grep -qP \"^\$c:\t$caps\$\" $st || exit 1; done"
        check "NoNewPrivileges and a seccomp filter" bash -c "grep -qP '^NoNewPrivs:\t1$' $st && grep -qP '^Seccomp:\t2$' $st"
        # Nice=-10: field 19 of /proc/PID/stat (after the parenthesized name).
        check "epdd runs at nice -10 (Nice=)" bash -c "[ \"\$(sed 's/.*) //' /proc/$pid/stat | cut -d' ' -f17)\" = -10 ]"
        check "CPUWeight=1000" bash -c "[ \$(systemctl show -P CPUWeight $SVC) = 1000 ]"
        grep -E '^(Uid|Gid|Groups|Cap[A-Za-z]+|NoNewPrivs|Seccomp):' "$st"
        check "/run/epd is 0750 epd:epd (RuntimeDirectory=)" bash -c '[ "$(stat -c "%a %U %G" /run/epd)" = "750 epd epd" ]'
        check "/run/epd/bus is a socket 0660 epd:epd" \
                bash -c '[ -S /run/epd/bus ] && [ "$(stat -c "%a %U %G" /run/epd/bus)" = "660 epd epd" ]'
        check "/var/lib/epd is 0750 epd:epd (StateDirectory=)" bash -c '[ "$(stat -c "%a %U %G" /var/lib/epd)" = "750 epd epd" ]'
        # The sandbox as the kernel shows it: mount options in epdd's own namespace.
        local mi=/proc/$pid/mountinfo
        # (No awk here: /usr/bin/awk is an /etc/alternatives link, and /etc is empty.)
        mount_opts() {
                local _id _parent _dev _root mp opts _rest o=""
                while read -r _id _parent _dev _root mp opts _rest; do
                        [ "$mp" = "$1" ] && o=$opts
                done <"$mi"
                echo "$o"
        }
        local m; for m in / /tmp /home /root /run/epd /var/lib/epd; do log "epdd's mount $m: $(mount_opts $m)"; done
        check "ProtectSystem=strict: / is read-only for epdd" bash -c "[[ '$(mount_opts /)' == ro* ]]"
        check "StateDirectory= and RuntimeDirectory= are writable" \
                bash -c "[[ '$(mount_opts /var/lib/epd)' == rw* ]] && [[ '$(mount_opts /run/epd)' == rw* ]]"
        check "PrivateTmp=: epdd has its own /tmp" bash -c "[ -n '$(mount_opts /tmp)' ] && [ '$(stat -L -c %i /proc/$pid/root/tmp)' != '$(stat -c %i /tmp)' ]"
        check "ProtectHome=: /home and /root are inaccessible" \
                bash -c "[ -n '$(mount_opts /home)' ] && [ -n '$(mount_opts /root)' ]"
        check "PID 1 applied the device policy" \
                bash -c "[ \"\$(systemctl show -P DevicePolicy $SVC)\" = closed ] && systemctl show -P DeviceAllow $SVC | grep -q 'char-nvidia\*'"
}

section_bus() {
        check "org.epd1 is owned by a process of $SVC" bash -c "busctl --system status org.epd1 | grep -qx 'Unit=$SVC'"
        check "org.epd1 answers on the system bus (HostId from /etc/epd/epd.conf)" \
                bash -c "busctl --system get-property org.epd1 /org/epd1 org.epd1.Manager HostId | grep -qx 's \"boot-test\"'"
        # The kernel telemetry loads with exactly the unit's capabilities and system calls
        # (nspawn, like a host, lets bpf() and perf_event_open() through here).
        local tel why
        tel=$(busctl --system get-property org.epd1 /org/epd1/telemetry org.epd1.Telemetry KernelTelemetry)
        why=$(busctl --system get-property org.epd1 /org/epd1/telemetry org.epd1.Telemetry KernelTelemetryUnavailable)
        log "telemetry: $tel, unavailable: $why, pins: $(busctl --system get-property org.epd1 /org/epd1/telemetry org.epd1.Telemetry PinDirectory)"
        check "BPF telemetry loads inside the sandbox (CAP_BPF, CAP_PERFMON, bpf, perf_event_open)" \
                bash -c "[ '$tel' = 'b true' ]"
        check "epdctl status over the system bus" epdctl -A system status
        check "epdctl status over the direct socket" epdctl -A direct:/run/epd/bus status
        check "epdctl --json status by default (the direct socket)" \
                bash -c "epdctl --json status | grep -q '\"host_id\":\"boot-test\"'"
}

section_workers() {
        check "root registers a worker over the system bus" "$W" system prefill
        check "root registers a worker over the direct socket" "$W" direct:/run/epd/bus decode

        # A worker that holds its registration, then dies with SIGKILL.
        "$W" --hold default colocated >"$OUT/holder.out" 2>&1 &
        local holder=$!
        check "holding worker registered (libepd's default address)" wait_for 20 grep -qx holding "$OUT/holder.out"
        check "epdctl sees 1 worker over the direct socket" workers_are direct:/run/epd/bus 1
        check "epdctl sees 1 worker over the system bus" workers_are system 1
        epdctl workers
        kill -KILL "$holder"
        wait "$holder" 2>/dev/null
        check "a worker killed with SIGKILL is released" wait_for 10 workers_are system 0

        # Group epd: both ways in. Everyone else: no socket, and no calls on the bus.
        check "a member of group epd registers over the direct socket" as_member "$W" direct:/run/epd/bus encoder
        check "a member of group epd registers over the system bus" as_member "$W" system encoder
        local out
        out=$(as_stranger "$W" direct:/run/epd/bus encoder)
        check "a non-member cannot connect to the direct socket ($out)" \
                bash -c "[[ '$out' == 'error connect EACCES'* ]]"
        out=$(as_stranger "$W" system encoder)
        check "the bus denies RegisterWorker to a non-member ($out)" \
                bash -c "[[ '$out' == *'org.freedesktop.DBus.Error.AccessDenied' ]]"
        check "a non-member may read properties (epdctl status over the bus)" as_stranger epdctl -A system status
        check "a non-member's default address falls back to the bus" as_stranger epdctl status
        check "no worker left behind" workers_are system 0
}

section_polkit() {
        if ! command -v pkaction >/dev/null; then
                log "pkaction is not installed: polkit actions not checked"
                return
        fi
        for a in org.epd1.manage org.epd1.manage-clients org.epd1.manage-cache org.epd1.manage-peers; do
                check "polkit knows $a" timeout 20 pkaction --action-id "$a"
        done
}

section_reload() {
        local pid; pid=$(main_pid)
        printf '[Daemon]\nHostId=boot-test\nLogLevel=info\n' >/etc/epd/epd.conf
        check "systemctl reload $SVC" timeout 30 systemctl reload "$SVC"
        check "still active after reload, same main pid" bash -c "systemctl -q is-active $SVC && [ \$(systemctl show -P MainPID $SVC) = $pid ]"
        check "epdd reloaded its configuration" \
                wait_for 5 bash -c "journalctl -b -u $SVC -o cat | grep -q 'Configuration reloaded'"
}

section_watchdog() {
        # A short watchdog, to see it work within seconds: pings keep the service up,
        # a stopped loop gets it killed and restarted (Restart=on-failure).
        mkdir -p /run/systemd/system/$SVC.d
        printf '[Service]\nWatchdogSec=1s\nLimitCORE=0\n' >/run/systemd/system/$SVC.d/60-watchdog.conf
        systemctl daemon-reload
        check "restart with WatchdogSec=1s" timeout 60 systemctl restart "$SVC"
        local t0 pid; t0=$(prop WatchdogTimestampMonotonic); pid=$(main_pid)
        sleep 2.5
        check "pings keep it running past the watchdog period" \
                bash -c "systemctl -q is-active $SVC && [ \$(systemctl show -P MainPID $SVC) = $pid ] && [ \$(systemctl show -P NRestarts $SVC) = 0 ]"
        check "systemd received WATCHDOG=1" bash -c "[ \$(systemctl show -P WatchdogTimestampMonotonic $SVC) -gt $t0 ]"
        kill -STOP "$pid"
        check "a stuck loop is killed by the watchdog and restarted" \
                wait_for 30 bash -c "systemctl -q is-active $SVC && [ \$(systemctl show -P NRestarts $SVC) = 1 ] && [ \$(systemctl show -P MainPID $SVC) != $pid ]"
        check "the journal names the watchdog" bash -c "journalctl -b -u $SVC -o cat | grep -q 'Watchdog timeout'"
        rm -f /run/systemd/system/$SVC.d/60-watchdog.conf
        systemctl daemon-reload
}

# Restart without loss (docs/wal.md): a worker commits a sequence and caches a feature,
# stays connected, and `systemctl restart` replaces epdd under it; the arenas come back
# from the fd store (FileDescriptorStoreMax=), the WAL gives back the page table and the
# feature index, and a new process Attaches the sequence and hits the feature.
section_restart() {
        "$W" --state-put direct:/run/epd/bus >"$OUT/state.out" 2>&1 &
        local holder=$! seq pid
        check "a worker commits a sequence and caches a feature" wait_for 20 grep -q '^holding ' "$OUT/state.out"
        seq=$(sed -n 's/^holding //p' "$OUT/state.out")
        pid=$(main_pid)
        check "systemctl restart $SVC with a committed sequence and a cached feature" \
                timeout 60 systemctl restart "$SVC"
        kill -KILL "$holder" 2>/dev/null
        wait "$holder" 2>/dev/null
        check "a new epdd serves" bash -c "systemctl -q is-active $SVC && [ \$(systemctl show -P MainPID $SVC) != $pid ]"
        check "the new epdd restored the sequence from the WAL" \
                bash -c "journalctl -b -u $SVC -o cat | grep -q ' sequences restored'"
        # The worker ran through the restart: systemd kept its pidfd in the fd store, and
        # the new epdd fenced the restored feature arena until it exited (docs/wal.md).
        check "the new epdd waited for the worker of before the restart" \
                bash -c "journalctl -b -u $SVC -o cat | grep -q 'worker process(es) of before the restart still run'"
        check "and ended the wait once that worker exited" \
                wait_for 15 bash -c "journalctl -b -u $SVC -o cat | grep -q 'Restored feature arenas unfenced: every worker'"
        "$W" --state-check direct:/run/epd/bus "$seq" >"$OUT/state-check.out" 2>&1
        log "state check: $(cat "$OUT/state-check.out")"
        check "sequence $seq and the feature survived systemctl restart, byte for byte" \
                grep -qx 'state ok' "$OUT/state-check.out"
}

section_stop() {
        check "systemctl stop $SVC" timeout 60 systemctl stop "$SVC"
        check "$SVC inactive after stop" bash -c "! systemctl -q is-active $SVC"
        check "clean exit: Result=success, status 0" \
                bash -c "[ \$(systemctl show -P Result $SVC) = success ] && [ \$(systemctl show -P ExecMainStatus $SVC) = 0 ]"
        check "org.epd1 released" bash -c "! busctl --system status org.epd1 >/dev/null 2>&1"
        check "/run/epd removed" bash -c "[ ! -e /run/epd ]"
        check "no process of user epd left" bash -c "! pgrep -u epd >/dev/null"
}

# Pinned telemetry maps under the unit: with a bpffs at /sys/fs/bpf (the test binds one,
# mounted mode=700 as systemd mounts it on a host), epdd pins under /sys/fs/bpf/epd;
# without one, epdd says exactly why not.
section_pins() {
        local pid pins; pid=$(main_pid)
        pins=$(busctl --system get-property org.epd1 /org/epd1/telemetry org.epd1.Telemetry PinDirectory)
        log "/sys/fs/bpf: $(stat -f -c %T /sys/fs/bpf) $(stat -c '%a %U' /sys/fs/bpf); PinDirectory $pins"
        log "journal: $(journalctl -b --no-pager -u $SVC -o cat | grep -iE 'pin|telemetry|bpf' | tail -n 4 | tr '\n' '|')"
        log "epdd's bpf mounts: $(grep -E 'bpf' /proc/$pid/mountinfo | tr '\n' '|'); PID 1's: $(grep -E 'bpf' /proc/1/mountinfo | tr '\n' '|'); mine: $(grep -E 'bpf' /proc/self/mountinfo | tr '\n' '|')"
        # ProtectKernelTunables= is spelled out in the unit (see there): /sys and /proc/sys
        # stay read-only for epdd.
        local m mp opts ro=yes
        for m in /sys /proc/sys; do
                opts=""
                while read -r _ _ _ _ mp opts _; do [ "$mp" = "$m" ] && break; opts=""; done <"/proc/$pid/mountinfo"
                log "epdd's mount $m: $opts"
                [[ "$opts" == ro* ]] || ro=no
        done
        check "/sys and /proc/sys are read-only for epdd" [ "$ro" = yes ]
        if [ -e "$T/bpffs" ]; then
                check "/sys/fs/bpf/epd was made for user epd before the start (0750 epd:epd)" \
                        bash -c '[ "$(stat -c "%a %U %G" /sys/fs/bpf/epd)" = "750 epd epd" ]'
                check "epdd pinned its maps under /sys/fs/bpf/epd (PinDirectory)" \
                        bash -c "[ '$pins' = 's \"/sys/fs/bpf/epd\"' ]"
                check "the pins are on the host's bpffs: tracked, conns, settings, counters" \
                        bash -c 'for m in tracked conns settings counters; do [ -e /sys/fs/bpf/epd/$m ] || exit 1; done'
                if command -v bpftool >/dev/null; then
                        check "a tool reads the pinned maps without the daemon (bpftool)" \
                                bash -c 'bpftool -j map show pinned /sys/fs/bpf/epd/conns | grep -q "\"name\":\"conns\""'
                fi
                check "epdd sees /sys/fs/bpf as a cover directory (on /run), /sys/fs/bpf/epd as the bpffs" \
                        bash -c "[ \"\$(stat -f -c %T /proc/$pid/root/sys/fs/bpf)\" = tmpfs ] && [ \"\$(stat -f -c %T /proc/$pid/root/sys/fs/bpf/epd)\" = bpf_fs ]"
        else
                check "no bpffs: epdd logs precisely why the maps are not pinned" \
                        bash -c "journalctl -b --no-pager -u $SVC -o cat | grep -qE 'Cannot pin telemetry maps: .*(bpf filesystem|No such file or directory)'"
                check "no bpffs: PinDirectory is empty" bash -c "[ '$pins' = 's \"\"' ]"
        fi
}

section_pins_gone() {
        [ -e "$T/bpffs" ] || return 0
        check "stopping unpins the maps (the directory stays for the next start)" \
                bash -c '[ -d /sys/fs/bpf/epd ] && [ -z "$(ls -A /sys/fs/bpf/epd)" ]'
}

section_activation() {
        check "a call to org.epd1 starts $SVC (D-Bus activation)" \
                timeout 60 busctl --system get-property org.epd1 /org/epd1 org.epd1.Manager Version
        check "$SVC active after activation" active
}

main() {
        date +%s%N >"$OUT/t_driver_start"
        section_boot
        section_start
        section_bus
        section_pins
        section_workers
        section_polkit
        section_reload
        section_watchdog
        section_restart
        section_stop
        section_pins_gone
        section_activation
        section_stop
        systemctl --no-pager --failed
        [ "$fails" -eq 0 ] || journalctl -b --no-pager -o short-monotonic -u "$SVC" | tail -n 80
        journalctl -b --no-pager -o short-monotonic >"$OUT/journal.txt" 2>&1
        if [ "$fails" -eq 0 ]; then echo PASS >"$OUT/status"; else echo "FAIL ($fails)" >"$OUT/status"; fi
        log "driver end: $fails failure(s)"
        date +%s%N >"$OUT/t_driver_end"
        [ "$fails" -eq 0 ]
}

main
