#!/bin/bash
# (from shared/recipes/softroce-vm) Build a tiny busybox initramfs that carries only the modules needed to mount the 9p/overlay root.
set -euo pipefail
P=${P:?work directory}
HERE=$(cd "$(dirname "$0")" && pwd)
KV=${KV:-$(ls $P/kpkg/lib/modules | head -1)}
MD=$P/kpkg/lib/modules/$KV
[ -f $MD/modules.dep ] || depmod -b $P/kpkg $KV
R=$P/initramfs-root
rm -rf $R; mkdir -p $R/{bin,proc,sys,dev,mods}
cp /usr/bin/busybox $R/bin/busybox
cp $HERE/init $R/init; chmod +x $R/init
: > $R/modlist
for top in virtio_pci 9pnet_virtio 9p overlay; do
  modprobe -d $P/kpkg -S $KV --show-depends $top | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r f; do
  n=$(basename $f .ko); cp $f $R/mods/$n.ko; echo $n >> $R/modlist
done
cat $R/modlist | tr '\n' ' '; echo
(cd $R && find . | cpio -o -H newc --quiet | gzip -1) > $P/initramfs.cpio.gz
ls -la $P/initramfs.cpio.gz
