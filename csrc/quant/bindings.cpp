// Python bindings of the quant subsystem: _C.fp8_block_quantize.

#include "fp8_block.h"

#include <torch/csrc/utils/pybind.h>

namespace megarl {

namespace py = pybind11;

void register_quant(py::module& m) {
  m.def("fp8_block_quantize", &quant::fp8_block_quantize, py::arg("source"), py::arg("out"), py::arg("scales"),
        py::arg("row_begin") = 0, py::arg("col_begin") = 0, py::arg("block_rows") = 128, py::arg("block_cols") = 128,
        py::arg("name") = "", py::call_guard<py::gil_scoped_release>(),
        "Block-wise FP8 quantization (megarl.reshard.fp8_reference defines the format) of a bfloat16 or float32 "
        "2-D `source`: writes its rows [row_begin, row_begin + out.size(0)) and columns [col_begin, col_begin + "
        "out.size(1)) as float8_e4m3fn into `out`, and the float32 scales (dequantization multipliers, "
        "weight_scale_inv) of the block_rows x block_cols blocks of the full source that window touches into "
        "`scales`. Every scale comes from its whole block of the source, inside the window or not. `name` names "
        "the weight in errors. CUDA tensors: asynchronous on the current stream.");
}

}  // namespace megarl
