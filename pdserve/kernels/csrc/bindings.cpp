#include "cpu_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_last_token_attention", &paged_last_token_attention);
  m.def("causal_attention_available", &causal_attention_available);
  m.def("causal_attention", &causal_attention);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("rotary_neox_", &rotary_neox_);
  m.def("write_kv_cache", &write_kv_cache);
  m.def("skinny_linear", &skinny_linear);
  m.def("skinny_max_rows", &skinny_max_rows);
  m.def("panel_width", &panel_width);
  m.def("panel_linear", &panel_linear);
  m.def("amx_available", &amx_available);
  m.def("amx_min_rows", &amx_min_rows);
  m.def("amx_panel_linear", &amx_panel_linear);
  pybind11::class_<DecodeLoop>(m, "DecodeLoop")
      .def(pybind11::init<std::vector<torch::Tensor>, int64_t, torch::Tensor,
                          torch::Tensor, double, int64_t, int64_t, int64_t, int64_t, double,
                          int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>())
      .def("run", &DecodeLoop::run);
  m.def("pin_openmp_threads", &pin_openmp_threads);
}
