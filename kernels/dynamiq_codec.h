// The DynamiQ codec (host implementation): statistics, budget-exact width allocation, mean
// subtraction, reorder by width, hierarchical scales, non-uniform levels and (correlated)
// stochastic rounding. Byte layout: docs/FORMAT.md.
#pragma once
#include <memory>

#include "kernels/codec.h"
#include "kernels/dynamiq_math.h"

namespace dq {

struct DynamiqOptions {
  double budget_bits = 5.0;  // bits per coordinate, every byte of metadata included
  // Level shape for 2 / 4 / 8 bits. The paper's artifact uses 0.23 / 0.18 / 0.10; on our real
  // gradients 0.30 (4-bit) and 0.05 (8-bit) gave 13-16% lower vNMSE (docs/results/accuracy.md,
  // "Choice of eps");
  // the 2-bit levels are {0, 1} whatever eps.
  float eps[3] = {0.23f, 0.30f, 0.05f};
  bool correlated_rounding = true;  // shared permutation across the hops of a coordinate
  bool nonuniform_levels = true;    // false: evenly spaced levels (ablation)
  bool hierarchical_scales = true;  // false: one BF16 scale per group of 16 (ablation)
  bool variable_widths = true;      // false: one width for every super-group (ablation)
  bool mean_subtraction = true;
  bool allow_width16 = true;  // raw BF16 super-groups where the allocation wants them
};

// Builds the level table of one width (host; uses libm once, the table is then plain data).
void build_level_table(int bits, float eps, bool nonuniform, LevelTable* out);

std::unique_ptr<Codec> make_dynamiq_codec(const DynamiqOptions& options);

// Introspection for tests and tools (the codec must be a DynamiQ codec): pointers into a layout
// built by its build_layout(), or into the one its agree() owns. Null pointers without a layout.
struct DynamiqLayoutView {
  const uint8_t* widths;        // per super-group, original order
  const uint32_t* order;        // super-groups in wire order (by width, descending; stable)
  const uint32_t* chunk_first;  // n_chunks + 1 entries into `order`
  size_t n_supergroups;
  bool budget_honest;  // the plan's messages fit the budget (false for tiny tensors)
};
DynamiqLayoutView dynamiq_layout(const Codec& codec);
DynamiqLayoutView dynamiq_layout(const Codec& codec, const void* layout);

// For a device that runs a DynamiQ codec's steps as kernels (shim/engine/cuda_device.cc): the
// codec's options and its plan as plan() fixed it. False, writing nothing, for any other codec.
struct DynamiqPlan;
bool dynamiq_parameters(const Codec& codec, DynamiqOptions* options, DynamiqPlan* plan);

}  // namespace dq
