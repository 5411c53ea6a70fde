// Front end of the segment copy: validates the table against the tensors, then hands resolved
// segments to the CPU or CUDA backend.

#include "segment_copy.h"

#include "backends.h"
#include "storage.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

namespace megarl::copy {
namespace {

std::string describe(int64_t i, const int64_t* row) {
  std::ostringstream out;
  out << "segment " << i << " (src_index=" << row[kSrcIndex] << " src_offset=" << row[kSrcOffset]
      << " src_row_stride=" << row[kSrcStride] << " dst_index=" << row[kDstIndex]
      << " dst_offset=" << row[kDstOffset] << " dst_row_stride=" << row[kDstStride]
      << " num_rows=" << row[kNumRows] << " row_bytes=" << row[kRowBytes] << ")";
  return out.str();
}

std::string label(const char* side, size_t index, const std::vector<std::string>& names) {
  std::string text = std::string(side) + "[" + std::to_string(index) + "]";
  return index < names.size() && !names[index].empty() ? text + " (`" + names[index] + "`)" : text;
}

void check_tensors(const std::vector<at::Tensor>& tensors, const char* side, c10::Device device,
                   const std::vector<std::string>& names) {
  TORCH_CHECK(names.empty() || names.size() == tensors.size(), "copy_segments: ", names.size(), " ", side,
              " names for ", tensors.size(), " tensors; pass one name per tensor or none");
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "copy_segments: ", label(side, i, names), " is an undefined tensor");
    TORCH_CHECK(t.device() == device, "copy_segments: all tensors must be on one device, but ",
                label(side, i, names), " is on ", t.device(), " and the first tensor on ", device);
    TORCH_CHECK(t.is_contiguous(), "copy_segments: ", label(side, i, names),
                " is not contiguous; pass a contiguous tensor (strides belong in the table)");
    TORCH_CHECK(holds_memory(t), "copy_segments: ", label(side, i, names), " has no memory behind it: its storage holds ",
                t.storage().nbytes(), " bytes, fewer than its ", t.nbytes(),
                " (offloaded with storage resize_(0)?); bring it back before building the copy");
  }
}

// Returns false if the byte range [offset, offset + (rows - 1) * stride + row_bytes) would
// overflow int64, and the range's end in *end otherwise.
bool span_end(int64_t offset, int64_t stride, int64_t rows, int64_t row_bytes, int64_t* end) {
  int64_t span = 0;
  return !c10::mul_overflows(rows - 1, stride, &span) && !c10::add_overflows(span, row_bytes, &span) &&
         !c10::add_overflows(offset, span, end);
}

void check_range(int64_t i, const int64_t* row, const std::string& tensor, int64_t offset, int64_t stride,
                 const at::Tensor& t) {
  int64_t end = 0;
  const bool fits = span_end(offset, stride, row[kNumRows], row[kRowBytes], &end);
  TORCH_CHECK(fits && end <= static_cast<int64_t>(t.nbytes()), "copy_segments: ", describe(i, row),
              " needs bytes [", offset, ", ", fits ? std::to_string(end) : std::string("overflow"),
              ") of ", tensor, ", which has ", t.nbytes(), " bytes");
}

