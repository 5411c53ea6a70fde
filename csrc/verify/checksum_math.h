#pragma once

// The hand-over checksum's block and arithmetic (megarl/reshard/verify.py), shared by the CPU and CUDA kernels
// (no torch headers, so that nvcc compiles the .cu alone). For each of two primes p = 2^32 - c and a primitive
// root r of each, the checksum of a tensor is sum over elements of u * r^i mod p, u the element's bits as an
// unsigned integer (< 2^32: 8-byte elements enter as their two 4-byte halves, checksum.cpp) and i its flat
// position. Why this form:
//   - u < 2^32 and u = u' mod both primes only if u = u' (p0 * p1 > 2^32): every bit pattern counts, NaN
//     payloads and 0x7FFFFFFF included (a single 2^31 - 1 modulus folded those onto others).
//   - r^i repeats only after p - 1 positions, and the two periods' common multiple exceeds 2^62. A swap of
//     elements u != u' at distance d changes a sum unless p divides u - u' or p - 1 divides d, so both miss it
//     only at distances no tensor has, or for 4-byte patterns that differ by a prime (within 17 of 0 and of
//     2^32) at a multiple of the other prime's period. Positions mod 2^31 - 1 missed any swap 2^31 - 1 apart.
//   - Weights powers of r, not linear in i: two mirrored swaps ([a, b, b, a] -> [b, a, a, b]) no longer cancel.
//   - Sums of u * r^i are exact and order-free, so blocks add up from any split of the positions, and a kernel
//     may evaluate them by Horner's rule (one multiply-add per element and prime) as long as it ends canonical.

#include <cstdint>

#ifdef __CUDACC__
#define MEGARL_HD __host__ __device__ __forceinline__
#else
#define MEGARL_HD inline
#endif

namespace megarl::verify {

// `num_rows` rows of `run` elements, row r starting at element `offset + r * row_stride` of `data`, its
// element c at position `first + r * position_stride + c` of the engine tensor whose checksum it adds to.
// Elements of 1, 2 or 4 bytes here; checksum.cpp turns an 8-byte block into one of twice as many halves.
struct Block {
  const void* data;
  int64_t element_size;
  int64_t offset;
  int64_t row_stride;
  int64_t num_rows;
  int64_t run;
  int64_t first;
  int64_t position_stride;
};

// The primes are 2^32 - kFold0 and 2^32 - kFold1: a product reduces with two multiply-adds and no division.
constexpr uint64_t kFold0 = 5;
constexpr uint64_t kFold1 = 17;
constexpr uint64_t kPrime0 = (uint64_t{1} << 32) - kFold0;
constexpr uint64_t kPrime1 = (uint64_t{1} << 32) - kFold1;
constexpr uint64_t kBase0 = 0x9E3779B9;  // primitive roots, far from small integers
constexpr uint64_t kBase1 = 0xC2B2AE35;
constexpr uint64_t kLow = 0xFFFFFFFF;

// A value below 2^32 congruent to x mod 2^32 - C, for any 64-bit x (2^32 = C mod p).
template <uint64_t C>
MEGARL_HD uint64_t fold(uint64_t x) {
  x = (x & kLow) + C * (x >> 32);  // < (C + 1) * 2^32
  x = (x & kLow) + C * (x >> 32);  // < 2^32 + C * (C + 1)
  return (x & kLow) + C * (x >> 32);  // a carry left only a low part below C * (C + 1): < 2^32
}

// fold's result (< 2^32) reduced to [0, p).
template <uint64_t C>
MEGARL_HD uint64_t canonical(uint64_t x) {
  constexpr uint64_t p = (uint64_t{1} << 32) - C;
  return x >= p ? x - p : x;
}

// h * r + u mod p for h, r, u below 2^32 (the product and sum stay below 2^64): one step of Horner's rule.
template <uint64_t C>
MEGARL_HD uint64_t multiply_add(uint64_t h, uint64_t r, uint64_t u) {
  return fold<C>(h * r + u);
}

// r^(2^k) mod p for k < 64 and both primes: any power r^i is the product of the entries of i's set bits.
struct Powers {
  uint64_t of[2][64];
};

inline Powers make_powers() {
  Powers t{};
  uint64_t a = kBase0;
  uint64_t b = kBase1;
  for (int k = 0; k < 64; ++k) {
    t.of[0][k] = canonical<kFold0>(a);
    t.of[1][k] = canonical<kFold1>(b);
    a = multiply_add<kFold0>(a, a, 0);
    b = multiply_add<kFold1>(b, b, 0);
  }
  return t;
}

// r^i mod p of field F (below 2^32, maybe not canonical) for i >= 0.
template <int F>
MEGARL_HD uint64_t power(const Powers& t, uint64_t i) {
  uint64_t x = 1;
  for (int k = 0; i != 0; ++k, i >>= 1) {
    if (i & 1) {
      x = F == 0 ? multiply_add<kFold0>(x, t.of[0][k], 0) : multiply_add<kFold1>(x, t.of[1][k], 0);
    }
  }
  return x;
}

}  // namespace megarl::verify
