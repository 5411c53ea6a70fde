// Python bindings of the copy subsystem: _C.copy_segments and _C.SegmentCopy.

#include "segment_copy.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace megarl {

namespace py = pybind11;

void register_copy(py::module& m) {
  // The GIL is released so that other Python threads (data loading, the engine) keep running
  // during a large CPU copy or a stream synchronization.
  m.def("copy_segments", &copy::copy_segments, py::arg("srcs"), py::arg("dsts"), py::arg("table"),
        py::call_guard<py::gil_scoped_release>(),
        "Copy every segment of `table` (int64 [n, 8]: src_index, src_offset, src_row_stride, "
        "dst_index, dst_offset, dst_row_stride, num_rows, row_bytes; all in bytes) from srcs to "
        "dsts. Validates the whole table first. CUDA tensors: runs on the current stream.");

  py::class_<copy::SegmentCopy>(
      m, "SegmentCopy",
      "A validated segment copy, replayed with run(). Keeps references to the tensors, but reads "
      "their data pointers once, at construction: build a new one if a tensor's storage changes.")
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, const at::Tensor&>(),
           py::arg("srcs"), py::arg("dsts"), py::arg("table"), py::call_guard<py::gil_scoped_release>())
      .def("run", &copy::SegmentCopy::run, py::call_guard<py::gil_scoped_release>(),
           "Copy again; on CUDA, one kernel launch on the current stream and no other host work.")
      .def_property_readonly("num_segments", &copy::SegmentCopy::num_segments,
                             "Rows of the table, empty segments included.")
      .def_property_readonly("total_bytes", &copy::SegmentCopy::total_bytes,
                             "Bytes copied by one run().");
}

}  // namespace megarl
