// Python bindings of the verify subsystem: _C.checksum.

#include "checksum.h"

#include <torch/csrc/utils/pybind.h>

namespace megarl {

namespace py = pybind11;

void register_verify(py::module& m) {
  m.def("checksum", &verify::checksum, py::arg("tensor"), py::arg("offset"), py::arg("row_stride"),
        py::arg("num_rows"), py::arg("run"), py::arg("first"), py::arg("position_stride"), py::arg("name") = "",
        py::call_guard<py::gil_scoped_release>(),
        "The hand-over checksum (megarl.reshard.verify) of num_rows rows of run elements of a contiguous "
        "tensor, row r from element offset + r * row_stride, its element c at position "
        "first + r * position_stride + c: int64 [2] on the tensor's device, below the primes 2^32 - 5 and "
        "2^32 - 17. `name` names the tensor in errors. CUDA tensors: asynchronous on the current stream.");
}

}  // namespace megarl
