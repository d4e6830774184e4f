// A codec step's flags word and its fold into the lane's error word, done by the step's own
// kernels, so a step launches nothing besides them (no one-thread arm or fold kernel around it).
// Included by kernels/cuda/cuda_compat.h; kernels/cuda/EMULATION.md describes the model.
//
// The devices hand every launch of a step the `flags` member of a StepWord as its `error` word.
// The step's kernels read it as they start (kSkipFlag: the lane failed before, write nothing) and
// OR their flags into it. The step's last kernel holds a StepFold: when its grid is done (the
// last block to finish, counted in blocks_done), one thread turns the flags into the lane's error
// word (first failure wins, with the host device's encoding, the words the device put in the
// StepWord), adds them to `raised`, and arms the word for the step's next launch: kFoldFlag, with
// kSkipFlag when the lane's error word is set. A plain word (the kernel tests') lacks kFoldFlag:
// nothing is folded, and its flags stay for the caller to read.
#pragma once
#include <cstdint>
#if DQ_CUDA_EMULATED
#include <exception>
#endif

namespace dq::cuda {

// In a flags word: it is a StepWord's `flags`, which the step's last kernel folds. No kernel
// raises it.
constexpr unsigned kFoldFlag = 0x40000000u;
// Raised by a block whose bounded wait for another block of its launch ran out (FinishGate). A
// block waits only for lower tickets, which run to their end, so it is never expected; it turns a
// broken invariant into a failed step (an internal error) instead of a kernel that never ends.
constexpr unsigned kWaitGaveUpFlag = 0x20000000u;
// Polls of a FinishGate wait before kWaitGaveUpFlag: at least 2^24 x kPollPauseNs (about 1 s),
// seconds with the polls' own latency, against validators that finish in milliseconds.
constexpr unsigned kMaxGatePolls = 1u << 24;

// Device memory (the real device) or the stepping thread's stack (the emulated one).
struct StepWord {
  unsigned flags;           // the launches' `error` word: kFoldFlag, kSkipFlag, the kernels' flags
  unsigned blocks_done;     // blocks of the folding launch that finished; 0 between launches
  unsigned raised;          // every flag folded since the word was made
  unsigned malformed_mask;  // the flags that mean malformed data
  uint32_t* error;          // the lane's error word (mapped memory); nullptr: none
  uint32_t malformed;       // written there for a malformed-data flag
  uint32_t internal;        // written there for any other flag
  // A finish's one-launch validation (FinishGate below): blocks that took a ticket, validator
  // blocks done, blocks done. All 0 between launches (the launch's last block resets them).
  unsigned tickets;
  unsigned validated;
  unsigned finished;
};

// A word armed for a step's first launch, folding into `error`.
inline StepWord step_word(uint32_t* error, unsigned malformed_mask, uint32_t malformed,
                          uint32_t internal) {
  return StepWord{kFoldFlag, 0u, 0u, malformed_mask, error, malformed, internal, 0u, 0u, 0u};
}

// For a kernel that follows a flag-raising kernel of its step (or raises none itself): write
// nothing when the lane failed before the step or a flag was raised earlier in it.
__host__ __device__ inline bool step_failed(unsigned word) {
  return (word & ~kFoldFlag) != 0;
}

// Declared first in a step's last kernel (`last`: whether this launch is the step's last, the
// same in the whole grid); its destructor, at every return of the kernel, folds the word once the
// whole grid is done. Every return of such a kernel must be taken by the whole block (the
// destructor has a barrier), as the kernels' rules already require of a return before a barrier.
class StepFold {
 public:
  __device__ explicit StepFold(const unsigned* flags, bool last = true)
      : word_(const_cast<unsigned*>(flags)), last_(last) {}
  StepFold(const StepFold&) = delete;
  StepFold& operator=(const StepFold&) = delete;
  __device__ ~StepFold() {
#if DQ_CUDA_EMULATED
    if (std::uncaught_exceptions() > 0) return;  // the emulator unwinds a faulted launch
#endif
    // kFoldFlag never changes during a launch: the whole grid decides alike.
    if (!last_ || word_ == nullptr || (load_relaxed(word_) & kFoldFlag) == 0) return;
    __syncthreads();  // this block's writes and flags are done
    if (threadIdx.x != 0 || threadIdx.y != 0 || threadIdx.z != 0) return;
    StepWord* w = reinterpret_cast<StepWord*>(word_);
    __threadfence();
    if (atomicAdd(&w->blocks_done, 1u) + 1u != gridDim.x * gridDim.y * gridDim.z) return;
    __threadfence();  // every block's flags are visible
    fold(w);
  }

