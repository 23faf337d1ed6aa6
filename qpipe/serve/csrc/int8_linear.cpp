// W8A8 linear layers (int8 weights per channel, activations quantized per token) and the gated
// MLP of two of them: oneDNN's int8 GEMM, AVX512-VNNI tiles, or the int8 values in fp32 tiles.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "quantize.h"
#include "tensor_args.h"
#include "tiles.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

// Whether a packed W8A8 weight holds its int8 values in the weight-only kernels' tiles: on a CPU
// without VNNI, where oneDNN's int8 GEMM saturates (Int8Linear.pack_for_cpu). Its products are
// then taken in fp32 over the int8 values, read at one byte per weight with unit scales; exact,
// as the sums are integers below 2^24. Its input is the activations' int8 values as floats.
bool values_in_tiles(const at::Tensor& packed_weight) {
  return tiles_of(packed_weight, at::kChar, kTile);
}

// W8A8 weights for AVX512-VNNI's u8 x s8 dot products (`vpdpbusd`), laid out by
// cpu_kernels.tiled_vnni: [tiles, in_features / 4 + 1, 4 * kTile] int8, each tile's four
// consecutive input features of its kTile output features in one 64-byte vector (the order the
// instruction sums them in), then one vector of the tile's compensations, 128 * sum(w) per
// output feature as int32: the input goes in as q + 128 (uint8), and sum((q + 128) * w) -
// 128 * sum(w) is the exact int32 sum(q * w).
constexpr int64_t kVnniGroup = 4;
bool vnni_tiles(const at::Tensor& packed_weight) {
  return tiles_of(packed_weight, at::kChar, kVnniGroup * kTile);
}

#if defined(__AVX512VNNI__)
constexpr bool kVnni = true;

// int32 sums of ROWS uint8 input rows (row stride k) against TILES (1 or 2) adjacent VNNI tiles,
// less the tiles' compensations, as floats into sums[t] (kTile per row). Each step broadcasts
// four input bytes of a row and adds their products with one vector of each tile: 64
// multiply-adds per instruction where the fp32 panels do 16.
template <int ROWS, int TILES>
void vnni_block(float* (&sums)[2], const uint8_t* x, int64_t k, const int8_t* const (&w)[2]) {
  // GCC's own vector type: arrays of __m512i stay on the stack, spilled at every step
  vint acc0[ROWS] = {}, acc1[ROWS] = {};
  const int64_t steps = k / kVnniGroup;
  for (int64_t i = 0; i < steps; ++i) {
    fetch_stream_ahead(w[0] + i * kVnniGroup * kTile);
    if constexpr (TILES == 2) fetch_stream_ahead(w[1] + i * kVnniGroup * kTile);
    const __m512i w0 = _mm512_loadu_si512(w[0] + i * kVnniGroup * kTile);
    const __m512i w1 = TILES == 2 ? _mm512_loadu_si512(w[1] + i * kVnniGroup * kTile) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      int32_t four;
      std::memcpy(&four, x + r * k + i * kVnniGroup, sizeof four);
      const __m512i xv = _mm512_set1_epi32(four);
      acc0[r] = reinterpret_cast<vint>(
          _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc0[r]), xv, w0));
      if constexpr (TILES == 2) {
        acc1[r] = reinterpret_cast<vint>(
            _mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc1[r]), xv, w1));
      }
    }
  }
  const int64_t end = steps * kVnniGroup * kTile;  // the compensations follow the values
  const vint comp0 = reinterpret_cast<vint>(_mm512_loadu_si512(w[0] + end));
  const vint comp1 = reinterpret_cast<vint>(_mm512_loadu_si512(w[1] + end));
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    st(sums[0] + r * kTile, __builtin_convertvector(acc0[r] - comp0, vfloat));
    if constexpr (TILES == 2) {
      st(sums[1] + r * kTile, __builtin_convertvector(acc1[r] - comp1, vfloat));
    }
  }
}
#else
constexpr bool kVnni = false;
#endif

// out = (q @ w.T) * weight_scale [* row_scales] [+ bias] for a W8A8 weight in VNNI tiles, q the
// activations' int8 values + 128 in uint8: the same epilogue, in the same order, as the fp32
// panels' (`tiles_int8_product`).
void vnni_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                       const at::Tensor& weight_scale, const float* row_scales,
                       const float* bias) {
  TORCH_CHECK(kVnni, "a W8A8 weight in VNNI tiles needs the kernels built for AVX512-VNNI");
  TORCH_CHECK(q.scalar_type() == at::kByte && q.is_contiguous(),
              "q must be contiguous uint8 (the int8 values + 128)");
  const int64_t k = q.size(1), n = out.size(1), tiles = packed_weight.size(0);
  TORCH_CHECK(k % kVnniGroup == 0 && packed_weight.size(1) == k / kVnniGroup + 1,
              "the VNNI tiles hold ", (packed_weight.size(1) - 1) * kVnniGroup,
              " input features, q has ", k);
  check_fits_tiles(n, tiles);
#if defined(__AVX512VNNI__)
  const int64_t rows = q.size(0);
  const int64_t tile_bytes = packed_weight.size(1) * kVnniGroup * kTile;
  const Epilogue e{weight_scale.data_ptr<float>(), row_scales};
  dispatch(out, "int8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tile_pairs_product(ptr<T>(out), n, bias, q.data_ptr<uint8_t>(), rows, k,
                       packed_weight.data_ptr<int8_t>(), tiles, tile_bytes, e,
                       [&](auto c, auto t, auto& sums, auto x, auto& w) {
                         vnni_block<decltype(c)::value, decltype(t)::value>(sums, x, k, w);
                       });
  });
