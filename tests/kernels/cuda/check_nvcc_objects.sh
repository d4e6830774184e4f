#!/bin/sh
# The nvcc leg of the CUDA kernels: the build compiled each kernel file for sm_80 and sm_90 with
# warnings as errors and --fmad=false (a build failure otherwise). Checks that every object holds
# code for both architectures, assembled without FMA contraction.
status=0
for obj in "$@"; do
  for want in "-arch sm_80" "-arch sm_90" "-fmad false"; do
    if ! grep -a -q -e "$want" "$obj"; then
      echo "FAIL: $obj: no '$want' in the embedded ptxas options"
      status=1
    fi
  done
  [ $status -eq 0 ] && echo "ok: $obj (sm_80, sm_90, -fmad false)"
done
exit $status
