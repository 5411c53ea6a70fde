// megarl._C: each subsystem registers its own bindings.

#include <torch/csrc/utils/pybind.h>

namespace megarl {
void register_copy(pybind11::module& m);
void register_quant(pybind11::module& m);
void register_reshard(pybind11::module& m);
void register_verify(pybind11::module& m);
}

PYBIND11_MODULE(_C, m) {
  // Tensor arguments need torch's Python types, so `import megarl._C` must work on its own.
  pybind11::module_::import("torch");
  m.doc() = "megarl compiled kernels";
  m.def(
      "with_cuda",
      [] {
#ifdef MEGARL_WITH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether this build contains the CUDA kernels.");
  megarl::register_copy(m);
  megarl::register_quant(m);
  megarl::register_reshard(m);
  megarl::register_verify(m);
}
