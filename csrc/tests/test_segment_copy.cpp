// C++ tests of the CPU segment copy (run by ctest; see CMakeLists.txt). Results are checked
// against a byte-by-byte loop, so they never depend on the chunking under test.

#include "tests/run_tests.h"
#include "copy/chunking.h"
#include "copy/segment_copy.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/Resize.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using megarl::copy::ChunkGeometry;
using megarl::copy::ChunkRect;
using megarl::copy::SmallDivider;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    throw std::runtime_error(what);
  }
}

struct Spec {
  int64_t src_index, src_offset, src_stride, dst_index, dst_offset, dst_stride, rows, row_bytes;
};

int64_t span(int64_t rows, int64_t stride, int64_t row_bytes) {
  return rows == 0 || row_bytes == 0 ? 0 : (rows - 1) * stride + row_bytes;
}

at::Tensor table_of(const std::vector<Spec>& specs) {
  at::Tensor t = at::empty({static_cast<int64_t>(specs.size()), 8}, at::kLong);
  std::memcpy(t.data_ptr<int64_t>(), specs.data(), specs.size() * sizeof(Spec));
  return t;
}

at::Tensor random_bytes(std::mt19937_64& rng, int64_t n) {
  at::Tensor t = at::empty({n}, at::kByte);
  for (int64_t i = 0; i < n; ++i) {
    t.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(rng());
  }
  return t;
}

void naive_copy(const std::vector<at::Tensor>& srcs, std::vector<at::Tensor>& dsts,
                const std::vector<Spec>& specs) {
  for (const Spec& s : specs) {
    const uint8_t* src = srcs[s.src_index].data_ptr<uint8_t>();
    uint8_t* dst = dsts[s.dst_index].data_ptr<uint8_t>();
    for (int64_t r = 0; r < s.rows; ++r) {
      for (int64_t b = 0; b < s.row_bytes; ++b) {
        dst[s.dst_offset + r * s.dst_stride + b] = src[s.src_offset + r * s.src_stride + b];
      }
    }
  }
}

// Destinations are placed one after another so they never overlap; sources are anywhere.
std::vector<Spec> random_specs(std::mt19937_64& rng, const std::vector<at::Tensor>& srcs,
                               const std::vector<at::Tensor>& dsts, int count, int64_t max_row_bytes) {
  std::vector<int64_t> cursor(dsts.size(), 0);
  std::vector<Spec> specs;
  auto pick = [&](int64_t hi) { return static_cast<int64_t>(rng() % static_cast<uint64_t>(hi + 1)); };
  const int64_t row_choices[] = {0, 1, 1, 2, 5, 17, 64, 300};
  for (int i = 0; i < count; ++i) {
    Spec s{};
    s.src_index = pick(static_cast<int64_t>(srcs.size()) - 1);
    s.dst_index = pick(static_cast<int64_t>(dsts.size()) - 1);
    s.rows = row_choices[pick(7)];
    s.row_bytes = pick(max_row_bytes);
    s.dst_stride = s.row_bytes + pick(8);
    s.src_stride = pick(2 * max_row_bytes);
    s.dst_offset = cursor[s.dst_index] + pick(5);
    const bool fits = s.dst_offset + span(s.rows, s.dst_stride, s.row_bytes) <= dsts[s.dst_index].numel() &&
                      span(s.rows, s.src_stride, s.row_bytes) <= srcs[s.src_index].numel();
    if (!fits) {
      s.rows = 0;
    }
    s.src_offset = pick(srcs[s.src_index].numel() - span(s.rows, s.src_stride, s.row_bytes));
    cursor[s.dst_index] = s.dst_offset + span(s.rows, s.dst_stride, s.row_bytes);
    specs.push_back(s);
  }
  return specs;
}

void test_small_divider() {
  for (uint32_t d = 1; d < (1u << 16); ++d) {
    const SmallDivider div = SmallDivider::make(d);
    for (uint64_t k = 0; k * d < (1u << 16); ++k) {
      for (const uint64_t n : {k * d, k * d + d - 1}) {
        if (n < (1u << 16)) {
          expect(div.div(static_cast<uint32_t>(n)) == n / d,
                 "SmallDivider: " + std::to_string(n) + " / " + std::to_string(d));
        }
      }
    }
  }
}

