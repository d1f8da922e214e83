#!/usr/bin/env bash
# inner.sh — PID 1 of the namespace made by boot.sh: builds the overlay root and private API
# file systems, masks units that would touch the host, then execs systemd. Not run by hand.
set -euo pipefail
STATE=$1 NAME=$2
L=$STATE/layer R=$STATE/root
mkdir -p "$L" "$R"
mount -t tmpfs -o mode=755,size=2g agtest-upper "$L"
mkdir -p "$L/upper" "$L/work"
mount -t overlay -o "lowerdir=/,upperdir=$L/upper,workdir=$L/work" agtest-root "$R"
mount -t proc -o nosuid,nodev,noexec proc "$R/proc"
# The kernel is shared: sysctl and sysrq stay read-only, sysfs is a fresh read-only instance.
mount --bind "$R/proc/sys" "$R/proc/sys"; mount -o remount,bind,ro "$R/proc/sys"
[[ -e $R/proc/sysrq-trigger ]] && mount --bind /dev/null "$R/proc/sysrq-trigger"
mount -t sysfs -o ro,nosuid,nodev,noexec agtest-sys "$R/sys"
mount -t cgroup2 -o rw,nosuid,nodev,noexec cgroup2 "$R/sys/fs/cgroup"
# A minimal /dev of bound host nodes: nothing inside can create or trigger host devices.
mount -t tmpfs -o mode=755,nosuid,size=4m agtest-dev "$R/dev"
for n in null zero full random urandom tty; do touch "$R/dev/$n"; mount --bind "/dev/$n" "$R/dev/$n"; done
touch "$R/dev/console"; mount --bind /dev/null "$R/dev/console"
mkdir -p "$R/dev/pts" "$R/dev/shm" "$R/dev/mqueue"
mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5 devpts "$R/dev/pts"
ln -s pts/ptmx "$R/dev/ptmx"
mount -t tmpfs -o mode=1777,nosuid,nodev shm "$R/dev/shm"
ln -s /proc/self/fd "$R/dev/fd"; ln -s /proc/self/fd/0 "$R/dev/stdin"
ln -s /proc/self/fd/1 "$R/dev/stdout"; ln -s /proc/self/fd/2 "$R/dev/stderr"
# Private /run and /tmp: systemd-tmpfiles' "D /tmp" must never reach the host's /tmp.
mount -t tmpfs -o mode=755,nosuid,nodev,size=512m agtest-run "$R/run"
mkdir -p "$R/run/lock" "$R/run/systemd/system" "$R/run/systemd/journald.conf.d"
mount -t tmpfs -o mode=1777,nosuid,nodev,size=1g agtest-tmp "$R/tmp"
[[ -d $R/var/log/journal ]] && mount -t tmpfs -o mode=2755,size=64m agtest-journal "$R/var/log/journal"
[[ -e $R/usr/lib/tmpfiles.d/tmp.conf ]] && mount --bind /dev/null "$R/usr/lib/tmpfiles.d/tmp.conf"
# Container images' policy-rc.d (exit 101) would stop maintainer scripts from starting units.
[[ -e $R/usr/sbin/policy-rc.d ]] && mount --bind /bin/true "$R/usr/sbin/policy-rc.d"
IFS=: read -r -a shares <<< "${AGTEST_SHARE:-}"
for d in "${shares[@]}"; do
  [[ -n $d ]] || continue
  mkdir -p "$d" "$R$d"; mount --bind "$d" "$R$d"
done
cat > "$R/run/systemd/journald.conf.d/agtest.conf" <<'CONF'
[Journal]
Storage=volatile
ReadKMsg=no
ForwardToWall=no
ForwardToConsole=no
CONF
for u in systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket \
  systemd-udev-trigger.service systemd-udev-settle.service systemd-modules-load.service \
  kmod-static-nodes.service systemd-tmpfiles-setup-dev.service systemd-sysctl.service \
  systemd-binfmt.service proc-sys-fs-binfmt_misc.automount proc-sys-fs-binfmt_misc.mount \
  systemd-remount-fs.service systemd-random-seed.service systemd-timesyncd.service \
  systemd-pstore.service systemd-firstboot.service systemd-repart.service \
  systemd-machine-id-commit.service systemd-pcrphase.service systemd-pcrphase-sysinit.service \
  systemd-hwdb-update.service ldconfig.service systemd-journal-catalog-update.service \
  systemd-update-done.service systemd-sysusers.service systemd-update-utmp.service \
  systemd-journald-audit.socket systemd-ask-password-console.path systemd-ask-password-wall.path \
  dev-hugepages.mount sys-kernel-debug.mount sys-kernel-tracing.mount sys-kernel-config.mount \
  sys-fs-fuse-connections.mount apt-daily.timer apt-daily-upgrade.timer dpkg-db-backup.timer \
  e2scrub_all.timer e2scrub_reap.service fstrim.timer fstrim.service man-db.timer \
  logrotate.timer systemd-tmpfiles-clean.timer; do
  ln -sf /dev/null "$R/run/systemd/system/$u"
done
cd "$R"; mkdir -p .agtest-oldroot; pivot_root . .agtest-oldroot; cd /
umount -l /.agtest-oldroot; rmdir /.agtest-oldroot
# Without a shared / the credentials ramfs never propagates and $CREDENTIALS_DIRECTORY is empty.
mount --make-rshared /
exec setpriv --bounding-set -sys_module,-sys_time env -i container=other \
  PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  /lib/systemd/systemd --system --unit=basic.target --log-target=journal --show-status=no