 private:
  __device__ static void fold(StepWord* w) {
    const unsigned word = load_relaxed(&w->flags);
    const unsigned f = word & ~(kFoldFlag | kSkipFlag);
    if (f != 0 && (word & kSkipFlag) == 0 && w->error != nullptr) {
      const uint32_t e = (f & w->malformed_mask) != 0 ? w->malformed : w->internal;
      // The host compare-and-swaps the same mapped word for its own failures. Where the platform
      // lacks host-native atomics (cudaDevAttrHostNativeAtomicSupported 0: PCIe x86 hosts) the
      // two need not be atomic with each other: both write a non-zero code to a zero word, so the
      // lane still fails, but the code kept may be the later failure's.
#if DQ_CUDA_EMULATED
      atomicCAS(w->error, 0u, e);
#else
      atomicCAS_system(w->error, 0u, e);
#endif
    }
    w->raised |= f;
    const bool failed = w->error != nullptr && load_relaxed(w->error) != 0;
    w->blocks_done = 0;
    w->flags = kFoldFlag | (failed ? kSkipFlag : 0u);
  }

  unsigned* word_;
  bool last_;
};

// ---- a finish in one launch: validate its chunks whole, then decode ----------------------------
// A finish must write nothing when any part of its chunks is invalid (the caller's buffer, often
// the call's input in place, is left as it was; a launch of several chunks then writes none of
// them), so every record is validated before any block writes. One launch does both without relying
// on its blocks being resident at once (NCCL's persistent kernels may hold SMs; a grid barrier
// could then wait forever): each block takes a ticket as it starts; the first `validators` tickets
// validate a share of the records each and publish it; the others decode, and first wait until
// every validator has published. A decoder waits only for blocks with lower tickets, which are
// running or done (they took their ticket) and wait for nothing, so it always ends (the decoupled
// look-back argument of single-pass scans). Under the emulator the blocks run one at a time, in
// whatever block order it is set to, and tickets follow the order the blocks start in: a decoder
// finds every validator done and never waits. The cost: the chunks' records are read twice, by a
// validator and by a decoder (on a GPU the second read should mostly hit L2: not measured). Shared
// words are passed by pointer (kernels/cuda/EMULATION.md: __shared__ in kernels only).
class FinishGate {
 public:
  // Every thread of the block; the ticket is taken by thread 0 (one barrier). `s`: a shared word.
  __device__ FinishGate(StepWord* w, unsigned validators, unsigned* s)
      : w_(w), validators_(validators), s_(s) {
    if (threadIdx.x == 0) *s_ = atomicAdd(&w_->tickets, 1u);
    __syncthreads();
    ticket_ = *s_;
    __syncthreads();  // *s_ is reused
  }
  FinishGate(const FinishGate&) = delete;
  FinishGate& operator=(const FinishGate&) = delete;

  __device__ bool validator() const { return ticket_ < validators_; }
  // This block's share: validators 0 .. validators-1, decoders 0 .. grid - validators - 1.
  __device__ unsigned share() const { return validator() ? ticket_ : ticket_ - validators_; }
  __device__ unsigned shares() const { return validator() ? validators_ : gridDim.x - validators_; }

  // A validator, every thread, after its last flag: its share is published.
  __device__ void validated() {
    __threadfence();  // every thread's flags before the count
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      atomicAdd(&w_->validated, 1u);
    }
  }

  // A decoder, every thread: waits until every validator has published; whether a flag was
  // raised (or the lane had failed), i.e. whether it must write nothing. The same in the block.
  __device__ bool chunk_failed() {
    if (threadIdx.x == 0) {
      // Under the emulation a block runs whole before the next starts, so every lower ticket is
      // done: a miss there is a broken invariant and a wait that never ends (a fault). On a GPU
      // the wait is bounded, and running out of it fails the step.
      for (unsigned poll = 0; load_relaxed(&w_->validated) < validators_; ++poll) {
        if (poll == kMaxGatePolls) {
          atomicOr(&w_->flags, kWaitGaveUpFlag);
          break;
        }
        poll_missed();
      }
      __threadfence();  // every validator's flags after its count
      *s_ = load_relaxed(&w_->flags);
    }
    __syncthreads();
    const bool failed = step_failed(*s_);
    __syncthreads();  // *s_ is reused
    return failed;
  }

  // Every thread, once the block is done with the tickets: the launch's last block resets them for
  // the next launch on this word.
  __device__ ~FinishGate() {
#if DQ_CUDA_EMULATED
    if (std::uncaught_exceptions() > 0) return;  // the emulator unwinds a faulted launch
#endif
    __syncthreads();
    if (threadIdx.x != 0) return;
    __threadfence();
    if (atomicAdd(&w_->finished, 1u) + 1u != gridDim.x) return;
    // Every other block's tickets and counts before the reset (each fenced before its count): a
    // plain write unordered with their atomics is a data race, and the reset could then be
    // ordered before one of them and leave a ticket count for the next launch.
    __threadfence();
    w_->tickets = 0;
    w_->validated = 0;
    w_->finished = 0;
    __threadfence();
  }

 private:
  StepWord* w_;
  unsigned validators_;
  unsigned* s_;
  unsigned ticket_ = 0;
};

}  // namespace dq::cuda
