// Inputs for the simulator: float32 .npy matrices [rows, d] and synthetic gradients whose
// super-group norms spread over a tunable number of orders of magnitude.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace dq::sim {

struct Matrix {
  size_t rows = 0, cols = 0;
  std::vector<float> data;  // row-major
  const float* row(size_t r) const { return data.data() + r * cols; }
};

// Reads a little-endian float32, C-order .npy of 2 dimensions; max_rows limits what is loaded.
// Errors name the file and what was wrong with it.
Status read_npy(const std::string& path, size_t max_rows, Matrix* out, std::string* error);
// The same, columns [col_begin, col_end) of each row only (col_end SIZE_MAX: to the end), so that a
// part of a multi-GB corpus is read without the rest.
Status read_npy_columns(const std::string& path, size_t max_rows, size_t col_begin, size_t col_end,
                        Matrix* out, std::string* error);
// The tools' --columns value: "B:E" (decimal, B < E) or "B:end" (*col_end = SIZE_MAX). False
// for anything else.
bool parse_column_range(const std::string& text, size_t* col_begin, size_t* col_end);
Status write_npy(const std::string& path, const Matrix& m, std::string* error);

struct SyntheticSpec {
  size_t rows = 4;
  size_t cols = 1 << 20;
  double spread = 2.0;  // std-dev of log10(super-group scale): 0 = no locality
  double shared = 0.5;  // fraction of variance common to all workers (true gradient)
  uint64_t seed = 1;
};
// Deterministic in (spec): worker r's row is the same whatever the number of rows.
void make_synthetic(const SyntheticSpec& spec, Matrix* out);

}  // namespace dq::sim
