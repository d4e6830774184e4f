#include "kernels/codec.h"

#include <cstdlib>
#include <string>

#include "common/c_locale.h"
#include "kernels/dynamiq_codec.h"
#if __has_include("kernels/baselines/baselines.h")
#include "kernels/baselines/baselines.h"
#define DQ_HAVE_BASELINES 1
#endif

namespace dq {

Status Codec::local_stats(const ConstTensor&, uint16_t*) const {
  return Status::kOk;
}

Status check_element_base(const RoundingKey& key, size_t count) {
  if (key.element_base % 256 != 0)
    DQ_FAIL(Status::kInvalidArgument, "rounding key: element_base %llu is not a multiple of 256",
            static_cast<unsigned long long>(key.element_base));
  if (count > kMaxElementIndex || key.element_base > kMaxElementIndex - count)
    DQ_FAIL(Status::kInvalidArgument,
            "rounding key: elements %llu .. %llu + %zu exceed the 2^34 index limit",
            static_cast<unsigned long long>(key.element_base),
            static_cast<unsigned long long>(key.element_base), count);
  return Status::kOk;
}

Status Codec::agree(const uint16_t* reduced_stats_bf16, uint64_t call) {
  owned_layout_.assign((layout_bytes() + 7) / 8, 0);
  const Status s = build_layout(reduced_stats_bf16, call, owned_layout_.data());
  if (s != Status::kOk) owned_layout_.clear();  // hop()/finish() then refuse, not use half a layout
  return s;
}

double Codec::bits_per_coord() const {
  if (count_ == 0) return 0.0;
  const double bytes = 2.0 * stats_words() + static_cast<double>(n_chunks_) * chunk_capacity();
  return bytes * 8.0 / static_cast<double>(count_);
}

namespace {

bool parse_number(std::string_view text, double lo, double hi, double* out) {
  std::string s(text);
  char* end = nullptr;
  double v = strtod_c(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !(v >= lo && v <= hi)) return false;
  *out = v;
  return true;
}

// One DynamiQ option "key=value" into `o`; false when it is not understood.
bool parse_dynamiq_option(std::string_view item, CodecSpec* o) {
  const size_t eq = item.find('=');
  const std::string_view k = item.substr(0, eq);
  const std::string_view val =
      eq == std::string_view::npos ? std::string_view{} : item.substr(eq + 1);
  auto flag = [&](std::optional<bool>* dst, std::string_view on, std::string_view off) {
    if (val == on)
      *dst = true;
    else if (val == off)
      *dst = false;
    else
      return false;
    return true;
  };
  if (k == "corr") return flag(&o->correlated_rounding, "1", "0");
  if (k == "levels") return flag(&o->nonuniform_levels, "nonuniform", "uniform");
  if (k == "scales") return flag(&o->hierarchical_scales, "hier", "flat");
  if (k == "widths") return flag(&o->variable_widths, "var", "fixed");
  if (k == "mean") return flag(&o->mean_subtraction, "1", "0");
  if (k == "w16") return flag(&o->allow_width16, "1", "0");
  if (k == "eps2" || k == "eps4" || k == "eps8") {
    double v = 0;
    if (!parse_number(val, 0.0, 2.0, &v)) return false;
    o->eps[k == "eps2" ? 0 : k == "eps4" ? 1 : 2] = static_cast<float>(v);
    return true;
  }
  return false;
}

// `rest`: what follows "dynamiq:", the budget then options, colon-separated.
bool parse_dynamiq(std::string_view rest, CodecSpec* o, std::string* error) {
  o->family = CodecSpec::Family::kDynamiq;
  size_t part = 0;
  while (!rest.empty()) {
    size_t colon = rest.find(':');
    std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    if (part++ == 0) {
      if (!parse_number(item, 3.0, 32.0, &o->bits)) {
        *error = "dynamiq budget '" + std::string(item) + "' must be a number of bits in [3, 32]";
        return false;
      }
      continue;
    }
    if (!parse_dynamiq_option(item, o)) {
      *error = "dynamiq option '" + std::string(item) +
               "' not understood (accepted: corr=0|1, levels=nonuniform|uniform, "
               "scales=hier|flat, widths=var|fixed, mean=0|1, w16=0|1, eps2|eps4|eps8=0..2)";
      return false;
    }
  }
  if (part == 0) {
    *error = "dynamiq needs a budget, e.g. dynamiq:5";
    return false;
  }
  return true;
}

std::unique_ptr<Codec> make_dynamiq(const CodecSpec& spec) {
  DynamiqOptions o;
  o.budget_bits = spec.bits;
  auto take = [](const std::optional<bool>& from, bool* to) {
    if (from) *to = *from;
  };
  take(spec.correlated_rounding, &o.correlated_rounding);
  take(spec.nonuniform_levels, &o.nonuniform_levels);
  take(spec.hierarchical_scales, &o.hierarchical_scales);
  take(spec.variable_widths, &o.variable_widths);
  take(spec.mean_subtraction, &o.mean_subtraction);
  take(spec.allow_width16, &o.allow_width16);
  for (int i = 0; i < 3; ++i)
    if (spec.eps[i]) o.eps[i] = *spec.eps[i];
  return make_dynamiq_codec(o);
}

}  // namespace

bool parse_codec_spec(std::string_view spec, CodecSpec* out, std::string* error) {
  std::string scratch;
  if (!error) error = &scratch;
  CodecSpec c;
  c.bits = 0;
  using F = CodecSpec::Family;
  if (spec == "dynamiq") {
    c.family = F::kDynamiq;
    c.bits = 5.0;
    *out = c;
    return true;
  }
  if (spec.substr(0, 8) == "dynamiq:") {
    if (!parse_dynamiq(spec.substr(8), &c, error)) return false;
    *out = c;
    return true;
  }
#ifdef DQ_HAVE_BASELINES
  const std::pair<std::string_view, F> fixed[] = {
      {"bf16", F::kBf16},           {"mxfp8", F::kMxfp8},         {"mxfp6", F::kMxfp6E3M2},
      {"mxfp6e3m2", F::kMxfp6E3M2}, {"mxfp6e2m3", F::kMxfp6E2M3}, {"mxfp4", F::kMxfp4}};
  for (const auto& [name, family] : fixed)
    if (spec == name) {
      c.family = family;
      *out = c;
      return true;
    }
  if (spec.substr(0, 8) == "uniform:") {
    double b = 0;
    if (parse_number(spec.substr(8), 3, 9, &b) && b == static_cast<int>(b)) {
      c.family = F::kUniform;
      c.bits = b;
      *out = c;
      return true;
    }
    *error = "uniform:B needs an integer B in 3..9 (bits per coordinate, scale included)";
    return false;
  }
#endif
  *error = "unknown codec '" + std::string(spec) +
           "' (accepted: dynamiq:BUDGET[:opts], bf16, mxfp8, mxfp6 (=mxfp6e3m2), mxfp6e2m3, "
           "mxfp4, uniform:B)";
  return false;
}

std::string codec_spec_text(const CodecSpec& spec) {
  using F = CodecSpec::Family;
  switch (spec.family) {
    case F::kBf16:
      return "bf16";
    case F::kMxfp8:
      return "mxfp8";
    case F::kMxfp6E3M2:
      return "mxfp6";
    case F::kMxfp6E2M3:
      return "mxfp6e2m3";
    case F::kMxfp4:
      return "mxfp4";
    case F::kUniform:
      return "uniform:" + number_text(spec.bits, 17);
    case F::kDynamiq:
      break;
  }
  std::string text = "dynamiq:" + number_text(spec.bits, 17);
  auto flag = [&](const char* key, const std::optional<bool>& v, const char* on, const char* off) {
    if (v) text += std::string(":") + key + "=" + (*v ? on : off);
  };
  flag("corr", spec.correlated_rounding, "1", "0");
  flag("levels", spec.nonuniform_levels, "nonuniform", "uniform");
  flag("scales", spec.hierarchical_scales, "hier", "flat");
  flag("widths", spec.variable_widths, "var", "fixed");
  flag("mean", spec.mean_subtraction, "1", "0");
  flag("w16", spec.allow_width16, "1", "0");
  static const char* kEps[3] = {"eps2", "eps4", "eps8"};
  for (int i = 0; i < 3; ++i)
    if (spec.eps[i])
      text += std::string(":") + kEps[i] + "=" + number_text(static_cast<double>(*spec.eps[i]), 9);
  return text;
}

std::unique_ptr<Codec> make_codec(const CodecSpec& spec) {
  using F = CodecSpec::Family;
  switch (spec.family) {
    case F::kDynamiq:
      return make_dynamiq(spec);
#ifdef DQ_HAVE_BASELINES
    case F::kBf16:
      return make_bf16_codec();
    case F::kMxfp8:
      return make_mx_codec(MxKind::kFp8E4M3);
    case F::kMxfp6E3M2:
      return make_mx_codec(MxKind::kFp6E3M2);
    case F::kMxfp6E2M3:
      return make_mx_codec(MxKind::kFp6E2M3);
    case F::kMxfp4:
      return make_mx_codec(MxKind::kFp4E2M1);
    case F::kUniform:
      return make_uniform_codec(static_cast<int>(spec.bits));
#endif
    default:
      return nullptr;
  }
}

std::unique_ptr<Codec> make_codec(std::string_view spec, std::string* error) {
  std::string scratch;
  if (!error) error = &scratch;
  CodecSpec parsed;
  if (!parse_codec_spec(spec, &parsed, error)) return nullptr;
  std::unique_ptr<Codec> codec = make_codec(parsed);
  if (!codec) *error = "codec '" + std::string(spec) + "' is not in this build";
  return codec;
}

}  // namespace dq
