// dynamiq's settings: one table (settings.def), parsed and validated once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::config {

struct Settings {
  bool enable = false;
  std::string codec;
  double bits = 5;
  std::string topology;
  int64_t min_bytes = 0;
  std::string dtypes;
  std::string collectives;
  bool correlated = true;
  int64_t seed = 0;
  int64_t timeout_ms = 0;
  std::string comms;
  int64_t block_bytes = 0;
  std::string control_file;
  std::string metrics_file;
  double metrics_interval_s = 10;

  // Derived once by load(): the codec spec handed to make_codec, the dtype mask.
  std::string codec_spec;
  bool allow_f32 = true, allow_bf16 = true;
  bool allow_all_reduce = true, allow_reduce_scatter = true, allow_reduce = true;
};

// Where a value comes from: the environment in production, a map in tests.
using EnvLookup = const char* (*)(const char* key, void* ctx);

// Parses and validates every setting. On the first invalid value it returns kInvalidArgument
// with *error naming the variable, the value and what is accepted; *out then holds the defaults
// with enable = false (callers pass everything through).
Status load(EnvLookup lookup, void* ctx, Settings* out, std::string* error);
Status load_from_environment(Settings* out, std::string* error);

// The process-wide settings, loaded on first use; a failure is logged once (WARN) and leaves
// compression disabled (global_valid() then returns false).
const Settings& global();
bool global_valid();

// One line per setting "KEY=value (default ...)", for DYNAMIQ_DEBUG=INFO.
std::string describe(const Settings& s);

// Settings that every rank must share. hash(i) of agreed setting i; name(i) its env key.
struct Agreed {
  static int count();
  static const char* key(int i);
  static uint32_t hash(const Settings& s, int i);
};

}  // namespace dq::config
