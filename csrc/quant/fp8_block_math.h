#pragma once

// Block-wise FP8 (e4m3fn) quantization's arithmetic, shared by the CPU and CUDA kernels (no torch headers, so that
// nvcc compiles the .cu alone). The format and why each step is exact: megarl/reshard/fp8_reference.py.
//   scale = float32(max(amax, float32(1e-4)) / 448)     amax over the whole block of the full source; NaN = +inf
//   q     = e4m3fn(x / scale)                            x / scale in double, rounded to nearest even, satfinite
// Both divisions are done in double and rounded once more (to float32, to e4m3): the double quotient is never close
// enough to a tie of the narrower format to round across it, so each result is the correctly rounded one.

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __CUDACC__
#define MEGARL_HD __host__ __device__ __forceinline__
#else
#define MEGARL_HD inline
#endif

namespace megarl::quant {

constexpr double kE4m3Max = 448.0;
// float32(1e-4), SGLang's floor of a block's amax (per_block_cast_to_fp8's clamp(1e-4)).
constexpr float kAmaxFloor = 1e-4f;

// What one call quantizes: the source [rows, cols] (row stride in elements), and the window of it written, rows
// [row_begin, row_begin + out_rows) and columns [col_begin, col_begin + out_cols), into `out` (row stride in bytes,
// out[0][0] = source[row_begin][col_begin]). `scales` holds the blocks the window touches: scales[0][0] is block
// (row_begin / block_rows, col_begin / block_cols) of the full source's grid.
struct Window {
  const void* source;
  int64_t rows;
  int64_t cols;
  int64_t source_stride;
  uint8_t* out;
  int64_t out_stride;
  float* scales;
  int64_t scale_stride;
  int64_t row_begin;
  int64_t col_begin;
  int64_t out_rows;
  int64_t out_cols;
  int64_t block_rows;
  int64_t block_cols;
};

MEGARL_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks of the full grid the window touches: [first_block_row, first_block_row + block_grid_rows) etc.
MEGARL_HD int64_t first_block_row(const Window& w) { return w.row_begin / w.block_rows; }
MEGARL_HD int64_t first_block_col(const Window& w) { return w.col_begin / w.block_cols; }
MEGARL_HD int64_t scale_rows(const Window& w) {
  return ceil_div(w.row_begin + w.out_rows, w.block_rows) - first_block_row(w);
}
MEGARL_HD int64_t scale_cols(const Window& w) {
  return ceil_div(w.col_begin + w.out_cols, w.block_cols) - first_block_col(w);
}

// A float32's bits as float.
MEGARL_HD float bits_as_float(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// A bfloat16's bits as float (exact).
MEGARL_HD float bf16_to_float(uint16_t bits) { return bits_as_float(static_cast<uint32_t>(bits) << 16); }

MEGARL_HD float infinity() { return bits_as_float(0x7F800000u); }

// Whether v's sign bit is set (-0.0 included).
MEGARL_HD bool sign_bit(double v) {
#ifdef __CUDA_ARCH__
  return __double_as_longlong(v) < 0;
#else
  int64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits < 0;
#endif
}

// |x| for a block's amax, NaN counted as +inf (an amax must not drop a NaN, as fmax would).
MEGARL_HD float magnitude(float x) {
  const float a = x < 0 ? -x : x;
  return a == a ? a : infinity();
}

MEGARL_HD float max_of(float a, float b) { return a < b ? b : a; }

// The block's scale from its amax (NaN already +inf): float32 of max(amax, 1e-4) / 448, rounded to nearest even.
MEGARL_HD float block_scale(float amax) {
  const double a = amax < kAmaxFloor ? static_cast<double>(kAmaxFloor) : static_cast<double>(amax);
  return static_cast<float>(a / kE4m3Max);
}

// v rounded to the nearest integer, ties to even, for 0 <= v < 2^52 (no dependence on the rounding mode).
MEGARL_HD double round_half_even(double v) {
  double r = static_cast<double>(static_cast<int64_t>(v));  // floor for v >= 0
  const double d = v - r;                                    // exact: v and r share the binade's grid
  if (d > 0.5 || (d == 0.5 && static_cast<int64_t>(r) % 2 != 0)) {
    r += 1.0;
  }
  return r;
}

// v as float8_e4m3fn bits: nearest, ties to even; magnitudes from 448 up (infinities too) saturate to 448; NaN to
// 0x7F whatever its sign bit (which x86 and CUDA set differently for inf / inf). Subnormals m * 2^-9 encode as m,
// and a mantissa that rounds up to 8 (or 16) carries into the exponent field, which is the encoding of the next
// binade's first value.
MEGARL_HD uint8_t e4m3_from_double(double v) {
  if (v != v) {
    return 0x7F;
  }
  const uint8_t sign = sign_bit(v) ? 0x80 : 0x00;
  const double a = v < 0 ? -v : v;
  if (a >= kE4m3Max) {
    return sign | 0x7E;
  }
  if (a < 0.015625) {  // below 2^-6: subnormals, step 2^-9
    return sign | static_cast<uint8_t>(round_half_even(a * 512.0));
  }
  // a = f * 2^k, f in [0.5, 1): a in [2^e, 2^(e+1)) for e = k - 1 in [-6, 8], and its mantissa in steps of
  // 2^(e-3) is 16 f in [8, 16) (exact: a power-of-two scaling), rounded into [8, 16].
  int k = 0;
  const double f = frexp(a, &k);
  const int m = static_cast<int>(round_half_even(16.0 * f));
  return sign | static_cast<uint8_t>(((k - 1 + 7) << 3) + m - 8);
}

// One element quantized with its block's scale.
MEGARL_HD uint8_t quantize_one(float x, float scale) {
  return e4m3_from_double(static_cast<double>(x) / static_cast<double>(scale));
}

}  // namespace megarl::quant
