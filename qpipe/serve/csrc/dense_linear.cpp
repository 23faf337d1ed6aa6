// Dense (unquantized) linear layers on weights in tiles: fp32, bf16 widened to fp32, or bf16 pairs
// for AVX512-BF16's dot product.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "ops.h"
#include "tensor_args.h"
#include "tiles.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

// x @ weight.T + bias for a bf16 weight in tiles: the weight read at 2 bytes, widened in
// registers (direct blocks) or into an fp32 panel per tile, fp32 sums, then the bias and one
// rounding to `out`'s dtype (x's, or fp32: `float_out`). For bf16 x on CPUs whose bf16 GEMM is
// emulated, as a bf16 GEMM with fp32 accumulation computes it: measured on a Zen 3 (AVX2),
// SmolLM2 served in bf16 at concurrency 8, 13.6 output tok/s on torch's bf16 GEMM, 56.5 here
// (fp32 weights on the tiles: 57.9). For fp32 x, an fp32 weight whose values are all bf16 (a
// 16-bit checkpoint served in fp32): the same products in fp32 from half the bytes.
at::Tensor dense_bf16_linear(const at::Tensor& x, const at::Tensor& weight, bool has_bias,
                             const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& out) {
  const int64_t rows = x.size(0), k = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const auto run = [&](auto* out_tag, auto* bias_tag) {
    using T = std::remove_pointer_t<decltype(out_tag)>;
    using B = std::remove_pointer_t<decltype(bias_tag)>;
    tiles_product(ptr<T>(out), xf.data_ptr<float>(), rows, k, n, weight.size(0),
                  ptr<bf16>(weight), nullptr, nullptr, k, has_bias ? ptr<B>(*bias) : nullptr,
                  Epilogue{});
  };
  if (out.scalar_type() != x.scalar_type()) {  // bf16 x summed into fp32 (`float_out`)
    run(static_cast<float*>(nullptr), static_cast<bf16*>(nullptr));
  } else {
    dispatch(x, "dense_linear", [&](auto* tag) { run(tag, tag); });
  }
  return out;
}

// bf16 weights for AVX512-BF16's dot product (`vdpbf16ps`), laid out by
// cpu_kernels.tiled_bf16_pairs: [tiles, in_features / 2, 2 * kTile] bf16, each tile's two
// consecutive input features of its kTile output features side by side in one 64-byte vector,
// the order the instruction sums them in: 32 multiply-adds per instruction, where widening the
// weight to fp32 does 16. oneDNN's bf16 GEMM uses the same instruction here; these tiles read
// the weight faster at decode sizes (`linear.bf16_pair_tiles_serve`).
constexpr int64_t kPairGroup = 2;
bool bf16_pair_tiles(const at::Tensor& weight) {
  return tiles_of(weight, at::kBFloat16, kPairGroup * kTile);
}

#if defined(__AVX512BF16__)
constexpr bool kBf16Pairs = true;

// fp32 sums of ROWS bf16 input rows (row stride k) against TILES (1 or 2) adjacent tiles into
// sums[t] (kTile per row): each step broadcasts two inputs of a row and adds their products with
// one vector of each tile.
template <int ROWS, int TILES>
void bf16_pair_block(float* (&sums)[2], const bf16* x, int64_t k, const bf16* const (&w)[2]) {
  vfloat acc0[ROWS] = {}, acc1[ROWS] = {};
  const int64_t steps = k / kPairGroup;
  for (int64_t i = 0; i < steps; ++i) {
    fetch_stream_ahead(w[0] + i * kPairGroup * kTile);
    if constexpr (TILES == 2) fetch_stream_ahead(w[1] + i * kPairGroup * kTile);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w[0] + i * kPairGroup * kTile);
    const __m512bh w1 =
        TILES == 2 ? (__m512bh)_mm512_loadu_si512(w[1] + i * kPairGroup * kTile) : w0;
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      int32_t two;
      std::memcpy(&two, x + r * k + i * kPairGroup, sizeof two);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
      acc0[r] = (vfloat)_mm512_dpbf16_ps((__m512)acc0[r], xv, w0);
      if constexpr (TILES == 2) acc1[r] = (vfloat)_mm512_dpbf16_ps((__m512)acc1[r], xv, w1);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    st(sums[0] + r * kTile, acc0[r]);
    if constexpr (TILES == 2) st(sums[1] + r * kTile, acc1[r]);
  }
}
#else
constexpr bool kBf16Pairs = false;
#endif

