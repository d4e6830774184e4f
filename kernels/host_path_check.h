// The start-up check of the host codec's vector paths. Every path is meant to write the scalar
// path's bytes, and on real CPUs it does (tests/kernels: HostIsa.*). A CPU that computes an
// instruction wrongly would otherwise make a rank's payloads silently differ from what the format
// defines: QEMU 7.2's emulated CPU reads a gather whose index vector is in register 4 as if it had
// no index, and the vector paths' level lookups gather (docs/results/host-isa.md). So before a
// vector path is used, codecs built for it and for the scalar path encode, hop and finish one small
// fixed problem, and the path is used only if every byte agrees.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/codec.h"
#include "kernels/host_isa.h"

namespace dq {

// Makes a codec of a spec text (nullptr: a family this build lacks, then skipped).
using CodecMaker = std::function<std::unique_ptr<Codec>(const char* spec)>;

// Every byte codec `c` writes for `workers` (two or more tensors of one type and length): each
// worker's statistics words, then in each of `chunks` chunks the leaves of every worker but the
// last, the last worker's fused hop of them all (correlated rounding, three strata) and that hop's
// finishes (FP32 and BF16 out, SUM and AVG). Empty, with *error naming the step, when a step
// fails. The start-up check's procedure, and the codec tests' comparison of paths.
std::vector<uint8_t> codec_step_bytes(Codec& c, const std::vector<ConstTensor>& workers, int chunks,
                                      std::string* error);

// Whether codecs from `candidate` write every byte codecs from `reference` write: statistics,
// leaves, a fused hop and every finish, FP32 and BF16 input, for DynamiQ's widths and lookups and
// each baseline family. On the first difference returns false and names it in *difference.
bool codec_makers_agree(const CodecMaker& reference, const CodecMaker& candidate,
                        std::string* difference);

// Tests: the width in bits of each super-group of the check's problem under DynamiQ spec `spec`
// (FP32 input, the calling thread's path); empty for another family. What shows the check
// reaches each width's lookup.
std::vector<int> host_path_check_widths(const char* spec);

// codec_makers_agree() of the scalar path's codecs and `isa`'s (built on the calling thread with
// ThreadHostIsa, so the process's selection is untouched). About 8 ms on a 2-core VM.
bool host_path_gives_scalar_bytes(HostIsa isa, std::string* difference);

}  // namespace dq
