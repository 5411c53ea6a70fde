// Python bindings of the reshard subsystem: _C.BufferPool.

#include "buffer_pool.h"

#include <torch/csrc/utils/pybind.h>

namespace megarl {

namespace py = pybind11;

void register_reshard(py::module& m) {
  py::class_<reshard::BufferPool>(
      m, "BufferPool",
      "Equally sized, 256-byte aligned staging buffers allocated once (one allocation) and reused.")
      .def(py::init([](int64_t num_buffers, int64_t buffer_bytes, const std::string& device) {
             return reshard::BufferPool(num_buffers, buffer_bytes, at::Device(device));
           }),
           py::arg("num_buffers"), py::arg("buffer_bytes"), py::arg("device"))
      .def("buffer", &reshard::BufferPool::buffer, py::arg("index"),
           "Buffer `index` as a uint8 tensor; the same memory on every call.")
      .def_property_readonly("num_buffers", &reshard::BufferPool::num_buffers)
      .def_property_readonly("buffer_bytes", &reshard::BufferPool::buffer_bytes)
      .def_property_readonly("total_bytes", &reshard::BufferPool::total_bytes,
                             "Device bytes the pool holds, alignment padding included.");
}

}  // namespace megarl
