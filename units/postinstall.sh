#!/bin/sh
# SPDX-License-Identifier: LGPL-2.1-or-later
# Run by `meson install` (not with --destdir): applies what a package's scriptlets
# would, for a system prefix (/usr, /usr/local) or with -Dsystem_setup=true; into any
# other prefix (a home directory, /opt/epd-test) it changes nothing of the host. Each
# step is skipped where its tool or the running service is missing.
set -e
sysusersdir=$1
tmpfilesdir=$2
setup=${3:-auto}
prefix=${MESON_INSTALL_PREFIX:-}
case "$setup" in
true) ;;
false)
        echo "epd: system_setup=false: user epd, /etc/epd and /var/lib/epd not created, systemd not reloaded" >&2
        exit 0
        ;;
*)
        case "$prefix" in
        /usr | /usr/ | /usr/local | /usr/local/) ;;
        *)
                echo "epd: installed into $prefix, not a system prefix: user epd, /etc/epd and /var/lib/epd" \
                     "not created, systemd and the bus not reloaded (meson configure -Dsystem_setup=true to do it)" >&2
                exit 0
                ;;
        esac
        ;;
esac
if [ "$(id -u)" != 0 ]; then
        echo "epd: not root, skipping sysusers/tmpfiles/daemon-reload" >&2
        exit 0
fi
if command -v systemd-sysusers >/dev/null; then
        systemd-sysusers "$sysusersdir/epd.conf"
fi
if command -v systemd-tmpfiles >/dev/null; then
        systemd-tmpfiles --create "$tmpfilesdir/epd.conf"
fi
# The bus read the policy already (it watches its directories), but user epd may not
# have existed then: make it read the policy again now that it does.
if command -v busctl >/dev/null && busctl --system status >/dev/null 2>&1; then
        busctl --system call org.freedesktop.DBus /org/freedesktop/DBus \
                org.freedesktop.DBus ReloadConfig >/dev/null || true
fi
if [ -d /run/systemd/system ]; then
        systemctl daemon-reload || true
fi
exit 0
