#include "tools/sim/gradients.h"

#include <tbb/parallel_for.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kernels/philox.h"

namespace dq::sim {
namespace {

struct FileCloser {
  void operator()(FILE* f) const {
    if (f) std::fclose(f);
  }
};
using File = std::unique_ptr<FILE, FileCloser>;

// Standard normal from two Philox words (Box-Muller); host only.
double normal(uint64_t seed, uint32_t stream, uint64_t index) {
  Philox4 w = philox_draw(seed, index >> 32, stream, 7, static_cast<uint32_t>(index));
  double u1 = (static_cast<double>(w.v[0]) + 1.0) / 4294967297.0;
  double u2 = static_cast<double>(w.v[1]) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// The dimensions of a .npy header's 'shape': (...) tuple, e.g. "(4, 1024)" or "(5,)"; *text is
// the tuple as written. False when there is no tuple of non-negative integers.
bool npy_shape(const std::string& header, std::vector<unsigned long long>* dims,
               std::string* text) {
  dims->clear();
  size_t open = header.find("'shape':");
  if (open == std::string::npos) return false;
  open = header.find('(', open);
  size_t close = open == std::string::npos ? open : header.find(')', open);
  if (close == std::string::npos) return false;
  *text = header.substr(open, close - open + 1);
  const std::string inner = header.substr(open + 1, close - open - 1);
  size_t pos = 0;
  while (pos < inner.size()) {
    while (pos < inner.size() && inner[pos] == ' ') ++pos;
    if (pos == inner.size()) break;  // "(5,)": a trailing comma
    char* end = nullptr;
    errno = 0;
    if (inner[pos] < '0' || inner[pos] > '9') return false;
    const unsigned long long v = std::strtoull(inner.c_str() + pos, &end, 10);
    if (errno) return false;
    dims->push_back(v);
    pos = end - inner.c_str();
    while (pos < inner.size() && inner[pos] == ' ') ++pos;
    if (pos < inner.size() && inner[pos] != ',') return false;
    ++pos;
  }
  return true;
}

}  // namespace

Status read_npy(const std::string& path, size_t max_rows, Matrix* out, std::string* error) {
  return read_npy_columns(path, max_rows, 0, SIZE_MAX, out, error);
}

Status read_npy_columns(const std::string& path, size_t max_rows, size_t col_begin, size_t col_end,
                        Matrix* out, std::string* error) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) {
    *error = path + ": cannot open (" + std::strerror(errno) + ")";
    return Status::kInvalidArgument;
  }
  unsigned char pre[10];
  if (std::fread(pre, 1, 10, f.get()) != 10 || std::memcmp(pre, "\x93NUMPY", 6) != 0) {
    *error = path + ": not a .npy file (bad magic)";
    return Status::kInvalidArgument;
  }
  size_t header_len = pre[8] | (pre[9] << 8);
  if (pre[6] >= 2) {
    unsigned char more[2];
    if (std::fread(more, 1, 2, f.get()) != 2) {
      *error = path + ": truncated header";
      return Status::kInvalidArgument;
    }
    header_len |= static_cast<size_t>(more[0]) << 16 | static_cast<size_t>(more[1]) << 24;
  }
  if (header_len > 65536) {
    *error = path + ": header too long";
    return Status::kInvalidArgument;
  }
  std::string header(header_len, '\0');
  if (std::fread(header.data(), 1, header_len, f.get()) != header_len) {
    *error = path + ": truncated header";
    return Status::kInvalidArgument;
  }
  if (header.find("'descr': '<f4'") == std::string::npos) {
    *error = path + ": dtype must be little-endian float32 ('<f4'); header: " + header;
    return Status::kInvalidArgument;
  }
  if (header.find("'fortran_order': False") == std::string::npos) {
    *error = path + ": must be C-ordered (fortran_order False)";
    return Status::kInvalidArgument;
  }
  // Exactly two dimensions [n_rows, d]: a 1-D or a 3-D array is refused, naming its shape.
  std::vector<unsigned long long> dims;
  std::string shape;
  if (!npy_shape(header, &dims, &shape)) {
    *error = path + ": no readable shape in the header: " + header;
    return Status::kInvalidArgument;
  }
  if (dims.size() != 2) {
    *error = path + ": shape " + shape + " has " + std::to_string(dims.size()) +
             " dimensions; dynamiq reads 2-D float32 arrays [n_rows, d]";
    return Status::kInvalidArgument;
  }
  const unsigned long long r = dims[0], c = dims[1];
  if (c != 0 && r > (1ull << 62) / 4 / c) {
    *error = path + ": shape " + shape + " is too large";
    return Status::kInvalidArgument;
  }
  // The shape is the file's claim: check it against the bytes that follow before allocating, so
  // a hostile or truncated header cannot make us allocate (and zero) more than the file holds.
  const long data_start = std::ftell(f.get());
  if (data_start < 0 || std::fseek(f.get(), 0, SEEK_END) != 0) {
    *error = path + ": cannot seek (" + std::strerror(errno) + ")";
    return Status::kInvalidArgument;
  }
  const long file_end = std::ftell(f.get());
  if (file_end < data_start || std::fseek(f.get(), data_start, SEEK_SET) != 0) {
    *error = path + ": cannot seek (" + std::strerror(errno) + ")";
    return Status::kInvalidArgument;
  }
  const unsigned long long rows_read = std::min<unsigned long long>(r, max_rows);
  const unsigned long long bytes_needed = rows_read * c * 4;
  const unsigned long long bytes_left = static_cast<unsigned long long>(file_end - data_start);
  if (bytes_needed > bytes_left) {
    *error = path + ": data shorter than its shape " + shape + ": " + std::to_string(bytes_left) +
             " bytes follow the header, " + std::to_string(bytes_needed) + " needed";
    return Status::kInvalidArgument;
  }
  const unsigned long long end = col_end == SIZE_MAX ? c : col_end;
  if (col_begin >= end || end > c) {
    *error = path + ": columns [" + std::to_string(col_begin) + ", " + std::to_string(col_end) +
             ") are empty or past the " + std::to_string(c) + " columns of shape " + shape;
    return Status::kInvalidArgument;
  }
  out->rows = static_cast<size_t>(rows_read);
  out->cols = static_cast<size_t>(end - col_begin);
  out->data.resize(out->rows * out->cols);
  for (size_t row = 0; row < out->rows; ++row) {
    // The whole file is checked against its shape above, so every seek lands inside it.
    const unsigned long long at = data_start + (row * c + col_begin) * 4ull;
    if (out->cols != c && std::fseek(f.get(), static_cast<long>(at), SEEK_SET) != 0) {
      *error = path + ": cannot seek (" + std::strerror(errno) + ")";
      return Status::kInvalidArgument;
    }
    if (std::fread(out->data.data() + row * out->cols, 4, out->cols, f.get()) != out->cols) {
      *error =
          path + ": data shorter than its shape " + std::to_string(r) + "x" + std::to_string(c);
      return Status::kInvalidArgument;
    }
  }
  return Status::kOk;
}

