// The order in which the emulator runs a launch's blocks (kernels/cuda/EMULATION.md, "Block
// order"): blockIdx order, reverse, or a seeded shuffle, so that kernels handing work between
// blocks are tested in orders a GPU could pick; and the order in which it runs the threads a
// barrier or a warp collective releases ("Thread order"), so that a missing barrier shows.
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <mutex>

#include "common/splitmix.h"
#include "kernels/cuda/emu/emu.h"
#include "kernels/cuda/emu/quiet_lock.h"

namespace dq::emu {
namespace {

// One order setting: set by a test, or read once from its environment variable (g_order_mutex).
struct OrderSetting {
  const char* variable;  // DQ_EMU_..._ORDER
  const char* what;      // its name in a parse error
  BlockOrdering ordering;
  bool known = false;  // set, or read from the environment
  std::string error;   // the environment's value was no order: every launch fails
};

std::mutex g_order_mutex;
OrderSetting g_blocks{"DQ_EMU_BLOCK_ORDER", "block order", {}, false, {}};
OrderSetting g_threads{"DQ_EMU_THREAD_ORDER", "thread order", {}, false, {}};
// Bumped by set_block_order: a thread's launch numbering restarts when it sees a new generation.
std::atomic<uint64_t> g_generation{0};
thread_local uint64_t t_generation = 0;
thread_local uint64_t t_launches = 0;

// "index", "reverse" or "shuffle:SEED"; `what` names the setting in the error.
bool parse_ordering(const char* text, const char* what, BlockOrdering* out, std::string* error) {
  const std::string s = text ? text : "";
  if (s == "index" || s == "reverse") {
    *out = BlockOrdering{s == "index" ? BlockOrder::kIndex : BlockOrder::kReverse, 0};
    return true;
  }
  const std::string prefix = "shuffle:";
  if (s.rfind(prefix, 0) == 0 && s.size() > prefix.size() && s[prefix.size()] >= '0' &&
      s[prefix.size()] <= '9') {
    const char* digits = s.c_str() + prefix.size();
    char* end = nullptr;
    errno = 0;
    const unsigned long long seed = std::strtoull(digits, &end, 10);
    if (errno == 0 && end != digits && *end == '\0') {
      *out = BlockOrdering{BlockOrder::kShuffle, seed};
      return true;
    }
  }
  *error = std::string(what) + " \"" + s +
           "\" is not one of index, reverse, shuffle:SEED (SEED a decimal number below 2^64)";
  return false;
}

void set_order(OrderSetting* o, const BlockOrdering& ordering) {
  detail::QuietLock lock(g_order_mutex);
  o->ordering = ordering;
  o->known = true;
  o->error.clear();
}

BlockOrdering order_of(const OrderSetting& o) {
  detail::QuietLock lock(g_order_mutex);
  return o.ordering;
}

// The order a launch uses (g_order_mutex held): the set one, else the environment's, read once;
// false, with the reason, when the variable holds no order.
bool settled_order(OrderSetting* o, BlockOrdering* ordering, std::string* error) {
  if (!o->known) {
    o->known = true;
    const char* text = std::getenv(o->variable);
    std::string why;
    if (text != nullptr && !parse_ordering(text, o->what, &o->ordering, &why))
      o->error = std::string(o->variable) + ": " + why;
  }
  if (!o->error.empty()) {
    *error = o->error;
    return false;
  }
  *ordering = o->ordering;
  return true;
}

}  // namespace

bool parse_block_order(const char* text, BlockOrdering* out, std::string* error) {
  return parse_ordering(text, "block order", out, error);
}

bool parse_thread_order(const char* text, BlockOrdering* out, std::string* error) {
  return parse_ordering(text, "thread order", out, error);
}

void set_thread_order(const BlockOrdering& ordering) {
  set_order(&g_threads, ordering);
}

BlockOrdering thread_order() {
  return order_of(g_threads);
}

std::string block_order_name(const BlockOrdering& ordering) {
  if (ordering.order == BlockOrder::kShuffle) return "shuffle:" + std::to_string(ordering.seed);
  return ordering.order == BlockOrder::kReverse ? "reverse" : "index";
}

void set_block_order(const BlockOrdering& ordering) {
  set_order(&g_blocks, ordering);
  g_generation.fetch_add(1);
}

BlockOrdering block_order() {
  return order_of(g_blocks);
}

std::vector<uint64_t> block_sequence(const BlockOrdering& ordering, uint64_t blocks,
                                     uint64_t launch) {
  std::vector<uint64_t> seq(blocks);
  for (uint64_t i = 0; i < blocks; ++i)
    seq[i] = ordering.order == BlockOrder::kReverse ? blocks - 1 - i : i;
  if (ordering.order != BlockOrder::kShuffle) return seq;
  uint64_t state = ordering.seed ^ splitmix64_finalise(launch);
  for (uint64_t i = blocks; i-- > 1;) {
    state += kSplitMix64Step;
    const uint64_t j =
        splitmix64_finalise(state) % (i + 1);  // the modulo's bias is below 2^-40 here
    std::swap(seq[i], seq[j]);
  }
  return seq;
}

namespace detail {

bool launch_block_order(BlockOrdering* ordering, uint64_t* launch, std::string* error) {
  {
    detail::QuietLock lock(g_order_mutex);
    if (!settled_order(&g_blocks, ordering, error)) return false;
  }
  const uint64_t generation = g_generation.load();
  if (t_generation != generation) {
    t_generation = generation;
    t_launches = 0;
  }
  *launch = t_launches++;
  return true;
}

bool launch_thread_order(BlockOrdering* ordering, std::string* error) {
  detail::QuietLock lock(g_order_mutex);
  return settled_order(&g_threads, ordering, error);
}

}  // namespace detail
}  // namespace dq::emu
