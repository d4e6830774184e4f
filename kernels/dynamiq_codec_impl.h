// The DynamiQ host codec split by instruction set (internal to kernels/). DynamiqCodecBase holds
// everything that runs once per call (plan, argument and payload checks, the chunk header,
// introspection) in kernels/dynamiq_codec.cc; its hot loops (statistics, fused hop, finish) are
// virtual, implemented once per host ISA by kernels/dynamiq_hot.h, which
// kernels/dynamiq_host_scalar.cc and kernels/dynamiq_host_avx2.cc compile for baseline x86-64
// and for AVX2. make_dynamiq_codec() makes the one host_isa() names.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/codec.h"
#include "kernels/dynamiq_codec.h"
#include "kernels/dynamiq_layout.h"
#include "kernels/dynamiq_math.h"
#include "kernels/dynamiq_range.h"
#include "kernels/payload.h"

namespace dq {

constexpr int kMaxFusedInputs = 64;  // fused inputs per hop (butterfly: log2(n) + 1 <= 11)

class DynamiqCodecBase : public Codec {
 public:
  DynamiqCodecBase(const DynamiqCodecBase&) = delete;  // per-ISA tables point into the object
  DynamiqCodecBase& operator=(const DynamiqCodecBase&) = delete;
  explicit DynamiqCodecBase(const DynamiqOptions& o);

  std::string name() const override;
  Status plan(size_t count, int n_chunks, int n_workers) override;
  size_t stats_words() const override { return dq::stats_words(plan_.n_sg, plan_.n_workers); }
  size_t stats_byte_sum_words() const override {
    return dq::stats_byte_sum_words(plan_.n_sg, plan_.n_workers);
  }
  Status local_stats(const ConstTensor& x, uint16_t* stats) const override;
  size_t layout_bytes() const override { return sections_.bytes; }
  Status build_layout(const uint16_t* reduced, uint64_t call, void* layout) const override {
    return build_dynamiq_layout(plan_, reduced, call, layout);
  }
  size_t chunk_capacity() const override { return plan_.capacity; }
  bool fits_budget() const override { return honest_; }
  Status fused_hop(const void* layout, int chunk, const ConstTensor& own, const ByteView* in,
                   int n_in, uint8_t* out, const RoundingKey& key) const override;
  Status decode_finish(const void* layout, int chunk, ByteView in, void* out, DType out_dtype,
                       ReduceOp op, int n_contrib) const override;
  void layout_ranges(const void* layout, int chunk,
                     std::vector<std::pair<size_t, size_t>>* ranges) const override;

  void parameters(DynamiqOptions* options, DynamiqPlan* plan) const {
    *options = opt_;
    *plan = plan_;
  }
  // Introspection (tests): pointers into `layout`, null where it is.
  DynamiqLayoutView introspect(const void* layout) const;

 protected:
  // The hot loops, one implementation per host ISA, over super-groups [first, last) (statistics:
  // in tensor order, `first` a multiple of 16; the others: wire positions by_index[first ..
  // last)).
  virtual void stats_range(const ConstTensor& x, size_t first, size_t last,
                           uint16_t* stats) const = 0;
  // False when an input record holds invalid content. end: the chunk's last position + 1 (the
  // prefetch stops there).
  struct HopArgs {
    const ConstTensor* own;
    const uint8_t* const* inputs;  // n_in chunk bodies (after the header)
    int n_in;
    uint8_t* body;  // the output chunk's body
    const RoundingKey* key;
    uint64_t sg_base;  // whole-tensor index of super-group 0
    uint32_t end;
  };
  virtual bool fuse_range(const DynamiqLayout& l, uint32_t first, uint32_t last,
                          const HopArgs& a) const = 0;
  // True when every record at wire positions [first, last) holds valid content.
  virtual bool records_valid(const DynamiqLayout& l, const uint8_t* body, uint32_t first,
                             uint32_t last) const = 0;
  virtual void finish_range(const DynamiqLayout& l, const uint8_t* body, uint32_t first,
                            uint32_t last, void* out, DType out_dtype, ReduceOp op,
                            float contributors) const = 0;

  DynamiqLayout view(const void* layout) const {
    return DynamiqLayout(static_cast<const uint8_t*>(layout), sections_);
  }

  DynamiqOptions opt_;
  LevelTable levels_[3];
  int record_[4];

 private:
  Status check_layout(const void* layout) const;
  Status check_chunk_arg(int chunk) const;
  Status check_input(const DynamiqLayout& l, int chunk, ByteView in, ChunkHeader* h) const;
  // The chunk's records, at this codec's record sizes, inside the chunk's content, and the content
  // inside a message: a layout of the same plan shape but another budget or record format
  // (check_layout cannot tell them apart) is refused before anything is written past a message.
  Status check_chunk_records(const DynamiqLayout& l, int chunk) const;

  DynamiqPlan plan_;            // sizes fixed by plan(); what the layout build needs
  DynamiqSections sections_{};  // where each layout section lies, from (n_sg, n_chunks)
  bool honest_ = true;
};

// One per compiled path (kernels/dynamiq_host_*.cc); each other than the scalar one only where
// the CPU has its instructions (host_isa_supported()).
std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_scalar(const DynamiqOptions& options);
std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_avx2(const DynamiqOptions& options);
std::unique_ptr<DynamiqCodecBase> make_dynamiq_codec_avx512(const DynamiqOptions& options);

}  // namespace dq
