// Registers qpipe's CPU kernels (ops.h) as torch.ops.qpipe_cpu.*: the schemas torch checks calls
// against, and the CPU implementations.
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(qpipe_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, int heads, "
        "int head_dim) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor x) -> ()");
  m.def("quantize_per_token_int8(Tensor(a!) q, Tensor(b!) scales, Tensor x) -> ()");
  m.def("fake_quantize_fp8(Tensor(a!) out, Tensor x, Tensor? scale) -> ()");
  // every backend: the packed weight is an MkldnnCPU tensor, which outranks CPU in dispatch
  m.def("int8_linear(Tensor x, Tensor packed_weight, Tensor weight_scale, Tensor zero_points, "
        "Tensor? bias) -> Tensor",
        qpipe_cpu::int8_linear);
  m.def("int8_gated_mlp(Tensor x, Tensor gate_up_weight, Tensor gate_up_scale, "
        "Tensor gate_up_zero_points, Tensor down_weight, Tensor down_scale, "
        "Tensor down_zero_points, Tensor? down_bias) -> Tensor",
        qpipe_cpu::int8_gated_mlp);
  m.def("weight_only_linear(Tensor x, Tensor weight, Tensor scales, Tensor? zeros, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def(
      "dense_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, bool float_out=False)"
      " -> Tensor");
  m.def("weight_only_expand(Tensor weight, Tensor scales, Tensor? zeros, int out_features) "
        "-> Tensor");
  m.def("weight_only_product(Tensor x, Tensor weight, Tensor scales, Tensor? zeros, "
        "Tensor? bias, int out_features) -> Tensor");
  m.def("write_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k, Tensor(d!) v, "
        "Tensor slot_mapping) -> ()");
  m.def("widen_kv(Tensor(a!) out, Tensor x) -> ()");
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor? query_starts, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(qpipe_cpu, CPU, m) {
  m.impl("rms_norm", qpipe_cpu::rms_norm);
  m.impl("fused_add_rms_norm", qpipe_cpu::fused_add_rms_norm);
  m.impl("rotary", qpipe_cpu::rotary);
  m.impl("silu_and_mul", qpipe_cpu::silu_and_mul);
  m.impl("quantize_per_token_int8", qpipe_cpu::quantize_per_token_int8);
  m.impl("fake_quantize_fp8", qpipe_cpu::fake_quantize_fp8);
  m.impl("weight_only_linear", qpipe_cpu::weight_only_linear);
  m.impl("dense_linear", qpipe_cpu::dense_linear);
  m.impl("weight_only_expand", qpipe_cpu::weight_only_expand);
  m.impl("weight_only_product", qpipe_cpu::weight_only_product);
  m.impl("write_kv", qpipe_cpu::write_kv);
  m.impl("widen_kv", qpipe_cpu::widen_kv);
  m.impl("paged_attention", qpipe_cpu::paged_attention);
}
