#include "kernels/codec.h"

#include <cstdlib>
#include <string>

#include "kernels/dynamiq_codec.h"
#if __has_include("kernels/baselines/baselines.h")
#include "kernels/baselines/baselines.h"
#define DQ_HAVE_BASELINES 1
#endif

namespace dq {

Status Codec::local_stats(const ConstTensor&, uint16_t*) const { return Status::kOk; }

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
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !(v >= lo && v <= hi)) return false;
  *out = v;
  return true;
}

std::unique_ptr<Codec> parse_dynamiq(std::string_view rest, std::string* error) {
  DynamiqOptions o;
  size_t part = 0;
  while (!rest.empty()) {
    size_t colon = rest.find(':');
    std::string_view item = rest.substr(0, colon);
    rest = colon == std::string_view::npos ? std::string_view{} : rest.substr(colon + 1);
    double v = 0;
    if (part++ == 0) {
      if (!parse_number(item, 3.0, 32.0, &v)) {
        *error = "dynamiq budget '" + std::string(item) + "' must be a number of bits in [3, 32]";
        return nullptr;
      }
      o.budget_bits = v;
      continue;
    }
    size_t eq = item.find('=');
    std::string_view k = item.substr(0, eq);
    std::string_view val = eq == std::string_view::npos ? std::string_view{} : item.substr(eq + 1);
    auto flag = [&](bool* dst, std::string_view on, std::string_view off) {
      if (val == on) *dst = true;
      else if (val == off) *dst = false;
      else return false;
      return true;
    };
    bool ok = false;
    if (k == "corr") ok = flag(&o.correlated_rounding, "1", "0");
    else if (k == "levels") ok = flag(&o.nonuniform_levels, "nonuniform", "uniform");
    else if (k == "scales") ok = flag(&o.hierarchical_scales, "hier", "flat");
    else if (k == "widths") ok = flag(&o.variable_widths, "var", "fixed");
    else if (k == "mean") ok = flag(&o.mean_subtraction, "1", "0");
    else if (k == "w16") ok = flag(&o.allow_width16, "1", "0");
    else if (k == "eps2" || k == "eps4" || k == "eps8") {
      ok = parse_number(val, 0.0, 2.0, &v);
      if (ok) o.eps[k == "eps2" ? 0 : k == "eps4" ? 1 : 2] = static_cast<float>(v);
    }
    if (!ok) {
      *error = "dynamiq option '" + std::string(item) +
               "' not understood (accepted: corr=0|1, levels=nonuniform|uniform, "
               "scales=hier|flat, widths=var|fixed, mean=0|1, w16=0|1, eps2|eps4|eps8=0..2)";
      return nullptr;
    }
  }
  if (part == 0) {
    *error = "dynamiq needs a budget, e.g. dynamiq:5";
    return nullptr;
  }
  return make_dynamiq_codec(o);
}

}  // namespace

std::unique_ptr<Codec> make_codec(std::string_view spec, std::string* error) {
  std::string scratch;
  if (!error) error = &scratch;
  if (spec == "dynamiq") return parse_dynamiq("5", error);
  if (spec.substr(0, 8) == "dynamiq:") return parse_dynamiq(spec.substr(8), error);
#ifdef DQ_HAVE_BASELINES
  if (spec == "bf16") return make_bf16_codec();
  if (spec == "mxfp8") return make_mx_codec(MxKind::kFp8E4M3);
  if (spec == "mxfp6" || spec == "mxfp6e3m2") return make_mx_codec(MxKind::kFp6E3M2);
  if (spec == "mxfp6e2m3") return make_mx_codec(MxKind::kFp6E2M3);
  if (spec == "mxfp4") return make_mx_codec(MxKind::kFp4E2M1);
  if (spec.substr(0, 8) == "uniform:") {
    double b = 0;
    if (parse_number(spec.substr(8), 3, 9, &b) && b == static_cast<int>(b))
      return make_uniform_codec(static_cast<int>(b));
    *error = "uniform:B needs an integer B in 3..9 (bits per coordinate, scale included)";
    return nullptr;
  }
#endif
  *error = "unknown codec '" + std::string(spec) +
           "' (accepted: dynamiq:BUDGET[:opts], bf16, mxfp8, mxfp6 (=mxfp6e3m2), mxfp6e2m3, "
           "mxfp4, uniform:B)";
  return nullptr;
}

}  // namespace dq
