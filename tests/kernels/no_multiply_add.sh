#!/bin/sh
# The host codec's bytes must not depend on the CPU it runs on, nor differ from the device's:
# every path rounds each product before it adds (-ffp-contract=off, meson.build's host_args).
# The AVX-512 path's target implies FMA, so only that flag keeps the compiler from fusing a
# multiply and an add; the byte tests rarely see the difference (a fused sum of squares moves a
# statistics word only where its BF16 rounding is close). This test reads the machine code
# instead: no x86 multiply-add instruction (vfmadd*, vfmsub*, vfnmadd*, vfnmsub*) anywhere in
# the kernels library. Usage: no_multiply_add.sh LIBRARY; exit 77 (skipped) without objdump.
lib=$1
if ! command -v objdump >/dev/null 2>&1; then
  echo "objdump not found: skipped"
  exit 77
fi
if [ ! -f "$lib" ]; then
  echo "no such library: $lib"
  exit 1
fi
found=$(objdump -d --no-show-raw-insn "$lib" | awk '
  /^[0-9a-f]+ <.*>:$/ { fn = $2 }
  /[[:space:]]vfn?m(add|sub)[a-z0-9]*[[:space:]]/ { n[fn]++ }
  END { for (f in n) print n[f], f }')
if [ -n "$found" ]; then
  echo "multiply-add instructions in $lib (count, function):"
  echo "$found" | sort -rn | head -20
  exit 1
fi
echo "no multiply-add instruction in $lib"