Segment resolve_one(int64_t i, const int64_t* row, const std::vector<at::Tensor>& srcs,
                    const std::vector<at::Tensor>& dsts, const Labels& names) {
  const int64_t si = row[kSrcIndex];
  const int64_t di = row[kDstIndex];
  TORCH_CHECK(si >= 0 && si < static_cast<int64_t>(srcs.size()), "copy_segments: ", describe(i, row),
              " has src_index out of range for ", srcs.size(), " source tensors");
  TORCH_CHECK(di >= 0 && di < static_cast<int64_t>(dsts.size()), "copy_segments: ", describe(i, row),
              " has dst_index out of range for ", dsts.size(), " destination tensors");
  for (const Column c : {kSrcOffset, kSrcStride, kDstOffset, kDstStride, kNumRows, kRowBytes}) {
    TORCH_CHECK(row[c] >= 0, "copy_segments: ", describe(i, row),
                " has a negative offset, stride, num_rows or row_bytes");
  }
  const int64_t rows = row[kNumRows];
  const int64_t row_bytes = row[kRowBytes];
  // Rows of one segment are written in parallel, so they must not overlap.
  TORCH_CHECK(rows <= 1 || row[kDstStride] >= row_bytes, "copy_segments: ", describe(i, row),
              " has dst_row_stride < row_bytes, so its destination rows overlap");
  Segment s{nullptr, nullptr, rows, row_bytes, row[kSrcStride], row[kDstStride]};
  if (rows == 0 || row_bytes == 0) {
    return s;
  }
  check_range(i, row, label("srcs", si, names.srcs), row[kSrcOffset], row[kSrcStride], srcs[si]);
  check_range(i, row, label("dsts", di, names.dsts), row[kDstOffset], row[kDstStride], dsts[di]);
  s.src = static_cast<const uint8_t*>(srcs[si].const_data_ptr()) + row[kSrcOffset];
  s.dst = static_cast<uint8_t*>(dsts[di].data_ptr()) + row[kDstOffset];
  // Densely packed rows on both sides are one long row: fewer, larger chunks and no row math.
  if (rows > 1 && s.src_stride == row_bytes && s.dst_stride == row_bytes) {
    s.row_bytes = rows * row_bytes;
    s.num_rows = 1;
    s.src_stride = s.row_bytes;
    s.dst_stride = s.row_bytes;
  }
  return s;
}

#ifdef MEGARL_WITH_CUDA
constexpr bool kWithCuda = true;
#else
constexpr bool kWithCuda = false;
#endif

void check_backend(c10::Device device) {
  TORCH_CHECK(device.is_cpu() || device.is_cuda(), "copy_segments: tensors on ", device,
              " are not supported; use CPU or CUDA tensors");
  TORCH_CHECK(device.is_cpu() || kWithCuda,
              "copy_segments: got CUDA tensors but megarl._C was built without CUDA; rebuild on a "
              "machine with a CUDA build of torch and nvcc (pip install --no-build-isolation -e .)");
}

int64_t sum_bytes(const std::vector<Segment>& segments) {
  int64_t total = 0;
  for (const Segment& s : segments) {
    total += s.num_rows * s.row_bytes;
  }
  return total;
}

// Where a non-empty segment writes (or reads): rows [start + k * stride, start + k * stride + row_bytes), k < rows.
struct Writes {
  uintptr_t start;
  int64_t rows;
  int64_t stride;
  int64_t row_bytes;
  int64_t index;  // its row of the table
  int64_t dst;    // its dst_index (src_index for a read)
  bool read = false;
  uintptr_t end() const { return start + static_cast<uintptr_t>((rows - 1) * stride + row_bytes); }
};

// A segment's reads: rows that touch or overlap (a stride up to row_bytes, 0 included: one row read again) are
// one contiguous range.
Writes reads_of(const Segment& s, int64_t index, int64_t src) {
  if (s.num_rows > 1 && s.src_stride <= s.row_bytes) {
    const int64_t extent = (s.num_rows - 1) * s.src_stride + s.row_bytes;
    return {reinterpret_cast<uintptr_t>(s.src), 1, extent, extent, index, src, true};
  }
  return {reinterpret_cast<uintptr_t>(s.src), s.num_rows, s.src_stride, s.row_bytes, index, src, true};
}

bool same_bytes(const Writes& a, const Writes& b) {
  return a.start == b.start && a.rows == b.rows && a.row_bytes == b.row_bytes && (a.rows == 1 || a.stride == b.stride);
}

int64_t floor_div(int64_t a, int64_t b) {
  const int64_t q = a / b;
  return q * b > a ? q - 1 : q;
}

// Whether rows [k * stride, k * stride + a_bytes), k < a_rows, meet rows [d + k * stride, d + k * stride + b_bytes),
// k < b_rows, of the same stride (>= 1): is there an m = (a's row - b's row) in [-(b_rows - 1), a_rows - 1] with
// d - a_bytes < m * stride < d + b_bytes?
bool rows_meet(int64_t d, int64_t a_rows, int64_t a_bytes, int64_t b_rows, int64_t b_bytes, int64_t stride) {
  const int64_t m = std::max(floor_div(d - a_bytes, stride) + 1, -(b_rows - 1));
  return m <= a_rows - 1 && m * stride < d + b_bytes;
}