bool parse_column_range(const std::string& text, size_t* col_begin, size_t* col_end) {
  // Digits only (strtoull alone would take a sign or spaces), at most 19 of them (no overflow).
  auto number = [](const std::string& s, size_t* out) {
    if (s.empty() || s.size() > 19) return false;
    for (char c : s)
      if (c < '0' || c > '9') return false;
    *out = static_cast<size_t>(std::strtoull(s.c_str(), nullptr, 10));
    return true;
  };
  const size_t colon = text.find(':');
  if (colon == std::string::npos) return false;
  const std::string end = text.substr(colon + 1);
  if (!number(text.substr(0, colon), col_begin)) return false;
  if (end == "end") return *col_end = SIZE_MAX, true;
  return number(end, col_end) && *col_end > *col_begin;
}

Status write_npy(const std::string& path, const Matrix& m, std::string* error) {
  File f(std::fopen(path.c_str(), "wb"));
  if (!f) {
    *error = path + ": cannot create (" + std::strerror(errno) + ")";
    return Status::kInvalidArgument;
  }
  std::string dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (" +
                     std::to_string(m.rows) + ", " + std::to_string(m.cols) + "), }";
  size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict.push_back('\n');
  unsigned char pre[10] = {0x93,
                           'N',
                           'U',
                           'M',
                           'P',
                           'Y',
                           1,
                           0,
                           static_cast<unsigned char>(dict.size() & 0xff),
                           static_cast<unsigned char>(dict.size() >> 8)};
  bool ok = std::fwrite(pre, 1, 10, f.get()) == 10 &&
            std::fwrite(dict.data(), 1, dict.size(), f.get()) == dict.size() &&
            std::fwrite(m.data.data(), 4, m.data.size(), f.get()) == m.data.size();
  if (!ok) {
    *error = path + ": write failed";
    return Status::kSystemError;
  }
  return Status::kOk;
}

void make_synthetic(const SyntheticSpec& spec, Matrix* out) {
  out->rows = spec.rows;
  out->cols = spec.cols;
  out->data.resize(spec.rows * spec.cols);
  const size_t n_sg = (spec.cols + 255) / 256;
  std::vector<float> sg_scale(n_sg);
  for (size_t j = 0; j < n_sg; ++j)
    sg_scale[j] = static_cast<float>(std::pow(10.0, spec.spread * normal(spec.seed, 0, j)));
  const double a = std::sqrt(spec.shared), b = std::sqrt(1.0 - spec.shared);
  tbb::parallel_for(size_t{0}, spec.rows, [&](size_t r) {
    float* row = out->data.data() + r * spec.cols;
    for (size_t k = 0; k < spec.cols; ++k) {
      double common = normal(spec.seed, 1, k);
      double own = normal(spec.seed, 2 + static_cast<uint32_t>(r), k);
      row[k] = static_cast<float>(sg_scale[k / 256] * (a * common + b * own) * 1e-3);
    }
  });
}

}  // namespace dq::sim