// x @ weight.T + bias for bf16 x and a bf16 weight in pair tiles (`bf16_pair_tiles`): fp32 sums,
// then the bias and one rounding to `out`'s dtype (bf16, or fp32: `float_out`).
at::Tensor bf16_pair_linear(const at::Tensor& x, const at::Tensor& weight, bool has_bias,
                            const c10::optional<at::Tensor>& bias, int64_t n, at::Tensor& out) {
  TORCH_CHECK(kBf16Pairs, "a weight in bf16 pair tiles needs the kernels built for AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "a weight in bf16 pair tiles takes bf16 x");
  const int64_t rows = x.size(0), k = x.size(1), tiles = weight.size(0);
  TORCH_CHECK(weight.is_contiguous() && weight.size(1) * kPairGroup == k, "the tiles hold ",
              weight.size(1) * kPairGroup, " input features, x has ", k);
  check_fits_tiles(n, tiles);
  const at::Tensor xc = x.contiguous();
#if defined(__AVX512BF16__)
  dispatch(out, "dense_linear", [&](auto* out_tag) {
    using T = std::remove_pointer_t<decltype(out_tag)>;
    tile_pairs_product(ptr<T>(out), n, has_bias ? ptr<bf16>(*bias) : nullptr, ptr<bf16>(xc), rows,
                       k, ptr<bf16>(weight), tiles, k * kTile, Epilogue{},
                       [&](auto c, auto t, auto& sums, auto x, auto& w) {
                         bf16_pair_block<decltype(c)::value, decltype(t)::value>(sums, x, k, w);
                       });
  });
#endif
  return out;
}

}  // namespace

// x @ weight.T + bias for an fp32 weight laid out in tiles ([tiles, in_features, kTile]), which
// are the panels themselves. Measured on a Zen 3 against oneDNN's GEMM on its packed weight, the
// weights from DRAM as in serving: 1.3-2x at 1-16 rows (1 row: 23 against 14 GB/s), 1-1.5x at
// 32-64, even at 160, 0.8-0.9x at 512. bf16 tiles go to `dense_bf16_linear`. `float_out` returns
// the fp32 sums of bf16 x unrounded (an LM head's logits: see `DenseLinear.float_output`).
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight,
                        const c10::optional<at::Tensor>& bias, int64_t out_features,
                        bool float_out) {
  check_rows(x, "x");
  const bool bf16_input = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.scalar_type() == at::kFloat || bf16_input,
              "dense_linear takes float32 or bfloat16 inputs");
  at::Tensor out = at::empty({x.size(0), out_features},
                             x.options().dtype(float_out ? at::kFloat : x.scalar_type()));
  if (bf16_pair_tiles(weight)) {
    return bf16_pair_linear(x, weight, has_bias_for(bias, x, out_features), bias, out_features,
                            out);
  }
  const bool bf16_tiles = bf16_input || weight.scalar_type() == at::kBFloat16;
  check_tiles(weight, bf16_tiles ? at::kBFloat16 : at::kFloat,
              bf16_tiles ? "bfloat16" : "float32", out_features);
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(weight.size(1) == k, "x and weight disagree on in_features");
  const bool has_bias = has_bias_for(bias, x, n);
  if (bf16_tiles) return dense_bf16_linear(x, weight, has_bias, bias, n, out);
  const at::Tensor xc = x.contiguous();
  fp32_tiles_product(out.data_ptr<float>(), xc.data_ptr<float>(), rows, k, n, weight.size(0),
                     weight.data_ptr<float>(), has_bias ? bias->data_ptr<float>() : nullptr);
  return out;
}

}  // namespace qpipe_cpu