void test_chunks_tile_each_segment_once() {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 2000; ++trial) {
    const int64_t rows = static_cast<int64_t>(rng() % 40);
    const int64_t row_units = static_cast<int64_t>(rng() % 300);
    const int64_t chunk_units = 1 + static_cast<int64_t>(rng() % 128);
    const ChunkGeometry g = megarl::copy::make_chunk_geometry(rows, row_units, chunk_units);
    std::vector<int> hits(static_cast<size_t>(rows * row_units), 0);
    for (int64_t c = 0; c < g.num_chunks; ++c) {
      const ChunkRect r = megarl::copy::chunk_rect(g, c);
      expect(r.num_rows * r.num_cols <= chunk_units && r.num_rows > 0 && r.num_cols > 0,
             "chunk larger than chunk_units or empty");
      for (int64_t i = r.row_begin; i < r.row_begin + r.num_rows; ++i) {
        for (int64_t j = r.col_begin; j < r.col_begin + r.num_cols; ++j) {
          expect(i < rows && j < row_units, "chunk outside its segment");
          ++hits[static_cast<size_t>(i * row_units + j)];
        }
      }
    }
    for (const int h : hits) {
      expect(h == 1, "a byte is covered " + std::to_string(h) + " times");
    }
  }
}

void check_random_tables(int num_threads) {
  at::set_num_threads(num_threads);
  std::mt19937_64 rng(static_cast<uint64_t>(num_threads));
  for (int trial = 0; trial < 5; ++trial) {
    std::vector<at::Tensor> srcs{random_bytes(rng, 3 << 20), random_bytes(rng, 1000),
                                 random_bytes(rng, 77777)};
    std::vector<at::Tensor> dsts{random_bytes(rng, 5 << 20), random_bytes(rng, 4 << 20)};
    std::vector<Spec> specs = random_specs(rng, srcs, dsts, 60, 5000);
    // A 3 MB row is cut into many chunks, so one segment's row is split across threads. It gets
    // a destination of its own, as destinations must not overlap.
    dsts.push_back(random_bytes(rng, 4 << 20));
    specs.push_back({0, 0, 0, 2, 0, 0, 1, 3 << 20});
    specs.push_back({0, 5, 7, 2, (3 << 20) + 1, 3, 0, 100});
    std::vector<at::Tensor> expected;
    for (const at::Tensor& d : dsts) {
      expected.push_back(d.clone());
    }
    naive_copy(srcs, expected, specs);
    std::vector<at::Tensor> planned;
    for (const at::Tensor& d : dsts) {
      planned.push_back(d.clone());
    }
    megarl::copy::copy_segments(srcs, dsts, table_of(specs));
    const megarl::copy::SegmentCopy copier(srcs, planned, table_of(specs));
    copier.run();
    for (size_t i = 0; i < dsts.size(); ++i) {
      expect(at::equal(dsts[i], expected[i]), "copy_segments differs from the naive loop");
      expect(at::equal(planned[i], expected[i]), "SegmentCopy::run differs from the naive loop");
    }
  }
}

void test_random_tables() {
  for (const int threads : {1, 2, 4}) {
    check_random_tables(threads);
  }
}

void test_bad_segment_is_named_before_any_copy() {
  std::vector<at::Tensor> srcs{at::arange(64, at::kByte)};
  std::vector<at::Tensor> dsts{at::zeros({64}, at::kByte)};
  const std::vector<Spec> specs{{0, 0, 0, 0, 0, 0, 1, 8}, {0, 60, 0, 0, 8, 0, 1, 8}};
  bool threw = false;
  try {
    megarl::copy::copy_segments(srcs, dsts, table_of(specs));
  } catch (const c10::Error& e) {
    threw = std::string(e.what()).find("segment 1") != std::string::npos;
  }
  expect(threw, "an out-of-bounds segment 1 must raise an error naming it");
  expect(at::equal(dsts[0], at::zeros({64}, at::kByte)), "nothing may be copied when a segment is bad");
}

// The error's text, or "" if `f` does not throw.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& words) {
  return text.find(words) != std::string::npos;
}

void test_overlapping_destinations_are_refused() {
  const std::vector<at::Tensor> srcs{at::arange(256, at::kByte)};
  const at::Tensor dst = at::zeros({256}, at::kByte);
  // Views of one storage: the overlap is in memory, whatever the tensors are called.
  const std::vector<at::Tensor> dsts{dst, dst.narrow(0, 64, 64)};
  const megarl::copy::Labels names{{"src"}, {"model.embed_tokens.weight", "landing"}};
  const std::vector<std::vector<Spec>> overlapping{
      {{0, 0, 0, 0, 0, 0, 1, 16}, {0, 100, 0, 0, 15, 0, 1, 4}},                  // one byte shared
      {{0, 0, 8, 0, 0, 10, 8, 4}, {0, 0, 8, 0, 23, 10, 3, 4}},                   // same stride, rows 2..4 of each
      {{0, 0, 8, 0, 0, 10, 8, 4}, {0, 0, 8, 0, 71, 7, 3, 2}},                    // other strides: [71, 73) in [70, 74)
      {{0, 0, 0, 0, 70, 0, 1, 2}, {0, 0, 0, 1, 0, 0, 1, 16}},                    // through the second view
  };
  for (const std::vector<Spec>& specs : overlapping) {
    const std::string text = error_of([&] { megarl::copy::SegmentCopy(srcs, dsts, table_of(specs), names); });
    expect(contains(text, "segment 0") && contains(text, "segment 1") && contains(text, "write the same bytes") &&
               contains(text, "`model.embed_tokens.weight`"),
           "overlapping destinations are not refused by name: " + text);
    expect(contains(error_of([&] { megarl::copy::copy_segments(srcs, dsts, table_of(specs)); }), "write the same"),
           "copy_segments takes overlapping destinations");
  }
  expect(at::equal(dst, at::zeros({256}, at::kByte)), "nothing may be copied when segments overlap");
}

