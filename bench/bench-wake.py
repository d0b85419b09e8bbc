#!/usr/bin/env python3
# SPDX-License-Identifier: LGPL-2.1-or-later
"""Wake-up latency of this machine: a ping-pong of 8 bytes over a socketpair between two
processes, back to back and after an idle gap of 20 and 200 ms (P50 and P90), first as
is, then while a PM QoS request (/dev/cpu_dma_latency, 0 then 20 us) is held (the request
ends with the fd: nothing stays changed), then with the answering process spinning
instead of sleeping. What a bus call costs after a worker or epdd sat idle (an encoder
between requests at one in flight): bench/RESULTS.md, 2026-12-07 01:15 UTC.

    sudo python3 bench/bench-wake.py    (about 45 s; root only for the PM QoS rows)
"""
import os, socket, struct, sys, time, glob, statistics

def info():
    def rd(p):
        try:
            return open(p).read().strip()
        except OSError as e:
            return f"({e.strerror})"
    print("cpuidle driver:", rd("/sys/devices/system/cpu/cpuidle/current_driver"),
          "governor:", rd("/sys/devices/system/cpu/cpuidle/current_governor_ro") if os.path.exists("/sys/devices/system/cpu/cpuidle/current_governor_ro") else rd("/sys/devices/system/cpu/cpuidle/current_governor"))
    for s in sorted(glob.glob("/sys/devices/system/cpu/cpu0/cpuidle/state*")):
        print(" ", os.path.basename(s), rd(s + "/name"), "latency", rd(s + "/latency"), "disable", rd(s + "/disable"), "usage", rd(s + "/usage"))
    print("hypervisor flag:", "hypervisor" in rd("/proc/cpuinfo"))
    print("cpu_dma_latency:", os.path.exists("/dev/cpu_dma_latency"), "resume_latency cpu0:", rd("/sys/devices/system/cpu/cpu0/power/pm_qos_resume_latency_us"))
    print("scaling governor:", rd("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor"))

def run(gap_ms, rounds, spin=False):
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        a.close()
        while True:
            if spin:
                try:
                    m = b.recv(8, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
            else:
                m = b.recv(8)
            if not m:
                os._exit(0)
            b.send(m)
    b.close()
    rt = []
    for i in range(rounds):
        if gap_ms:
            time.sleep(gap_ms / 1e3)
        t = time.perf_counter()
        a.send(b"x" * 8)
        a.recv(8)
        rt.append((time.perf_counter() - t) * 1e6)
    a.close()
    os.waitpid(pid, 0)
    rt.sort()
    return statistics.median(rt), rt[int(len(rt) * 0.9)]

def table(tag, spin=False):
    for gap in (0, 20, 200):
        n = 2000 if gap == 0 else (200 if gap < 100 else 25)
        p50, p90 = run(gap, n, spin)
        print(f"{tag:12s} gap {gap:4d} ms: round trip P50 {p50:7.1f} us  P90 {p90:7.1f} us  ({n})")

info()
table("no QoS")
try:
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", 0))
    table("QoS 0 us")
    os.close(fd)
    fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    os.write(fd, struct.pack("i", 20))
    table("QoS 20 us")
    os.close(fd)
except OSError as e:
    print("cpu_dma_latency:", e)
table("no QoS again")
table("peer spins", True)