#endif
}

// out = (q @ w.T) * weight_scale [* row_scales] [+ bias] for a weight whose int8 values are in
// tiles (`values_in_tiles`), q the activations' int8 values as floats: the scales and the bias go
// in the tiles' epilogue, rounded once to out's dtype.
void tiles_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                        const at::Tensor& weight_scale, const float* row_scales,
                        const float* bias) {
  const int64_t rows = q.size(0), k = q.size(1), n = out.size(1);
  dispatch(out, "int8_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    tiles_product(ptr<T>(out), q.data_ptr<float>(), rows, k, n, packed_weight.size(0),
                  packed_weight.data_ptr<int8_t>(), nullptr, nullptr, k, bias,
                  Epilogue{weight_scale.data_ptr<float>(), row_scales});
  });
}

// x quantized per token: its int8 values (as floats for a weight in the fp32 panels' tiles, + 128
// in uint8 for oneDNN's GEMM and the VNNI tiles) and their scales.
std::pair<at::Tensor, at::Tensor> quantized(const at::Tensor& x, bool as_floats) {
  const int64_t rows = x.size(0);
  const at::ScalarType type = as_floats ? at::kFloat : at::kByte;
  at::Tensor q = at::empty({rows, x.size(1)}, x.options().dtype(type));
  at::Tensor scales = at::empty({rows}, x.options().dtype(at::kFloat));
  if (as_floats) {
    quantize_rows(q.data_ptr<float>(), scales.data_ptr<float>(), x);
  } else {
    quantize_rows(q.data_ptr<uint8_t>(), scales.data_ptr<float>(), x);
  }
  return {q, scales};
}

// (q @ w.T) * weight_scale in fp32: oneDNN's int8 GEMM on a packed int8 weight, q in uint8 with
// zero point 128 (oneDNN's VNNI kernels multiply u8 by s8; an s8 input left AMX-less CPUs on its
// reference GEMM, measured on a Zen 4 at 0.1 GOP/s against 300 for u8 at 32 rows); the tiles'
// product with the weight scales in its epilogue (`values_in_tiles`, or `vnni_tiles` with q in
// uint8 as for oneDNN); or, where the layer was packed without the kernels, products over an fp32
// copy of the values, oneDNN's GEMM on a packed one or torch's on a plain one.
at::Tensor int8_product(const at::Tensor& q, const at::Tensor& packed_weight,
                        const at::Tensor& weight_scale, const at::Tensor& zero_points) {
  if (values_in_tiles(packed_weight)) {
    at::Tensor out = at::empty({q.size(0), weight_scale.numel()}, q.options());
    tiles_int8_product(out, q, packed_weight, weight_scale, nullptr, nullptr);
    return out;
  }
  if (vnni_tiles(packed_weight)) {
    at::Tensor out = at::empty({q.size(0), weight_scale.numel()}, q.options().dtype(at::kFloat));
    vnni_int8_product(out, q, packed_weight, weight_scale, nullptr, nullptr);
    return out;
  }
  TORCH_CHECK(q.scalar_type() == at::kByte, "q must hold the int8 values + 128 in uint8");
  if (packed_weight.scalar_type() == at::kFloat) {
    static const c10::OperatorHandle linear =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const at::Tensor values = q.to(at::kFloat).sub_(128);
    if (!packed_weight.is_mkldnn()) return at::mm(values, packed_weight.t()).mul_(weight_scale);
    torch::jit::Stack stack{values, packed_weight, c10::IValue(), "none",
                            c10::List<c10::optional<at::Scalar>>(), ""};
    linear.callBoxed(&stack);
    return stack.back().toTensor().mul_(weight_scale);
  }
  static const c10::OperatorHandle qlinear =
      c10::Dispatcher::singleton().findSchemaOrThrow("onednn::qlinear_pointwise", "");
  torch::jit::Stack stack{q,      1.0,     int64_t{128}, packed_weight,     weight_scale,
                          zero_points, c10::IValue(), 1.0, int64_t{0}, at::ScalarType::Float,
                          "none", c10::List<c10::optional<at::Scalar>>(), ""};
  qlinear.callBoxed(&stack);
  return stack.back().toTensor();
}

