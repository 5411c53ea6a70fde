// C++ tests of block-wise FP8 quantization's CPU kernel and front end (run by ctest; see CMakeLists.txt): e4m3
// rounding against a brute-force nearest-value search over all 254 finite e4m3fn values, a window (a TP shard)
// against the same rows and columns of the whole tensor's quantization, and the front end's refusals.

#include "quant/fp8_block.h"
#include "tests/run_tests.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>

namespace {

using megarl::quant::e4m3_from_double;
using megarl::quant::fp8_block_quantize;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(what);
  }
}

// The value of a finite, non-negative e4m3fn encoding (bits 0x00..0x7E), from the format's definition.
double decode(int bits) {
  const int e = bits >> 3;
  const int m = bits & 7;
  return e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
}

// Nearest finite e4m3fn value to |v| < 464 by search, ties to the even encoding (its mantissa's last bit 0).
int nearest(double a) {
  int best = 0;
  for (int b = 1; b <= 0x7E; ++b) {
    const double d = std::fabs(decode(b) - a);
    const double best_d = std::fabs(decode(best) - a);
    if (d < best_d || (d == best_d && (b & 1) == 0)) {
      best = b;
    }
  }
  return best;
}

void test_rounding_is_nearest_even() {
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> exponent(-14.0, 9.0);
  for (int i = 0; i < 20000; ++i) {
    const double a = std::exp2(exponent(rng));
    if (a >= 464.0) {
      continue;
    }
    expect(e4m3_from_double(a) == nearest(a), "e4m3(" + std::to_string(a) + ") is not the nearest value");
    expect(e4m3_from_double(-a) == (0x80 | nearest(a)), "e4m3 of a negative value lost its sign");
  }
  // Every value and every midpoint between neighbours (ties go to the even encoding).
  for (int b = 0; b < 0x7E; ++b) {
    expect(e4m3_from_double(decode(b)) == b, "an e4m3 value does not encode to itself: " + std::to_string(b));
    const double mid = (decode(b) + decode(b + 1)) / 2;
    expect(e4m3_from_double(mid) == ((b & 1) == 0 ? b : b + 1), "a tie is not rounded to even: " + std::to_string(b));
  }
  expect(e4m3_from_double(448.0) == 0x7E && e4m3_from_double(464.0) == 0x7E && e4m3_from_double(1e30) == 0x7E &&
             e4m3_from_double(-INFINITY) == 0xFE,
         "magnitudes from 448 up do not saturate to 448");
  expect(e4m3_from_double(NAN) == 0x7F && e4m3_from_double(-NAN) == 0x7F, "NaN is not 0x7F");
  expect(e4m3_from_double(-0.0) == 0x80 && e4m3_from_double(0.0) == 0x00, "zeros lost their sign");
}

void test_a_window_is_a_slice_of_the_whole() {
  at::manual_seed(11);
  const at::Tensor source = (at::randn({37, 29}) * 3).to(at::kBFloat16);
  const int64_t br = 8;
  const int64_t bc = 6;
  const at::Tensor whole = at::empty({37, 29}, at::kFloat8_e4m3fn);
  const at::Tensor whole_scales = at::empty({5, 5}, at::kFloat);
  fp8_block_quantize(source, whole, whole_scales, 0, 0, br, bc);
  // Rows 13..30 and columns 7..20: both ends cut blocks.
  const at::Tensor part = at::empty({17, 13}, at::kFloat8_e4m3fn);
  const at::Tensor part_scales = at::empty({3, 3}, at::kFloat);
  fp8_block_quantize(source, part, part_scales, 13, 7, br, bc);
  expect(at::equal(part.view(at::kByte), whole.narrow(0, 13, 17).narrow(1, 7, 13).view(at::kByte)),
         "a window's values differ from the whole tensor's");
  expect(at::equal(part_scales, whole_scales.narrow(0, 1, 3).narrow(1, 1, 3)),
         "a window's scales differ from the whole tensor's");
}

template <typename F>
void expect_refused(F call, const std::string& needle) {
  try {
    call();
  } catch (const c10::Error& e) {
    const std::string message = e.what_without_backtrace();
    expect(message.find(needle) != std::string::npos, "the error '" + message + "' does not say '" + needle + "'");
    return;
  }
  throw std::runtime_error("not refused: expected an error saying '" + needle + "'");
}

void test_bad_arguments_are_refused() {
  const at::Tensor source = at::zeros({16, 16}, at::kBFloat16);
  const at::Tensor out = at::empty({16, 16}, at::kFloat8_e4m3fn);
  const at::Tensor scales = at::empty({2, 2}, at::kFloat);
  expect_refused([&] { fp8_block_quantize(source.to(at::kHalf), out, scales, 0, 0, 8, 8); },
                 "`source` must be bfloat16 or float32");
  expect_refused([&] { fp8_block_quantize(source, out.view(at::kByte), scales, 0, 0, 8, 8); },
                 "`out` must be float8_e4m3fn");
  expect_refused([&] { fp8_block_quantize(source, out, at::empty({2, 3}, at::kFloat), 0, 0, 8, 8); },
                 "`scales` must be [2, 2]");
  expect_refused([&] { fp8_block_quantize(source, out.narrow(0, 0, 9), scales, 8, 0, 8, 8); },
                 "do not fit the source's 16 rows");
  expect_refused([&] { fp8_block_quantize(source.t(), out, scales, 0, 0, 8, 8); },
                 "`source` must have contiguous rows");
  expect_refused([&] { fp8_block_quantize(source, out, scales, 0, 0, 0, 8); }, "`block_rows` and `block_cols`");
}

}  // namespace

int main() {
  return megarl::testing::run_tests({
      {"rounding_is_nearest_even", test_rounding_is_nearest_even},
      {"a_window_is_a_slice_of_the_whole", test_a_window_is_a_slice_of_the_whole},
      {"bad_arguments_are_refused", test_bad_arguments_are_refused},
  });
}
