// The ops that qpipe's CPU kernels register as torch.ops.qpipe_cpu.* (torch_bindings.cpp), by the
// file that defines them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace qpipe_cpu {

// elementwise.cpp
void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps);
void rotary(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
            const at::Tensor& sin, int64_t heads, int64_t head_dim);
void silu_and_mul(at::Tensor& out, const at::Tensor& x);

// quantize.cpp
void quantize_per_token_int8(at::Tensor& q, at::Tensor& scales, const at::Tensor& x);
void fake_quantize_fp8(at::Tensor& out, const at::Tensor& x,
                       const c10::optional<at::Tensor>& scale);

// int8_linear.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                       const at::Tensor& weight_scale, const at::Tensor& zero_points,
                       const c10::optional<at::Tensor>& bias);
at::Tensor int8_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_weight,
                          const at::Tensor& gate_up_scale, const at::Tensor& gate_up_zero_points,
                          const at::Tensor& down_weight, const at::Tensor& down_scale,
                          const at::Tensor& down_zero_points,
                          const c10::optional<at::Tensor>& down_bias);

// weight_only.cpp
at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                              const c10::optional<at::Tensor>& bias, int64_t out_features);
at::Tensor weight_only_expand(const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t out_features);
at::Tensor weight_only_product(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                               const c10::optional<at::Tensor>& bias, int64_t out_features);

// dense_linear.cpp
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        bool float_out);

// kv_cache.cpp
void write_kv(at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& k, at::Tensor& v,
              const at::Tensor& slot_mapping);
void widen_kv(at::Tensor& out, const at::Tensor& x);

// paged_attention.cpp
void paged_attention(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const std::optional<at::Tensor>& query_starts,
                     double scale);

}  // namespace qpipe_cpu