// out = int8_product(q) * row_scales + bias, rounded once to out's dtype (`scale_rows`); for a
// weight in tiles all inside the product's epilogue, with the same roundings in the same order.
void scaled_int8_product(at::Tensor& out, const at::Tensor& q, const at::Tensor& packed_weight,
                         const at::Tensor& weight_scale, const at::Tensor& zero_points,
                         const at::Tensor& row_scales, const c10::optional<at::Tensor>& bias) {
  if (!values_in_tiles(packed_weight) && !vnni_tiles(packed_weight)) {
    scale_rows(out, int8_product(q, packed_weight, weight_scale, zero_points), row_scales, bias);
    return;
  }
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->scalar_type() == at::kFloat, "bias must be float32");
  const float* b = has_bias ? bias->data_ptr<float>() : nullptr;
  if (vnni_tiles(packed_weight)) {
    vnni_int8_product(out, q, packed_weight, weight_scale, row_scales.data_ptr<float>(), b);
  } else {
    tiles_int8_product(out, q, packed_weight, weight_scale, row_scales.data_ptr<float>(), b);
  }
}

// gate_up's epilogue, the activation and down's quantization in one pass per row: the fp32
// product [gate | up] times the row's scale, rounded to T as the unfused layer's output is,
// silu(gate) * up with the roundings of `silu_and_mul`, then quantized per token (into D: the
// int8 values + 128 in uint8, or as floats). Bit for bit the unfused sequence, without its two
// full-size intermediate tensors.
template <typename T, typename D>
void silu_and_mul_quantize(D* out, float* scale, const at::Tensor& product,
                           const at::Tensor& row_scales) {
  const int64_t rows = product.size(0), n = product.size(1) / 2;
  const float* in = product.data_ptr<float>();
  const float* rs = row_scales.data_ptr<float>();
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> act(n);
    float* __restrict__ a = act.data();
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ g = in + r * 2 * n;
      const float s = rs[r];
      for_lanes(n, [&](int64_t i, auto lane) {
        using V = decltype(lane);
        const V gate = rnd<T>(load<V>(g + i) * s), up = rnd<T>(load<V>(g + n + i) * s);
        st(a + i, rnd<T>(rnd<T>(silu(gate)) * up));
      });
      scale[r] = quantize_row(out + r * n, a, n);
    }
  });
}

}  // namespace

// The whole W8A8 layer in one op: quantize per token, the int8 product with the per-channel
// weight scales applied in fp32, then the per-token scale and bias. At decode sizes the three
// steps take ~10 us each; as three Python-level calls the dispatch and allocation around them
// cost about as much again.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed_weight,
                       const at::Tensor& weight_scale, const at::Tensor& zero_points,
                       const c10::optional<at::Tensor>& bias) {
  check_rows(x, "x");
  const auto [q, scales] = quantized(x, values_in_tiles(packed_weight));
  at::Tensor out = at::empty({x.size(0), weight_scale.numel()}, x.options());
  scaled_int8_product(out, q, packed_weight, weight_scale, zero_points, scales, bias);
  return out;
}

// A gated MLP whose two projections are packed W8A8 layers without a gate_up bias (the Llama
// family): down(silu(gate) * up) with one quantization and one epilogue pass fewer than two
// `int8_linear` calls around `silu_and_mul`, and the same result.
at::Tensor int8_gated_mlp(const at::Tensor& x, const at::Tensor& gate_up_weight,
                          const at::Tensor& gate_up_scale, const at::Tensor& gate_up_zero_points,
                          const at::Tensor& down_weight, const at::Tensor& down_scale,
                          const at::Tensor& down_zero_points,
                          const c10::optional<at::Tensor>& down_bias) {
  check_rows(x, "x");
  const bool as_floats = values_in_tiles(gate_up_weight);
  TORCH_CHECK(values_in_tiles(down_weight) == as_floats, "gate_up and down are packed alike");
  const auto [q, scales] = quantized(x, as_floats);
  const at::Tensor gate_up = int8_product(q, gate_up_weight, gate_up_scale, gate_up_zero_points);
  const int64_t rows = x.size(0), n = gate_up.size(1) / 2;
  at::Tensor act_q = at::empty({rows, n}, x.options().dtype(as_floats ? at::kFloat : at::kByte));
  at::Tensor act_scales = at::empty({rows}, x.options().dtype(at::kFloat));
  dispatch(x, "int8_gated_mlp", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (as_floats) {
      silu_and_mul_quantize<T>(act_q.data_ptr<float>(), act_scales.data_ptr<float>(), gate_up,
                               scales);
    } else {
      silu_and_mul_quantize<T>(act_q.data_ptr<uint8_t>(), act_scales.data_ptr<float>(), gate_up,
                               scales);
    }
  });
  at::Tensor out = at::empty({rows, down_scale.numel()}, x.options());
  scaled_int8_product(out, act_q, down_weight, down_scale, down_zero_points, act_scales,
                      down_bias);
  return out;
}

}  // namespace qpipe_cpu