void test_interleaved_destinations_are_accepted() {
  // Column slices of one matrix from several sources (a row-parallel weight from TP ranks): extents overlap,
  // bytes do not.
  const std::vector<at::Tensor> srcs{at::arange(64, at::kByte), at::arange(64, at::kByte).add(64)};
  const std::vector<at::Tensor> dsts{at::zeros({128}, at::kByte)};
  const std::vector<Spec> specs{{0, 0, 4, 0, 0, 8, 16, 4}, {1, 0, 4, 0, 4, 8, 16, 4},
                                {0, 0, 0, 0, 127, 0, 0, 0}};
  megarl::copy::SegmentCopy(srcs, dsts, table_of(specs)).run();
  expect(at::equal(dsts[0].view({16, 2, 4}).select(1, 1).reshape(-1), srcs[1]), "interleaved columns");
  const std::vector<at::Tensor> other{at::zeros({128}, at::kByte)};
  // Bytes 12k, 12k + 1, 12k + 2 against bytes 4j + 3: other strides, extents overlapping, no byte shared.
  const std::vector<Spec> strided{{0, 0, 0, 0, 0, 12, 10, 3}, {0, 0, 0, 0, 3, 4, 30, 1}, {0, 0, 0, 0, 121, 0, 1, 7}};
  const std::string text = error_of([&] { megarl::copy::SegmentCopy(srcs, other, table_of(strided)); });
  expect(text.empty(), "segments of other strides that share no byte are refused: " + text);
}

void test_a_moved_storage_is_refused_at_run() {
  const std::vector<at::Tensor> srcs{at::arange(64, at::kByte)};
  at::Tensor dst = at::zeros({64}, at::kByte);
  const std::vector<Spec> specs{{0, 0, 0, 0, 0, 0, 1, 64}};
  const megarl::copy::Labels names{{"trainer.fc1"}, {"model.layers.0.mlp.gate_up_proj.weight"}};
  const megarl::copy::SegmentCopy copier(srcs, {dst}, table_of(specs), names);
  copier.run();
  // An offload frees the storage (resize_(0)); the copy still held its old address.
  at::native::resize_bytes_cpu(dst.storage().unsafeGetStorageImpl(), 0);
  std::string text = error_of([&] { copier.run(); });
  expect(contains(text, "`model.layers.0.mlp.gate_up_proj.weight`") && contains(text, "no longer has the memory"),
         "a freed destination is written: " + text);
  // Brought back: memory again, but not the memory the copy was built on.
  at::native::resize_bytes_cpu(dst.storage().unsafeGetStorageImpl(), 64);
  const at::Tensor src = srcs[0];
  src.set_(at::zeros({64}, at::kByte));
  text = error_of([&] { copier.run(); });
  expect(contains(text, "`trainer.fc1`") || contains(text, "`model.layers.0.mlp.gate_up_proj.weight`"),
         "a replaced storage is read or written: " + text);
}

void test_a_tensor_without_memory_is_refused_by_name() {
  at::Tensor dst = at::zeros({64}, at::kByte);
  at::native::resize_bytes_cpu(dst.storage().unsafeGetStorageImpl(), 0);
  const std::vector<Spec> specs{{0, 0, 0, 0, 0, 0, 1, 64}};
  const megarl::copy::Labels names{{}, {"lm_head.weight"}};
  const std::string text = error_of([&] {
    megarl::copy::SegmentCopy({at::arange(64, at::kByte)}, {dst}, table_of(specs), names);
  });
  expect(contains(text, "dsts[0] (`lm_head.weight`) has no memory"), "an offloaded destination is taken: " + text);
}

}  // namespace

int main() {
  return megarl::testing::run_tests({
      {"small_divider", test_small_divider},
      {"chunks_tile_each_segment_once", test_chunks_tile_each_segment_once},
      {"random_tables", test_random_tables},
      {"bad_segment_is_named_before_any_copy", test_bad_segment_is_named_before_any_copy},
      {"overlapping_destinations_are_refused", test_overlapping_destinations_are_refused},
      {"interleaved_destinations_are_accepted", test_interleaved_destinations_are_accepted},
      {"a_moved_storage_is_refused_at_run", test_a_moved_storage_is_refused_at_run},
      {"a_tensor_without_memory_is_refused_by_name", test_a_tensor_without_memory_is_refused_by_name},
  });
}
