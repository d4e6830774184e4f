#!/usr/bin/env bash
# Runs one command as root inside a qemu guest whose kernel has a real RDMA stack: Debian's
# kernel with soft-RoCE (rdma_rxe) on a virtio NIC, device rxe0, address 198.18.0.2/24.
#
#   tests/vm/run.sh [--timeout SECONDS] [--mem MiB] [--share DIR]... -- COMMAND [ARGS...]
#
# The guest sees the host's root filesystem read-only (9p) at the same paths, so host-built
# binaries, their libraries, the rxe verbs provider and perftest run there unchanged; the
# repository holding this script and every --share DIR are shared read-write at their own paths;
# /tmp, /run and /dev/shm are the guest's own (tmpfs). COMMAND runs in the caller's working
# directory with the caller's environment plus DYNAMIQ_VM=1 and DYNAMIQ_NET_IFNAME=eth0; its
# stdout and stderr come back on ours, and we exit with its exit status.
#
# Exit status: COMMAND's; 124 when --timeout (default 600 s, boot included) ran out (qemu is
# killed); 77 with a one-line reason when qemu, the kernel package or another part cannot be
# had; 125 when the guest ran but reported no exit status (its console log is printed).
#
# Environment: DYNAMIQ_VM_CACHE (image cache, default /tmp/dynamiq-vm-cache), DYNAMIQ_VM_KERNEL
# (a kernel version under /lib/modules, default the newest with rdma_rxe), DYNAMIQ_VM_ACCEL
# (tcg, the default; kvm: only where KVM is known to boot a stock kernel, not on the machine
# this was written on; auto: KVM once a probe boot with it passed, else TCG),
# DYNAMIQ_VM_VERBOSE=1 (timings and the guest console on stderr),
# DYNAMIQ_VM_KEEP=1 (keep the per-run folder), DYNAMIQ_VM_MTU (eth0's, default 9000),
# DYNAMIQ_VM_APPEND (more kernel arguments), DYNAMIQ_VM_QEMU_EXTRA (more qemu arguments, split on
# spaces; e.g. "-bios /usr/share/qemu/qboot.rom"). tests/vm/README.md says more.
set -u -o pipefail
{  # The whole script is read before it runs: an edit of this file never disturbs a run in flight.

prog=tests/vm/run.sh
skip() { echo "SKIP: $prog: $*" >&2; exit 77; }
die() { echo "$prog: $*" >&2; exit 125; }
verbose=${DYNAMIQ_VM_VERBOSE:-0}
note() { [ "$verbose" = 1 ] && echo "[vm] $*" >&2; return 0; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.2f", b - a }'; }

timeout_s=600
mem_mib=2048
shares=()
while [ $# -gt 0 ]; do
  case "$1" in
    --timeout) timeout_s=${2:?--timeout needs a value}; shift 2 ;;
    --mem) mem_mib=${2:?--mem needs a value}; shift 2 ;;
    --share) shares+=("$(cd "${2:?--share needs a folder}" && pwd -P)") || die "no folder $2"; shift 2 ;;
    --) shift; break ;;
    -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "usage: $prog [--timeout SECONDS] [--mem MiB] [--share DIR]... -- COMMAND [ARGS...]" >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { echo "usage: $prog [--timeout SECONDS] [--mem MiB] [--share DIR]... -- COMMAND [ARGS...]" >&2; exit 2; }
case "$timeout_s" in ''|*[!0-9]*) die "--timeout wants whole seconds, not $timeout_s" ;; esac
case "$mem_mib" in ''|*[!0-9]*) die "--mem wants MiB, not $mem_mib" ;; esac

# Already in the guest (a script that calls run.sh, run by run.sh): the command runs here.
if [ "${DYNAMIQ_VM:-0}" = 1 ]; then
  timeout -k 5 "$timeout_s" "$@"; exit $?
fi

script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd "$script_dir/../.." && pwd -P)
t_start=$(now)

