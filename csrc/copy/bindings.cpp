// Python bindings of the copy subsystem: _C.copy_segments and _C.SegmentCopy.

#include "segment_copy.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <utility>
#include <vector>

namespace megarl {

namespace py = pybind11;

namespace {
using Names = std::vector<std::string>;
}

void register_copy(py::module& m) {
  // The GIL is released so that other Python threads (data loading, the engine) keep running
  // during a large CPU copy or a stream synchronization.
  m.def(
      "copy_segments",
      [](const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts, const at::Tensor& table,
         Names src_names, Names dst_names) {
        copy::copy_segments(srcs, dsts, table, {std::move(src_names), std::move(dst_names)});
      },
      py::arg("srcs"), py::arg("dsts"), py::arg("table"), py::arg("src_names") = Names{},
      py::arg("dst_names") = Names{}, py::call_guard<py::gil_scoped_release>(),
      "Copy every segment of `table` (int64 [n, 8]: src_index, src_offset, src_row_stride, "
      "dst_index, dst_offset, dst_row_stride, num_rows, row_bytes; all in bytes) from srcs to "
      "dsts. Validates the whole table first: no byte written twice, none read where one is written. "
      "Names (one per tensor, optional) name the tensors in errors. CUDA tensors: runs on the current stream.");

  py::class_<copy::SegmentCopy>(
      m, "SegmentCopy",
      "A validated segment copy, replayed with run(). Keeps references to the tensors and the addresses "
      "they had when built; run() refuses, naming the tensor, if a storage has since moved or been freed.")
      .def(py::init([](std::vector<at::Tensor> srcs, std::vector<at::Tensor> dsts, const at::Tensor& table,
                       Names src_names, Names dst_names) {
             return copy::SegmentCopy(std::move(srcs), std::move(dsts), table,
                                      {std::move(src_names), std::move(dst_names)});
           }),
           py::arg("srcs"), py::arg("dsts"), py::arg("table"), py::arg("src_names") = Names{},
           py::arg("dst_names") = Names{}, py::call_guard<py::gil_scoped_release>())
      .def("run", &copy::SegmentCopy::run, py::call_guard<py::gil_scoped_release>(),
           "Copy again: checks each tensor's storage, then on CUDA one kernel launch on the current stream.")
      .def_property_readonly("num_segments", &copy::SegmentCopy::num_segments,
                             "Rows of the table, empty segments included.")
      .def_property_readonly("total_bytes", &copy::SegmentCopy::total_bytes,
                             "Bytes copied by one run().");
}

}  // namespace megarl
