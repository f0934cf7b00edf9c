// The lean step's extension (medusa_core/lean/build.py builds it): the decoder (decoder.h), the EAGLE-style drafter's
// chain (eagle_chain.h), the heads' proposal, sampling, the corpus's chains and the 4-bit product, bound for Python.

#include <torch/extension.h>

#include "corpus_chain.h"
#include "decoder.h"
#include "draft_heads.h"
#include "eagle_chain.h"
#include "int4_matmul.h"
#include "refine_top.h"
#include "row_attention.h"
#include "sampling.h"

using at::Tensor;
using medusa_lean::LeanDecoder;
using medusa_lean::row_attention;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<LeanDecoder>(m, "LeanDecoder")
      .def(pybind11::init<std::vector<std::vector<Tensor>>, std::vector<double>, std::vector<int64_t>, Tensor, double,
                          int64_t, int64_t, int64_t, double, bool>())
      .def("forward", &LeanDecoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("fused", &LeanDecoder::fused)
      .def("own_mean", &LeanDecoder::own_mean);
  m.def("row_attention", &row_attention, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("head_states", &medusa_lean::head_states, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("draft_top", &medusa_lean::draft_top, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("has_bf16_dot", &medusa_lean::has_bf16_dot);
  m.def("has_int4_matmul", &medusa_lean::has_int4_matmul);
  m.def("int4_kernel", &medusa_lean::int4_kernel);
  m.def("set_one_row_dots", &medusa_lean::set_one_row_dots);
  m.def("int4_matmul", &medusa_lean::int4_matmul, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("refine_top", &medusa_lean::refine_top, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("penalise_rows", &medusa_lean::penalise_rows, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("filter_slice", &medusa_lean::filter_slice, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("draw_index", &medusa_lean::draw_index, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("tree_walk", &medusa_lean::tree_walk, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("corpus_chain", &medusa_lean::corpus_chain);
  m.def("eagle_observe", &medusa_lean::eagle_observe, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("eagle_chain", &medusa_lean::eagle_chain, pybind11::call_guard<pybind11::gil_scoped_release>());
}
