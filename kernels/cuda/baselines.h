// The baseline codecs' per-call kernels on device buffers (kernels/cuda/baselines.cu): BF16, OCP
// MX v1.0 (MXFP8 E4M3, MXFP6 E3M2 and E2M3, MXFP4 E2M1) and uniform:B, with the bytes of the host
// codecs' build_layout, fused_hop and decode_finish (kernels/baselines/, byte layout in
// docs/FORMAT.md). The arithmetic is the host's DQ_HD functions (kernels/bf16.h,
// kernels/baselines/mx_element.h, kernels/bitpack.h, kernels/philox.h); the host codecs have no
// vector path, so their scalar loops are the template.
//
// Every launch is asynchronous on `stream`. Errors of the data (the host's kMalformedPayload)
// cannot come back from a launch: the kernels OR flags into a device word the caller zeroes
// before the launch and reads when the stream is done (BaselineError). What the caller could have
// checked on the host (arguments, the rounding key's element base) comes back from the launch as
// cudaErrorInvalidValue, as the host's kInvalidArgument. Input messages must each have
// chunk_capacity() readable bytes (the host also checks the sizes it is given; here there are
// none). A word that has kSkipFlag when a launch starts (the caller arms it, cuda_compat.h) means
// the lane failed before: the launch's kernels then write nothing and leave the word as it is.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kernels/codec.h"
#include "kernels/cuda/cuda_compat.h"
#include "kernels/payload.h"

