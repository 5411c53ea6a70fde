// Front end of the segment copy: validates the table against the tensors, then hands resolved
// segments to the CPU or CUDA backend.

#include "segment_copy.h"

#include "backends.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>

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

void check_tensors(const std::vector<at::Tensor>& tensors, const char* name, c10::Device device) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "copy_segments: ", name, "[", i, "] is an undefined tensor");
    TORCH_CHECK(t.device() == device, "copy_segments: all tensors must be on one device, but ", name,
                "[", i, "] is on ", t.device(), " and the first tensor on ", device);
    TORCH_CHECK(t.is_contiguous(), "copy_segments: ", name, "[", i,
                "] is not contiguous; pass a contiguous tensor (strides belong in the table)");
  }
}

// Returns false if the byte range [offset, offset + (rows - 1) * stride + row_bytes) would
// overflow int64, and the range's end in *end otherwise.
bool span_end(int64_t offset, int64_t stride, int64_t rows, int64_t row_bytes, int64_t* end) {
  int64_t span = 0;
  return !c10::mul_overflows(rows - 1, stride, &span) && !c10::add_overflows(span, row_bytes, &span) &&
         !c10::add_overflows(offset, span, end);
}

void check_range(int64_t i, const int64_t* row, const char* name, int64_t index, int64_t offset,
                 int64_t stride, const at::Tensor& t) {
  int64_t end = 0;
  const bool fits = span_end(offset, stride, row[kNumRows], row[kRowBytes], &end);
  TORCH_CHECK(fits && end <= static_cast<int64_t>(t.nbytes()), "copy_segments: ", describe(i, row),
              " needs bytes [", offset, ", ", fits ? std::to_string(end) : std::string("overflow"),
              ") of ", name, "[", index, "], which has ", t.nbytes(), " bytes");
}

Segment resolve_one(int64_t i, const int64_t* row, const std::vector<at::Tensor>& srcs,
                    const std::vector<at::Tensor>& dsts) {
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
  check_range(i, row, "srcs", si, row[kSrcOffset], row[kSrcStride], srcs[si]);
  check_range(i, row, "dsts", di, row[kDstOffset], row[kDstStride], dsts[di]);
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

std::vector<Segment> resolve_segments(const std::vector<at::Tensor>& srcs,
                                      const std::vector<at::Tensor>& dsts, const at::Tensor& table) {
  const c10::Device device = common_device(srcs, dsts);
  check_tensors(srcs, "srcs", device);
  check_tensors(dsts, "dsts", device);
  TORCH_CHECK(table.defined() && table.device().is_cpu(),
              "copy_segments: the segment table must be a CPU tensor (it is read on the host)");
  TORCH_CHECK(table.scalar_type() == at::kLong, "copy_segments: the segment table must be int64, got ",
              table.scalar_type());
  TORCH_CHECK(table.dim() == 2 && table.size(1) == kNumColumns,
              "copy_segments: the segment table must have shape [n, 8], got ", table.sizes());
  const at::Tensor rows = table.contiguous();
  const int64_t* data = rows.const_data_ptr<int64_t>();
  std::vector<Segment> segments;
  segments.reserve(rows.size(0));
  for (int64_t i = 0; i < rows.size(0); ++i) {
    const Segment s = resolve_one(i, data + i * kNumColumns, srcs, dsts);
    if (s.num_rows > 0 && s.row_bytes > 0) {
      segments.push_back(s);
    }
  }
  return segments;
}

SegmentCopy::SegmentCopy(std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts,
                         const at::Tensor& table) {
  const c10::Device device = common_device(srcs, dsts);
  check_backend(device);
  std::vector<Segment> segments = resolve_segments(srcs, dsts, table);
  num_segments_ = table.size(0);
  total_bytes_ = sum_bytes(segments);
  if (device.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    cuda_ = std::make_unique<CudaPlan>(make_cuda_plan(segments, device, /*wait=*/true));
#endif
  } else {
    cpu_ = std::make_unique<CpuPlan>(make_cpu_plan(std::move(segments)));
  }
  tensors_ = std::move(srcs);
  tensors_.insert(tensors_.end(), std::make_move_iterator(dsts.begin()),
                  std::make_move_iterator(dsts.end()));
}

SegmentCopy::~SegmentCopy() = default;
SegmentCopy::SegmentCopy(SegmentCopy&&) noexcept = default;
SegmentCopy& SegmentCopy::operator=(SegmentCopy&&) noexcept = default;

void SegmentCopy::run() const {
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
                   const at::Tensor& table) {
  const c10::Device device = common_device(srcs, dsts);
  check_backend(device);
  std::vector<Segment> segments = resolve_segments(srcs, dsts, table);
  if (device.is_cuda()) {
#ifdef MEGARL_WITH_CUDA
    run_cuda_plan(make_cuda_plan(segments, device, /*wait=*/false));
#endif
    return;
  }
  run_cpu_plan(make_cpu_plan(std::move(segments)));
}

}  // namespace megarl::copy
