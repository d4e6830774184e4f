#!/bin/sh
# The kernels' ptxas reports (nvcc --resource-usage, one file per kernel file, sm_80 and sm_90):
# fails when any kernel spills registers to local memory, when the fused hop, the finish or a
# statistics kernel has a stack frame at all, or when a fused hop, finish, DynamiQ layout or
# statistics kernel leaves an SM less than half full of threads for lack of registers (counted in
# blocks of 256 threads; the one-block layout's 512 fill an SM alike: registers go by warps).
# Occupancy from registers (both architectures alike: 65,536 registers and 2,048 threads an SM,
# registers allocated per warp in units of 256) and from shared memory (an SM's 164 KiB on sm_80,
# 228 KiB on sm_90, plus 1 KiB the runtime reserves a block), whichever allows fewer blocks.
status=0
for report in "$@"; do
  awk -v file="$report" -v q="'" '
    /Compiling entry function/ {
      split($0, part, q)  # ... function QKERNELQ for QARCHQ, Q a single quote
      kernel = part[2]
      if (match(kernel, /[a-z_]+_kernel/)) kernel = substr(kernel, RSTART, RLENGTH)  # the name
      arch = part[4]
    }
    /spill stores/ {
      stores = $0; sub(/ bytes spill stores.*/, "", stores); sub(/.*, /, "", stores)
      loads = $0; sub(/ bytes spill loads.*/, "", loads); sub(/.*stores, /, "", loads)
      if (stores + 0 > 0 || loads + 0 > 0) {
        printf "FAIL: %s: %s on %s spills (%s bytes stored, %s loaded)\n", file, kernel, arch, stores, loads
        bad = 1
      }
      frame = $0; sub(/ bytes stack frame.*/, "", frame); sub(/^[ \t]*/, "", frame)
      # The per-value kernels: a stack frame there is an array indexed at run time (the words of
      # a Philox draw, say), a local-memory store and load in the loop over values.
      if (frame + 0 > 0 && kernel ~ /^(dynamiq_hop|dynamiq_finish|supergroup_stats|supergroup_stats_batch)_kernel$/) {
        printf "FAIL: %s: %s on %s has a %s-byte stack frame (local memory)\n", file, kernel, arch, frame
        bad = 1
      }
    }
    /Used [0-9]+ registers/ {
      regs = $0; sub(/.*Used /, "", regs); sub(/ registers.*/, "", regs)
      checked = kernel ~ /(dynamiq_hop|dynamiq_finish|baseline_hop|baseline_finish|dynamiq_layout|layout_[a-z_]+|supergroup_stats|supergroup_stats_batch)_kernel/
      if (checked) {
        per_warp = int((regs * 32 + 255) / 256) * 256
        blocks = int(65536 / (per_warp * 8))
        if (blocks > 8) blocks = 8
        smem = 0
        if (match($0, /[0-9]+ bytes smem/)) smem = substr($0, RSTART, RLENGTH) + 0
        sm_bytes = (arch == "sm_90") ? 233472 : 167936
        by_smem = int(sm_bytes / (smem + 1024))
        if (by_smem < blocks) blocks = by_smem
        occupancy = blocks * 256 / 2048
        printf "%s on %s: %d registers, %d bytes shared, %d blocks of 256 a SM, occupancy %.0f%%\n", kernel, arch, regs, smem, blocks, 100 * occupancy
        if (occupancy < 0.5) {
          printf "FAIL: %s: %s on %s: occupancy %.0f%% (below 50%%)\n", file, kernel, arch, 100 * occupancy
          bad = 1
        }
      }
      n++
    }
    END {
      if (n == 0) { printf "FAIL: %s: no kernel reports\n", file; bad = 1 }
      exit bad
    }' "$report" || status=1
done
[ $status -eq 0 ] && echo "ok: no spills; fused hops, finishes, layouts and statistics at >= 50% occupancy on sm_80 and sm_90"
exit $status