// Exact, not by extents: column slices of one matrix interleave without sharing a byte. O(1) where the strides
// agree (or a side has one row), else O(rows of the shorter).
bool overlap(const Writes& a, const Writes& b) {
  const int64_t d = static_cast<int64_t>(b.start - a.start);  // same device memory: far below 2^63 apart
  if (a.rows == 1 || b.rows == 1 || a.stride == b.stride) {
    const int64_t stride = a.rows > 1 ? a.stride : (b.rows > 1 ? b.stride : 1);
    return rows_meet(d, a.rows, a.row_bytes, b.rows, b.row_bytes, stride);
  }
  const Writes& few = a.rows <= b.rows ? a : b;
  const Writes& many = a.rows <= b.rows ? b : a;
  for (int64_t k = 0; k < few.rows; ++k) {
    const int64_t gap = static_cast<int64_t>(many.start - few.start) - k * few.stride;
    if (rows_meet(gap, 1, few.row_bytes, many.rows, many.row_bytes, many.stride)) {
      return true;
    }
  }
  return false;
}

// Rows of a copy are written in parallel, so a byte two segments write holds whichever landed last, and a byte one
// segment reads while another writes it may be read before or after. Sorted by where they start, each range is
// compared only with those whose extent it starts inside. A segment that copies bytes onto themselves (a tensor
// given as both its source and its destination) changes nothing and passes.
void check_no_overlap(std::vector<Writes> writes, const int64_t* table, const Labels& names) {
  std::sort(writes.begin(), writes.end(), [](const Writes& x, const Writes& y) { return x.start < y.start; });
  std::vector<const Writes*> open;
  for (const Writes& w : writes) {
    open.erase(std::remove_if(open.begin(), open.end(), [&](const Writes* o) { return o->end() <= w.start; }),
               open.end());
    for (const Writes* o : open) {
      if (o->read && w.read) {
        continue;
      }
      if (o->read != w.read) {
        const Writes& r = o->read ? *o : w;
        const Writes& wr = o->read ? w : *o;
        if ((r.index == wr.index && same_bytes(r, wr)) || !overlap(*o, w)) {
          continue;
        }
        TORCH_CHECK(false, "copy_segments: ", describe(r.index, table + r.index * kNumColumns), " reads bytes of ",
                    label("srcs", static_cast<size_t>(r.dst), names.srcs), " that ",
                    r.index == wr.index ? std::string("it writes itself") :
                    describe(wr.index, table + wr.index * kNumColumns) + " writes",
                    " (", label("dsts", static_cast<size_t>(wr.dst), names.dsts), " shares their memory); rows are "
                    "copied in parallel, so it could read them before or after they change. Copy from a buffer "
                    "that no segment writes");
      }
      const Writes& a = o->index < w.index ? *o : w;  // named in table order
      const Writes& b = o->index < w.index ? w : *o;
      TORCH_CHECK(!overlap(a, b), "copy_segments: ", describe(a.index, table + a.index * kNumColumns), " and ",
                  describe(b.index, table + b.index * kNumColumns), " write the same bytes of ",
                  label("dsts", static_cast<size_t>(a.dst), names.dsts),
                  a.dst == b.dst ? std::string() : " and " + label("dsts", static_cast<size_t>(b.dst), names.dsts),
                  "; rows are written in parallel, so the result would be whichever landed last. Give every "
                  "destination byte one segment");
    }
    open.push_back(&w);
  }
}

}  // namespace

c10::Device common_device(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts) {
  for (const auto* list : {&srcs, &dsts}) {
    for (const at::Tensor& t : *list) {
      if (t.defined()) {
        return t.device();
      }
    }
  }
  return c10::Device(c10::kCPU);
}