# ---- 1. what the host needs (installed only when missing, bounded) ---------------------------
find_kernel() {  # newest kernel with a bzImage in /boot and rdma_rxe among its modules
  local k best=""
  if [ -n "${DYNAMIQ_VM_KERNEL:-}" ]; then
    k=$DYNAMIQ_VM_KERNEL
    [ -r "/boot/vmlinuz-$k" ] && modprobe -S "$k" --show-depends rdma_rxe >/dev/null 2>&1 && echo "$k"
    return 0
  fi
  for f in /boot/vmlinuz-*; do
    [ -r "$f" ] || continue
    k=${f#/boot/vmlinuz-}
    [ -r "/lib/modules/$k/modules.dep" ] || continue
    modprobe -S "$k" --show-depends rdma_rxe >/dev/null 2>&1 || continue
    best=$(printf '%s\n%s\n' "$best" "$k" | sed '/^$/d' | sort -V | tail -n 1)
  done
  echo "$best"
}
busybox_static() {  # a statically linked busybox (it runs before any library is reachable)
  local b
  for b in /bin/busybox /usr/bin/busybox; do
    [ -x "$b" ] || continue
    case "$(LC_ALL=C ldd "$b" 2>&1)" in *'not a dynamic executable'*) echo "$b"; return 0 ;; esac
  done
  return 1
}
missing_packages() {
  local p=()
  command -v qemu-system-x86_64 >/dev/null || p+=(qemu-system-x86)
  [ -n "$(find_kernel)" ] || p+=(linux-image-amd64)
  busybox_static >/dev/null || p+=(busybox-static)
  command -v rdma >/dev/null || p+=(iproute2)
  command -v ibv_devinfo >/dev/null || p+=(ibverbs-utils)
  ls /usr/lib/*/libibverbs/librxe-rdmav*.so >/dev/null 2>&1 && [ -r /etc/libibverbs.d/rxe.driver ] ||
    p+=(ibverbs-providers rdma-core)
  command -v ib_write_bw >/dev/null || p+=(perftest)
  command -v cpio >/dev/null || p+=(cpio)
  command -v xz >/dev/null || p+=(xz-utils)
  command -v depmod >/dev/null || p+=(kmod)
  echo "${p[@]}"
}
pkgs=$(missing_packages)
if [ -n "$pkgs" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "$prog: installing $pkgs (apt-get, at most 15 min)" >&2
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
      -o DPkg::Lock::Timeout=180 $pkgs >&2 ||
      { DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update -qq -o DPkg::Lock::Timeout=180 >&2 &&
        DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq --no-install-recommends \
          -o DPkg::Lock::Timeout=180 $pkgs >&2; } ||
      echo "$prog: apt-get could not install $pkgs" >&2
    pkgs=$(missing_packages)
  fi
fi
if [ -n "$pkgs" ]; then
  case " $pkgs " in
    *" qemu-system-x86 "*) skip "no qemu-system-x86_64 (package qemu-system-x86 missing; apt-get could not install it)" ;;
    *" linux-image-amd64 "*) skip "no kernel with rdma_rxe in /boot and /lib/modules (package linux-image-amd64 missing)" ;;
    *) skip "missing packages: $pkgs" ;;
  esac
fi
kver=$(find_kernel)
busybox=$(busybox_static)
# A qemu without what the guest needs (9p, virtio NIC, user network) counts as no qemu.
qemu_devices=$(timeout 30 qemu-system-x86_64 -machine pc -device help 2>&1) || skip "qemu-system-x86_64 does not run: $(echo "$qemu_devices" | tail -n 1)"
for d in virtio-9p-pci virtio-net-pci; do
  case "$qemu_devices" in *"\"$d\""*) ;; *) skip "qemu-system-x86_64 has no $d device" ;; esac
done
note "host packages ready ($(since "$t_start") s); kernel $kver"

# ---- 2. the guest's kernel and initramfs, built once per kernel and script version -----------
cache_root=${DYNAMIQ_VM_CACHE:-/tmp/dynamiq-vm-cache}
mkdir -p "$cache_root" || skip "cannot create the image cache $cache_root"
key=$( { cat "$0"; echo "$kver"; stat -c '%s %Y' "/boot/vmlinuz-$kver" "$busybox"; } | sha256sum | cut -c1-16)
image="$cache_root/$kver-$key"

u32_at() { od -An -tu4 -j "$2" -N4 "$1" | tr -d ' '; }
u8_at() { od -An -tu1 -j "$2" -N1 "$1" | tr -d ' '; }
# The uncompressed ELF vmlinux inside a bzImage: the x86 boot header gives the offset and size of
# the compressed payload (boot protocol 2.08+); its first bytes say the compressor. The kernel
# boots faster this way (qemu loads the ELF through its PVH entry: no decompression under TCG).
extract_vmlinux() {
  local bz=$1 out=$2 setup off len start magic
  [ "$(od -An -c -j 514 -N4 "$bz" | tr -d ' ')" = HdrS ] || return 1
  setup=$(u8_at "$bz" 497); [ "$setup" = 0 ] && setup=4
  off=$(u32_at "$bz" 584); len=$(u32_at "$bz" 588)
  start=$(( (setup + 1) * 512 + off ))
  magic=$(od -An -tx1 -j "$start" -N6 "$bz" | tr -d ' \n')
  # The payload ends with the uncompressed size (4 bytes): left out.
  local payload=(tail -c "+$((start + 1))" "$bz")
  case "$magic" in
    fd377a585a00*) "${payload[@]}" | head -c "$((len - 4))" | xz -dc --single-stream > "$out" ;;
    1f8b*) "${payload[@]}" | head -c "$((len - 4))" | gzip -dc > "$out" 2>/dev/null ;;
    28b52ffd*) "${payload[@]}" | head -c "$((len - 4))" | zstd -dcq > "$out" ;;
    425a68*) "${payload[@]}" | head -c "$((len - 4))" | bzip2 -dc > "$out" ;;
    5d0000*) "${payload[@]}" | head -c "$((len - 4))" | xz -dc --format=lzma > "$out" 2>/dev/null ;;
    02214c18*) "${payload[@]}" | head -c "$((len - 4))" | lz4 -dc > "$out" ;;
    *) return 1 ;;
  esac
  [ "$(od -An -tx1 -N4 "$out" | tr -d ' ')" = 7f454c46 ]
}

guest_modules="rdma_rxe ib_uverbs rdma_ucm crc32_generic virtio_net virtio_pci 9pnet_virtio 9p"
build_image() {
  local tmp=$1 st=$1/root m path rel
  mkdir -p "$st"/{bin,dev,proc,sys,ctl,newroot,etc} || return 1
  if extract_vmlinux "/boot/vmlinuz-$kver" "$tmp/vmlinux"; then
    echo vmlinux > "$tmp/kernel"
  else  # still bootable, decompressing itself (slower under TCG)
    rm -f "$tmp/vmlinux"; cp "/boot/vmlinuz-$kver" "$tmp/vmlinuz" && echo vmlinuz > "$tmp/kernel" || return 1
  fi
  cp "$busybox" "$st/bin/busybox" || return 1
  for m in sh mount umount mkdir insmod modprobe chroot poweroff reboot sleep cat echo ln sync ip hostname; do
    ln -s busybox "$st/bin/$m"
  done
  # The modules, their dependencies resolved by modprobe (modules.dep), in load order.
  : > "$st/etc/modules.load"
  for m in $guest_modules; do
    modprobe -S "$kver" --show-depends "$m" || return 1
  done | awk '$1 == "insmod" && !seen[$2]++ { print $2 }' > "$tmp/modules.list" || return 1
  while read -r path; do
    rel=${path#/lib/modules/$kver/}
    mkdir -p "$st/lib/modules/$kver/$(dirname "$rel")"
    case "$path" in  # busybox's insmod takes plain .ko files only
      *.ko.xz) xz -dc "$path" > "$st/lib/modules/$kver/${rel%.xz}"; rel=${rel%.xz} ;;
      *.ko.zst) zstd -dcq "$path" > "$st/lib/modules/$kver/${rel%.zst}"; rel=${rel%.zst} ;;
      *.ko.gz) gzip -dc "$path" > "$st/lib/modules/$kver/${rel%.gz}"; rel=${rel%.gz} ;;
      *) cp "$path" "$st/lib/modules/$kver/$rel" ;;
    esac || return 1
    echo "$rel" >> "$st/etc/modules.load"
  done < "$tmp/modules.list"
  for f in modules.order modules.builtin modules.builtin.modinfo; do
    [ -r "/lib/modules/$kver/$f" ] && cp "/lib/modules/$kver/$f" "$st/lib/modules/$kver/"
  done
  depmod -b "$st" "$kver" || return 1  # for the kernel's own module requests (busybox modprobe)
  echo "$kver" > "$st/etc/kver"
  cat > "$st/init" <<'INIT'
#!/bin/sh
# /init of the dynamiq test guest (written by tests/vm/run.sh): modules, the host's root over 9p
# read-only, the shares read-write, then the per-run script from the host (ctl share) in a chroot.
export PATH=/bin
mount -t proc proc /proc
read -r t_init _ < /proc/uptime
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
kver=$(cat /etc/kver)
while read -r m; do insmod "/lib/modules/$kver/$m" 2>/dev/null; done < /etc/modules.load
read -r t_mods _ < /proc/uptime
o9=trans=virtio,version=9p2000.L,msize=262144
mount -t 9p -o $o9,cache=none dqctl /ctl || { echo "dynamiq-vm: no ctl share"; poweroff -f; }
echo "$t_init" > /ctl/t_init
echo "$t_mods" > /ctl/t_mods
r=/newroot
if ! mount -t 9p -o $o9,ro,cache=loose hostroot $r; then
  echo "dynamiq-vm: cannot mount the host root" > /ctl/guest_error; poweroff -f
fi
mount -t proc proc $r/proc
mount -t sysfs sys $r/sys
mount -t devtmpfs dev $r/dev
mkdir -p $r/dev/shm $r/dev/pts
mount -t tmpfs -o mode=1777 shm $r/dev/shm
mount -t devpts devpts $r/dev/pts
mount -t tmpfs -o mode=1777 tmp $r/tmp
mount -t tmpfs -o mode=755 run $r/run
mkdir -p $r/run/dynamiq-vm
mount -o bind /ctl $r/run/dynamiq-vm
# The guest has rxe devices only: libibverbs loads the rxe provider alone (not the 17 the host
# lists, 1 s per program under TCG).
mount -t tmpfs -o mode=755 verbs $r/etc/libibverbs.d && echo "driver rxe" > $r/etc/libibverbs.d/rxe.driver
while read -r tag path; do
  mkdir -p "$r$path" 2>/dev/null
  mount -t 9p -o $o9,cache=mmap "$tag" "$r$path" || echo "dynamiq-vm: cannot mount $path" >> /ctl/guest_error
done < /ctl/shares
hostname dynamiq-vm
read -r mtu < /ctl/mtu
ip link set lo up && ip link set eth0 mtu "$mtu" && ip link set eth0 up && ip addr add 198.18.0.2/24 dev eth0 ||
  echo "dynamiq-vm: eth0 setup failed" >> /ctl/guest_error
read -r t_mounted _ < /proc/uptime
echo "$t_mounted" > /ctl/t_mounted
chroot $r /bin/bash /run/dynamiq-vm/inner.sh
sync
poweroff -f
sleep 5
INIT
  chmod 755 "$st/init"
  (cd "$st" && find . | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet) > "$tmp/initramfs.cpio" || return 1
  rm -rf "$st"
}
if [ ! -r "$image/initramfs.cpio" ]; then
  t_build=$(now)
  exec 9> "$cache_root/.lock"
  flock -w 600 9 || die "waited 10 min for $cache_root/.lock"
  if [ ! -r "$image/initramfs.cpio" ]; then
    tmp=$(mktemp -d "$cache_root/.build.XXXXXX") || die "cannot write to $cache_root"
    export kver busybox guest_modules
    export -f build_image extract_vmlinux u32_at u8_at
    if ! timeout 300 bash -c 'build_image "$1"' _ "$tmp" > "$tmp/build.log" 2>&1; then
      cat "$tmp/build.log" >&2; rm -rf "$tmp"; die "could not build the guest image for kernel $kver"
    fi
    rm -rf "$image"; mv "$tmp" "$image" || die "cannot move the guest image into $image"
    for old in "$cache_root/$kver"-*; do  # images of other versions of this script
      [ "$old" = "$image" ] || rm -rf "$old"
    done
    note "built the guest image $image ($(since "$t_build") s)"
  fi
  exec 9>&-
fi

# ---- 3. this run's folder: the command, its environment, its output, its exit status ---------
run=$(mktemp -d /tmp/dynamiq-vm-run.XXXXXX) || die "cannot create a run folder in /tmp"
qpid=""; tails=()
cleanup() {
  [ -n "$qpid" ] && kill -9 "$qpid" 2>/dev/null
  for p in "${tails[@]}"; do kill "$p" 2>/dev/null; done
  [ "${DYNAMIQ_VM_KEEP:-0}" = 1 ] && echo "$prog: kept $run" >&2 || rm -rf "$run"
}
trap cleanup EXIT
trap 'exit 143' TERM
trap 'exit 130' INT

cwd=$(pwd -P)
all_shares=("$repo" "${shares[@]}")
inside_share() { local s; for s in "${all_shares[@]}"; do case "$1/" in "$s"/*) return 0 ;; esac; done; return 1; }
# The guest's /tmp, /run and /dev are its own: a working directory there must be shared to exist.
case "$cwd/" in /tmp/*|/run/*|/dev/*|/proc/*|/sys/*) inside_share "$cwd" || all_shares+=("$cwd") ;; esac
: > "$run/shares"
virtfs=()
i=0
for s in "${all_shares[@]}"; do
  virtfs+=(-virtfs "local,path=${s//,/,,},mount_tag=s$i,security_model=none,multidevs=remap")
  printf 's%d %s\n' "$i" "$s" >> "$run/shares"
  i=$((i + 1))
done
cmd=("$@")
declare -p cmd > "$run/cmd"
printf '%s\n' "$cwd" > "$run/cwd"
# eth0's MTU: 9000 (jumbo frames, as RoCE fabrics run) gives rxe0 an active MTU of 4096 bytes;
# 1500 gives 1024 (ib_write_bw at 4 MiB: 52 against 18 MiB/s under TCG here).
mtu=${DYNAMIQ_VM_MTU:-9000}
case "$mtu" in ''|*[!0-9]*) die "DYNAMIQ_VM_MTU wants a number, not $mtu" ;; esac
echo "$mtu" > "$run/mtu"
{
  while read -r name; do
    case "$name" in
      PWD|OLDPWD|SHLVL|_|HOSTNAME|BASH_*|XDG_RUNTIME_DIR|DISPLAY|SSH_*|DYNAMIQ_VM_*|LD_PRELOAD) continue ;;
      TMPDIR) inside_share "${TMPDIR}" || continue ;;
    esac
    printf 'export %s=%q\n' "$name" "${!name}"
  done < <(compgen -e)
} > "$run/env"
: > "$run/out"; : > "$run/err"
cat > "$run/inner.sh" <<'INNER'
# The guest side of tests/vm/run.sh, run by bash in the chroot of the host's root: the network,
# rxe0, then the command with the caller's environment, output and exit status to /run/dynamiq-vm.
ctl=/run/dynamiq-vm
setup() {  # busybox set up eth0 already (faster than execs over 9p); bash builtins below
  rdma link add rxe0 type rxe netdev eth0 || return 1
  local i state
  for ((i = 0; i < 100; i++)); do
    read -r state < /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null
    case "$state" in *ACTIVE*) return 0 ;; esac
    sleep 0.1
  done
  echo "rxe0 port 1 not active after 10 s" >&2; return 1
}
read -r t_chroot _ < /proc/uptime; echo "$t_chroot" > "$ctl/t_chroot"
if ! setup > "$ctl/setup.log" 2>&1; then
  echo "dynamiq-vm: network or rxe0 setup failed: $(tr '\n' ' ' < "$ctl/setup.log")" >> "$ctl/guest_error"
fi
read -r t_cmd _ < /proc/uptime; echo "$t_cmd" > "$ctl/t_cmd"
ulimit -l unlimited
ulimit -c 0
. "$ctl/env"
. "$ctl/cmd"
export DYNAMIQ_VM=1 DYNAMIQ_NET_IFNAME=eth0 HOME=${HOME:-/root}
read -r cwd < "$ctl/cwd"
cd "$cwd" || echo "dynamiq-vm: no working directory $cwd in the guest" >> "$ctl/guest_error"
"${cmd[@]}" < /dev/null > "$ctl/out" 2> "$ctl/err"
rc=$?
read -r t_end _ < /proc/uptime; echo "$t_end" > "$ctl/t_end"
echo "$rc" > "$ctl/rc"
INNER

# ---- 4. the guest -------------------------------------------------------------------------------
accel=${DYNAMIQ_VM_ACCEL:-tcg}
if [ "$accel" = auto ]; then
  # KVM where a guest has been seen to boot with it on this host (probed once per image: a
  # 60 s boot of `true` under KVM; /dev/kvm on the machine this was written on hangs it), else TCG.
  accel=tcg
  if [ -w /dev/kvm ]; then
    if [ ! -e "$image/kvm-ok" ] && [ ! -e "$image/kvm-bad" ]; then
      note "probing KVM (at most 60 s, once per image)"
      if DYNAMIQ_VM_ACCEL=kvm DYNAMIQ_VM_VERBOSE=0 "$0" --timeout 60 -- true > /dev/null 2>&1; then
        touch "$image/kvm-ok"
      else
        touch "$image/kvm-bad"
      fi
    fi
    [ -e "$image/kvm-ok" ] && accel=kvm
  fi
  note "accelerator: $accel"
fi
# shellcheck disable=SC2054  # (commas inside qemu's option values)
case "$accel" in
  tcg) accel_args=(-accel tcg,thread=multi -cpu max) ;;
  kvm) accel_args=(-accel kvm -cpu host) ;;
  *) die "DYNAMIQ_VM_ACCEL is tcg, kvm or auto, not $accel" ;;
esac
kernel_file="$image/$(cat "$image/kernel")"
# shellcheck disable=SC2054,SC2206  # (commas inside option values; the extra arguments split on spaces)
qemu=(qemu-system-x86_64 ${DYNAMIQ_VM_QEMU_EXTRA:-} -nodefaults -no-user-config -machine pc "${accel_args[@]}" -smp 2 -m "$mem_mib"
      -display none -monitor none -serial "file:$run/console.log" -no-reboot
      -kernel "$kernel_file" -initrd "$image/initramfs.cpio"
      -append "console=ttyS0 loglevel=4 panic=-1 rdinit=/init mitigations=off ${DYNAMIQ_VM_APPEND:-}"
      -netdev user,id=n0,restrict=on,net=198.18.0.0/24,host=198.18.0.1,dhcpstart=198.18.0.100
      -device virtio-net-pci,netdev=n0
      -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
      -virtfs "local,path=$run,mount_tag=dqctl,security_model=none"
      "${virtfs[@]}")
t_qemu=$(now)
"${qemu[@]}" > "$run/qemu.log" 2>&1 &
qpid=$!
# A watchdog outside this shell: qemu ends 30 s after the deadline even if run.sh itself was
# killed with SIGKILL (no trap runs then).
( timeout $((timeout_s + 30)) tail --pid="$qpid" -s 1 -f /dev/null; [ $? = 124 ] && kill -9 "$qpid" && sleep 1 && rm -rf "$run" ) > /dev/null 2>&1 &
tail -c +1 -s 0.1 -f --pid="$qpid" "$run/out" & tails+=($!)
tail -c +1 -s 0.1 -f --pid="$qpid" "$run/err" >&2 & tails+=($!)

deadline=$(awk -v a="$t_qemu" -v t="$timeout_s" 'BEGIN { printf "%d", a + t }')
timed_out=0; rc_seen=""
while kill -0 "$qpid" 2>/dev/null; do
  sleep 0.1
  if [ "$(date +%s)" -ge "$deadline" ]; then timed_out=1; kill -9 "$qpid" 2>/dev/null; break; fi
  [ -z "${t_init_wall:-}" ] && [ -s "$run/t_init" ] && t_init_wall=$(since "$t_qemu")
  if [ -s "$run/rc" ]; then  # the command is done: the guest powers off now, or is made to
    [ -z "$rc_seen" ] && rc_seen=$(date +%s)
    [ $(( $(date +%s) - rc_seen )) -ge 10 ] && { kill -9 "$qpid" 2>/dev/null; break; }
  fi
done
wait "$qpid" 2>/dev/null
qpid=""
for p in "${tails[@]}"; do wait "$p" 2>/dev/null; done
tails=()

if [ "$verbose" = 1 ]; then
  echo "[vm] guest console:" >&2; sed 's/^/[vm]   /' "$run/console.log" >&2
  read_t() { cat "$run/$1" 2>/dev/null || echo '?'; }
  # t_init is written once the ctl share is up (after the modules): its host-side arrival less
  # the guest's uptime then is the time before the guest's clock started (qemu, firmware, loading).
  pre=$(awk -v seen="${t_init_wall:-x}" -v m="$(read_t t_mods)" 'BEGIN { if (seen == "x" || m == "?") print "?"; else printf "%.2f", seen - m }')
  echo "[vm] guest uptime: /init $(read_t t_init) s, modules loaded $(read_t t_mods) s, 9p mounted $(read_t t_mounted) s," \
       "chroot $(read_t t_chroot) s, command start $(read_t t_cmd) s, command end $(read_t t_end) s;" \
       "before the guest clock ~$pre s (+-0.1); qemu exit $(since "$t_qemu") s after start, run.sh total $(since "$t_start") s" >&2
fi
[ -s "$run/guest_error" ] && sed 's/^/[vm] /' "$run/guest_error" >&2
if [ "$timed_out" = 1 ]; then
  echo "$prog: timed out after $timeout_s s (qemu killed); guest console tail:" >&2
  tail -n 20 "$run/console.log" | sed 's/^/[vm]   /' >&2
  exit 124
fi
if [ ! -s "$run/rc" ]; then
  echo "$prog: the guest reported no exit status; qemu log and console tail:" >&2
  tail -n 20 "$run/qemu.log" | sed 's/^/[qemu] /' >&2
  tail -n 40 "$run/console.log" | sed 's/^/[vm]   /' >&2
  exit 125
fi
rc=$(cat "$run/rc")
if [ "$rc" = 132 ]; then  # SIGILL
  echo "[vm] COMMAND died of SIGILL: the guest CPU (TCG, -cpu max) has AVX2 but no AVX-512; a build" \
       "configured -Dnative=true on an AVX-512 host does not run in the guest (use -Dnative=false)" >&2
fi
exit "$rc"
}