namespace dq::cuda {

constexpr int kBaselineThreads = 256;  // one thread per value, 256 values per block and trip
constexpr int kMaxBaselineInputs = 64;

// What the kernels need of a planned baseline codec, passed to them by value: the plan of
// baselines::BlockCodec::plan().
struct BaselineDeviceParams {
  CodecId codec = CodecId::kBf16;  // kBf16, kMxfp8, kMxfp6E3M2, kMxfp6E2M3, kMxfp4 or kUniform
  uint32_t variant = 0;            // the layout digest's variant: the MX kind 0..3, B of uniform:B
  int element_bits = 16;           // bits of one element code (uniform: k = B - 1)
  int levels = 0;                  // uniform: L = 2^(k-1) - 1
  int block_elems = 1;             // values per block: 1 (BF16), 32 (MX), 16 (uniform)
  int block_bytes = 2;             // bytes per block
  unsigned long long count = 0;
  unsigned long long n_blocks = 0;  // ceil(count / block_elems)
  int n_chunks = 0;
  int n_workers = 0;
  unsigned long long capacity = 0;  // chunk_capacity()
};

// The parameters of the baseline codec named `name` (its Codec::name(): "bf16", "mxfp8",
// "mxfp6e3m2", "mxfp6e2m3", "mxfp4", "uniform:3" .. "uniform:9") planned for (count, n_chunks,
// n_workers). False for another name, or a plan the host codec's plan() refuses.
inline bool baseline_device_params(std::string_view name, size_t count, int n_chunks, int n_workers,
                                   BaselineDeviceParams* out) {
  BaselineDeviceParams d;
  if (name == "bf16") {
    d.codec = CodecId::kBf16;
    d.variant = 0;
    d.element_bits = 16;
    d.block_elems = 1;
  } else if (name == "mxfp8" || name == "mxfp6e3m2" || name == "mxfp6e2m3" || name == "mxfp4") {
    const bool fp8 = name == "mxfp8", e3m2 = name == "mxfp6e3m2", e2m3 = name == "mxfp6e2m3";
    d.codec = fp8    ? CodecId::kMxfp8
              : e3m2 ? CodecId::kMxfp6E3M2
              : e2m3 ? CodecId::kMxfp6E2M3
                     : CodecId::kMxfp4;
    d.variant = fp8 ? 0 : e3m2 ? 1 : e2m3 ? 2 : 3;  // MxKind's order
    d.element_bits = fp8 ? 8 : (e3m2 || e2m3) ? 6 : 4;
    d.block_elems = 32;
  } else if (name.size() == 9 && name.substr(0, 8) == "uniform:" && name[8] >= '3' &&
             name[8] <= '9') {
    d.codec = CodecId::kUniform;
    d.variant = static_cast<uint32_t>(name[8] - '0');
    d.element_bits = static_cast<int>(d.variant) - 1;
    d.levels = (1 << (d.element_bits - 1)) - 1;
    d.block_elems = 16;
  } else {
    return false;
  }
  d.block_bytes = d.codec == CodecId::kBf16      ? 2
                  : d.codec == CodecId::kUniform ? 2 + 2 * d.element_bits
                                                 : 1 + 32 * d.element_bits / 8;
  if (n_chunks < 1 || n_chunks > 65536 || n_workers < 1 || n_workers > 65535 ||
      count > (size_t{1} << 34))
    return false;
  d.count = count;
  d.n_chunks = n_chunks;
  d.n_workers = n_workers;
  d.n_blocks = (count + d.block_elems - 1) / d.block_elems;
  const unsigned long long max_blocks = (d.n_blocks + n_chunks - 1) / n_chunks;
  d.capacity = kChunkHeaderBytes + max_blocks * d.block_bytes;
  *out = d;
  return true;
}

// Flags OR-ed into the caller's error word (each the host's kMalformedPayload).
enum BaselineError : unsigned {
  kBaselineBadHeader = 1u,       // an input's chunk header disagrees, or (finish) its worker count
  kBaselineBadCodes = 2u,        // uniform: an all-ones code or a negative or infinite scale
  kBaselineTooManyWorkers = 4u,  // the inputs and this worker sum more workers than exist
};

// The per-call layout (Codec::layout_bytes() = 8 bytes, 8-byte aligned): the call number, as
// BlockCodec::build_layout(). One thread. `error`: the lane's error/flags word; non-zero when the
// kernel starts leaves the layout untouched (nullptr: no word, always runs).
cudaError_t launch_baseline_layout(uint64_t call, void* layout, cudaStream_t stream,
                                   const unsigned* error = nullptr);

// The fused hop of `chunk`: out (capacity bytes) = compress(own + the n_in input chunk messages
// `inputs[i]` decoded, in order), keyed by `key`; n_in = 0 is the leaf. `own` is the whole tensor.
// As on the host: a header error (or too many workers) leaves `out` untouched; invalid codes in
// an input leave `out` all zero. `max_blocks` caps the grid (0: up to 4096).
cudaError_t launch_baseline_hop(const BaselineDeviceParams& params, const void* layout, int chunk,
                                const void* own, bool own_bf16, const uint8_t* const* inputs,
                                int n_in, uint8_t* out, const RoundingKey& key, unsigned* error,
                                cudaStream_t stream, int max_blocks = 0);

// The finish of `chunk`: decodes the chunk message `in` (the sum of n_contrib workers), divides by
// n_contrib for AVG, and writes this chunk's elements of `out` (the whole tensor, FP32 or BF16). A
// message whose header or codes are invalid leaves `out` untouched (and sets the error word). One
// launch (FinishGate, kernels/cuda/step_fold.h): `word` is a StepWord in device memory, its flags
// the error word (a zeroed word, without kFoldFlag, keeps them for the caller). `max_blocks` caps
// each of the launch's roles (the validators, the decoders). launch_baseline_finishes() of one
// chunk.
cudaError_t launch_baseline_finish(const BaselineDeviceParams& params, const void* layout,
                                   int chunk, const uint8_t* in, void* out, bool out_bf16, bool avg,
                                   int n_contrib, StepWord* word, cudaStream_t stream,
                                   int max_blocks = 0);

// The finish of chunks first_chunk .. first_chunk + n_finish - 1 in one launch: chunk c's message
// at in_base + (c - first_chunk) * in_stride bytes (each capacity bytes long at least; in_stride
// >= capacity when n_finish > 1), decoded into `out` as launch_baseline_finish() does, every
// message the sum of the same n_contrib workers. If any header or code of ANY of these chunks is
// invalid, no chunk of the launch writes any output: stricter than one chunk at a time (and than
// the host's decode_finish, per chunk), where the valid chunks would still be written. Validator
// blocks check the headers (and uniform's codes and scales) of the whole range, the decoder blocks
// wait for them (FinishGate) and share the range's elements; the word and `max_blocks` as
// launch_baseline_finish().
cudaError_t launch_baseline_finishes(const BaselineDeviceParams& params, const void* layout,
                                     int first_chunk, int n_finish, const uint8_t* in_base,
                                     size_t in_stride, void* out, bool out_bf16, bool avg,
                                     int n_contrib, StepWord* word, cudaStream_t stream,
                                     int max_blocks = 0);

// Loads every kernel of baselines.cu (device set-up; see cudaFuncGetAttributes in EMULATION.md).
cudaError_t load_baseline_kernels();

}  // namespace dq::cuda