std::vector<Segment> resolve_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                                      const at::Tensor& table, const Labels& names) {
  const c10::Device device = common_device(srcs, dsts);
  check_tensors(srcs, "srcs", device, names.srcs);
  check_tensors(dsts, "dsts", device, names.dsts);
  TORCH_CHECK(table.defined() && table.device().is_cpu(),
              "copy_segments: the segment table must be a CPU tensor (it is read on the host)");
  TORCH_CHECK(table.scalar_type() == at::kLong, "copy_segments: the segment table must be int64, got ",
              table.scalar_type());
  TORCH_CHECK(table.dim() == 2 && table.size(1) == kNumColumns,
              "copy_segments: the segment table must have shape [n, 8], got ", table.sizes());
  const at::Tensor rows = table.contiguous();
  const int64_t* data = rows.const_data_ptr<int64_t>();
  std::vector<Segment> segments;
  std::vector<Writes> writes;
  segments.reserve(rows.size(0));
  writes.reserve(rows.size(0));
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const int64_t* row = data + i * kNumColumns;
    const Segment s = resolve_one(i, row, srcs, dsts, names);
    if (s.num_rows > 0 && s.row_bytes > 0) {
      segments.push_back(s);
      writes.push_back({reinterpret_cast<uintptr_t>(s.dst), s.num_rows, s.dst_stride, s.row_bytes, i, row[kDstIndex]});
      writes.push_back(reads_of(s, i, row[kSrcIndex]));
    }
  }
  check_no_overlap(std::move(writes), data, names);
  return segments;
}

SegmentCopy::SegmentCopy(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, const at::Tensor& table,
                         const Labels& names) {
  const c10::Device device = common_device(srcs, dsts);
  check_backend(device);
  std::vector<Segment> segments = resolve_segments(srcs, dsts, table, names);
  num_segments_ = table.size(0);
  total_bytes_ = sum_bytes(segments);
  if (device.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    cuda_ = std::make_unique<CudaPlan>(make_cuda_plan(segments, device, /*wait=*/true));
#endif
  } else {
    cpu_ = std::make_unique<CpuPlan>(make_cpu_plan(std::move(segments)));
  }
  for (size_t i = 0; i < srcs.size(); ++i) {
    labels_.push_back(label("srcs", i, names.srcs));
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    labels_.push_back(label("dsts", i, names.dsts));
  }
  tensors_ = std::move(srcs);
  tensors_.insert(tensors_.end(), std::make_move_iterator(dsts.begin()),
                  std::make_move_iterator(dsts.end()));
  for (const at::Tensor& t : tensors_) {
    places_.push_back({t.storage().data(), t.storage().nbytes(), t.storage_offset()});
  }
}

SegmentCopy::~SegmentCopy() = default;
SegmentCopy::SegmentCopy(SegmentCopy&&) noexcept = default;
SegmentCopy& SegmentCopy::operator=(SegmentCopy&&) noexcept = default;

// The plan writes to the addresses of construction: memory that is no longer the tensor's once its storage
// was freed (an offload's resize_(0)), moved or replaced. A few loads per tensor, nothing next to the copy.
void SegmentCopy::check_places() const {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const c10::Storage& s = tensors_[i].storage();
    const Place& p = places_[i];
    if (C10_UNLIKELY(s.data() != p.storage || s.nbytes() != p.nbytes ||
                     tensors_[i].storage_offset() != p.storage_offset)) {
      TORCH_CHECK(false, "SegmentCopy.run: ", labels_[i], " no longer has the memory the copy was built on (its ",
                  "storage was ", p.nbytes, " bytes at ", p.storage, ", now ", s.nbytes(), " bytes at ", s.data(),
                  ": offloaded with resize_(0), resized, or replaced by set_ or `.data =`). Nothing was copied; "
                  "build the copy again once the tensor is back");
    }
  }
}

void SegmentCopy::run() const {
  check_places();
  if (cpu_) {
    run_cpu_plan(*cpu_);
  }
#ifdef MEGARL_WITH_CUDA
  if (cuda_) {
    run_cuda_plan(*cuda_);
  }
#endif
}

void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                   const at::Tensor& table, const Labels& names) {
  const c10::Device device = common_device(srcs, dsts);
  check_backend(device);
  std::vector<Segment> segments = resolve_segments(srcs, dsts, table, names);
  if (device.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    run_cuda_plan(make_cuda_plan(segments, device, /*wait=*/false));
#endif
    return;
  }
  run_cpu_plan(make_cpu_plan(std::move(segments)));
}

}  // namespace megarl::copy
