#!/bin/sh
# The host codec on an emulated CPU: QEMU's user-mode x86-64 emulator (TCG, -cpu max), which
# offers AVX2 and computes some of it wrongly (QEMU 7.2: vpgatherdq, and at least one more
# instruction; docs/results/host-isa.md). A job run under such an emulator must still write the
# format's bytes: the vector paths' start-up check (kernels/host_path_check.h) must refuse a path
# that differs from the scalar one. So, under the emulator and with auto's path, the golden
# payloads must match byte for byte, the fused hop must match its pointwise reference, and the
# check must still find a planted fault. And a process that reads the settings first, as the
# shim does, must not hang: their codec validation once chose the host path inside the settings'
# parse, whose failed check's warning then waited on that same parse. Where the emulator gets
# every instruction right, the same assertions hold with the AVX2 path taken.
# Usage: emulated_cpu.sh TEST_GOLDEN TEST_DYNAMIQ CONFIG_TEST. Exit 77 (skipped) without
# qemu-x86_64 (Debian: qemu-user) or off x86-64.
golden=$1
dynamiq=$2
config=$3
if [ "$(uname -m)" != x86_64 ] || ! command -v qemu-x86_64 >/dev/null 2>&1; then
  echo "qemu-x86_64 not found (or not an x86-64 host): skipped"
  exit 77
fi
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
DYNAMIQ_HOST_ISA=auto timeout 300 qemu-x86_64 -cpu max "$golden" >"$log" 2>&1 || status=1
path=$(sed -n 's/^host codec path: //p' "$log" | head -n 1)
refused=$(grep -c 'host codec path writes other bytes than the scalar path' "$log")
echo "emulated CPU: auto took the $path path; paths refused by the start-up check: $refused"
grep 'WARN' "$log"
if [ "$status" -ne 0 ]; then
  echo "golden payloads under the emulated CPU:"
  grep -E 'Failure|FAILED|differ' "$log" | head -n 20
  exit 1
fi
if [ "$path" = scalar ] && [ "$refused" -eq 0 ]; then
  echo "the emulated CPU offers no vector path: nothing was checked"
  exit 77
fi
DYNAMIQ_HOST_ISA=auto timeout 300 qemu-x86_64 -cpu max "$dynamiq" \
  --gtest_filter='HostIsa.*:HostPathCheck.FindsOneWrongBitAndNamesWhere:DeviceMath.FusedHopMatchesPointwiseReference' \
  >"$log" 2>&1 || status=1
grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$log"
if [ "$status" -ne 0 ]; then
  grep -E -A3 'Failure' "$log" | head -n 30
  exit 1
fi
# The settings read first (config_test's child scenario "settings": the shim's way, three times).
if ! timeout 60 qemu-x86_64 -cpu max "$config" --child settings >"$log" 2>&1; then
  echo "reading the settings first under the emulated CPU did not finish (hung or failed):"
  cat "$log"
  exit 1
fi
echo "the emulated CPU's codec bytes are the format's; the settings read first do not hang"
