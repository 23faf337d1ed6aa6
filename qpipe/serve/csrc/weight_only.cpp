// Weight-only quantized linear layers (int8, or int4 two to a byte; per-group scales and optional
// zero points) on their tiles (tiles.h): the fp32 products, oneDNN's bf16 micro-GEMM where the CPU
// multiplies bf16, or one expansion and a GEMM.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/Utils.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "ops.h"
#include "tensor_args.h"
#include "tiles.h"
#include "vec.h"

namespace qpipe_cpu {
namespace {

// The in_features of a weight-only weight in tiles: uint8 tiles hold int4 pairs (`kNibbles`).
int64_t tile_in_features(const at::Tensor& weight) {
  return weight.size(1) * (weight.scalar_type() == at::kByte ? 2 : 1);
}

// body(q) with the tiles' values as `const int8_t*` or, for int4 pairs, `const uint8_t*`.
template <typename Body>
void with_tile_values(const at::Tensor& weight, Body&& body) {
  if (weight.scalar_type() == at::kByte) {
    body(weight.data_ptr<uint8_t>());
  } else {
    body(weight.data_ptr<int8_t>());
  }
}

// A weight-only layer's tiles, scales and zero points agree with each other and with out_features.
void check_weight_only(const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& zeros, int64_t out_features) {
  const bool nibbles = weight.scalar_type() == at::kByte;
  check_tiles(weight, nibbles ? at::kByte : at::kChar, nibbles ? "uint8 (int4 pairs)" : "int8",
              out_features);
  const int64_t k = tile_in_features(weight);
  TORCH_CHECK(scales.dim() == 3 && scales.size(0) == weight.size(0) && scales.size(2) == kTile &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(1) > 0 && k % scales.size(1) == 0,
              "scales must be contiguous float32 tiles [tiles, groups, ", kTile,
              "] with groups dividing in_features");
  TORCH_CHECK(!nibbles || (k / scales.size(1)) % 2 == 0,
              "int4 pairs need groups of even length, got ", k / scales.size(1));
  TORCH_CHECK(!zeros.has_value() || !zeros->defined() ||
                  (zeros->sizes() == scales.sizes() && zeros->scalar_type() == at::kFloat &&
                   zeros->is_contiguous()),
              "zero points must be contiguous float32 shaped as scales");
}

// Whether the CPU multiplies bf16 pairs itself (AVX512-BF16, compiled for with -march=native), so
// that torch's bf16 GEMM and oneDNN's micro-GEMM run natively. Elsewhere torch's bf16 GEMM is
// emulated: measured on a Zen 3 (AVX2), SmolLM2 W4A16's 120 products per step at 33 / 64 / 512 rows
// took 7.2 / 13.8 / 121 s that way, 0.20 / 0.30 / 2.5 s on the panels in fp32, so bf16 inputs stay
// on the panels there.
#if defined(__AVX512BF16__)
constexpr bool kNativeBf16Gemm = true;
#else
constexpr bool kNativeBf16Gemm = false;
#endif

// Whether torch's oneDNN micro-GEMM (brgemm) multiplies bf16 here: on AMX tiles where the CPU has
// them and the kernel grants them to this process (`init_amx` asks first: some VMs report AMX but
// fault on its first instruction without that grant), or on AVX512-BF16's dot product (a Zen 4).
bool bf16_brgemm_usable() {
  static const bool usable = at::cpu::init_amx() || kNativeBf16Gemm;
  return usable;
}

// The brgemm path's blocking, measured on a Sapphire Rapids VM (2 cores, AMX) over SmolLM2's 120
// products per step: 4 tiles (N = 64) beat 2 and 8; 256-row calls took 512 rows in 63 ms against
// 94 ms in 32-row calls (oneDNN's bf16 GEMM on a packed bf16 weight: 58 ms).
constexpr int64_t kBrgemmTiles = 4;
constexpr int64_t kBrgemmRows = 256;  // input rows per brgemm call
// bf16 inputs of more rows than this take the brgemm path where it is usable. Below, the direct
// blocks read the weight faster than any expansion: measured as above, 2 / 4 / 8 / 12 / 16 rows
// 6.2 / 8.4 / 13.7 / 19.1 / 24.2 ms direct against 13.7-14.5 ms through AMX at any of them; on a
// Zen 4 (AVX512-BF16, no AMX) 8 rows 14.8 ms direct, 9 rows 15.9 ms through brgemm.
constexpr int64_t kBrgemmMinRows = 8;

// `count` tiles of a weight-only weight (from tile `q`, scales `s`, zero points `z`, each tile
// `tile_bytes` and `tile_scales` after the last) as bf16 (q - z) * s in brgemm's VNNI layout for
// bf16: [k / 2, count * kTile, 2], value (i, c) at ((i / 2) * N + c) * 2 + i % 2, so that a pair of
// tile rows becomes one 32-bit lane per feature. int4 pairs hold exactly those rows per byte.
template <typename Q>
void expand_vnni(bf16* dst, const Q* q, const float* s, const float* z, int64_t k, int64_t group,
                 int64_t count, int64_t tile_bytes, int64_t tile_scales) {
  const int64_t n = count * kTile;
  for (int64_t j = 0; j < count; ++j) {
    vbits32 even{};  // row i's bf16 bits, held until row i + 1 completes the pair
    for_each_dequantized(q + j * tile_bytes, s + j * tile_scales,
                         z != nullptr ? z + j * tile_scales : nullptr, k, group,
                         [&](int64_t i, int64_t v, vfloat w) {
                           const vbits32 bits = __builtin_convertvector(to_bf16(w), vbits32);
                           if (i % 2 == 0) {
                             even = bits;
                             return;
                           }
                           const vbits32 pair = even | (bits << 16);
                           std::memcpy(dst + ((i / 2) * n + j * kTile + v * kLanes) * 2, &pair,
                                       sizeof pair);
                         });
  }
}

// o [rows, n] = x (bf16) @ dequant(w).T + bias on brgemm (AMX or AVX512-BF16): the threads split
// the weight into blocks of kBrgemmTiles tiles; each block is expanded once into bf16 VNNI form
// (L2-sized: k * 64 * 2 bytes) and multiplied by every kBrgemmRows rows of x in one brgemm call
// (torch's oneDNN micro-GEMM), fp32 sums, then bias and one rounding to bf16. The weight is read
// at its own bit width, never written out whole. Needs an even group length, as int4 pairs do.
void weight_only_brgemm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& scales, const float* z, const bf16* bias) {
  const int64_t rows = x.size(0), k = x.size(1), n = out.size(1), tiles = weight.size(0);
  const int64_t group = k / scales.size(1), tile_bytes = weight.size(1) * kTile;
  const int64_t tile_scales = scales.size(1) * kTile;
  const bf16* xs = ptr<bf16>(x);
  bf16* o = ptr<bf16>(out);
  const float* s = scales.data_ptr<float>();
  with_tile_values(weight, [&](const auto* q) {
    const int64_t blocks = (tiles + kBrgemmTiles - 1) / kBrgemmTiles;
    at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
      std::vector<bf16> panel(k * kBrgemmTiles * kTile);
      std::vector<float> sums(kBrgemmRows * kBrgemmTiles * kTile);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t t0 = blk * kBrgemmTiles, count = std::min(kBrgemmTiles, tiles - t0);
        const int64_t width = count * kTile, first = t0 * kTile, cols = std::min(width, n - first);
        expand_vnni(panel.data(), q + t0 * tile_bytes, s + t0 * tile_scales,
                    z != nullptr ? z + t0 * tile_scales : nullptr, k, group, count, tile_bytes,
                    tile_scales);
        for (int64_t r = 0; r < rows; r += kBrgemmRows) {
          const int64_t m = std::min(kBrgemmRows, rows - r);
          at::native::cpublas::brgemm(
              m, width, k, k, width, width, false,
              reinterpret_cast<const at::BFloat16*>(xs + r * k),
              reinterpret_cast<const at::BFloat16*>(panel.data()), sums.data());
          for (int64_t i = 0; i < m; ++i) {
            const float* row = sums.data() + i * width;
            bf16* dst = o + (r + i) * n + first;
            for_lanes(cols, [&](int64_t c, auto lane) {
              using V = decltype(lane);
              const V add = bias != nullptr ? load<V>(bias + first + c) : V{};
              st(dst + c, load<V>(row + c) + add);
            });
          }
        }
      }
      at::native::cpublas::brgemm_release();
    });
  });
}

// Whether weight_only_linear takes x to brgemm: bf16 rows enough to gain, groups of even length
// (asked before the operands are checked, so it reads their shapes with care).
bool brgemm_takes(const at::Tensor& x, const at::Tensor& scales) {
  return x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.size(0) > kBrgemmMinRows &&
         scales.dim() == 3 && scales.size(1) > 0 && (x.size(1) / scales.size(1)) % 2 == 0 &&
         bf16_brgemm_usable();
}

// bf16 inputs of more than this many rows whose groups brgemm cannot take (odd lengths) go to
// weight_only_expand and one bf16 GEMM where that GEMM is native (kNativeBf16Gemm).
constexpr int64_t kWoFusedMaxRows = 32;

}  // namespace

// The whole weight expanded to fp32 and transposed, [in_features, tiles * kTile] (the padding
// columns are zero), in one parallel pass: for bf16 inputs of many rows, where one bf16 GEMM on
// the expanded weight beats the panels and the expansion is paid once.
at::Tensor weight_only_expand(const at::Tensor& weight, const at::Tensor& scales,
                              const c10::optional<at::Tensor>& zeros, int64_t out_features) {
  check_weight_only(weight, scales, zeros, out_features);
  const int64_t tiles = weight.size(0), k = tile_in_features(weight), group = k / scales.size(1);
  const int64_t width = tiles * kTile, tile_bytes = weight.size(1) * kTile;
  at::Tensor out = at::empty({k, width}, scales.options());
  const float* z = zeros.has_value() && zeros->defined() ? zeros->data_ptr<float>() : nullptr;
  const int64_t tile_scales = scales.size(1) * kTile;
  float* o = out.data_ptr<float>();
  const float* s = scales.data_ptr<float>();
  with_tile_values(weight, [&](const auto* q) {
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        expand_tile(o + t * kTile, width, q + t * tile_bytes, s + t * tile_scales,
                    z != nullptr ? z + t * tile_scales : nullptr, k, group);
      }
    });
  });
  return out;
}

at::Tensor weight_only_linear(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                              const c10::optional<at::Tensor>& bias, int64_t out_features) {
  check_rows(x, "x");
  check_weight_only(weight, scales, zeros, out_features);
  const int64_t rows = x.size(0), k = x.size(1), n = out_features;
  TORCH_CHECK(tile_in_features(weight) == k, "x and weight disagree on in_features");
  const bool has_zeros = zeros.has_value() && zeros->defined();
  const bool has_bias = has_bias_for(bias, x, n);
  at::Tensor out = at::empty({rows, n}, x.options());
  if (brgemm_takes(x, scales)) {
    weight_only_brgemm(out, x.contiguous(), weight, scales,
                       has_zeros ? zeros->data_ptr<float>() : nullptr,
                       has_bias ? ptr<bf16>(*bias) : nullptr);
    return out;
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  dispatch(x, "weight_only_linear", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    with_tile_values(weight, [&](const auto* q) {
      tiles_product(ptr<T>(out), xf.data_ptr<float>(), rows, k, n, weight.size(0), q,
                    scales.data_ptr<float>(), has_zeros ? zeros->data_ptr<float>() : nullptr,
                    k / scales.size(1), has_bias ? ptr<T>(*bias) : nullptr, Epilogue{});
    });
  });
  return out;
}

// x @ dequant(w).T + bias by whichever form suits x (tiles.cpp's, brgemm, expansion + GEMM). bf16
// inputs of more than kBrgemmMinRows rows go to brgemm where it is usable. SmolLM2 W4A16's 120
// products per step, ms, through the direct blocks, panels or expansion -> brgemm: on a Sapphire
// Rapids VM (AMX), 16 / 32 / 64 / 512 rows 24.2 / 34.8 / 69.5 / 100.1 -> 14.8 / 15.8 / 18.1 / 66.4;
// on a Zen 4 (AVX512-BF16), 16 / 32 / 64 / 128 / 512 rows 22.9 / 42.6 / 87.4 / 111.9 / 340.6 ->
// 20.0 / 29.4 / 46.0 / 79.4 / 287.1; level with bf16 weights on oneDNN on both. fp32 inputs stay on
// the panels at any row count: measured on a Zen 3 with the weights from DRAM, 1.1-2.6x faster than
// expand + fp32 GEMM from 33 to 2048 rows (2048 x 576 -> 3072: 54 against 58 ms), and a step that
// mixes prefill and decode rows no longer expands every weight.
at::Tensor weight_only_product(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& scales, const c10::optional<at::Tensor>& zeros,
                               const c10::optional<at::Tensor>& bias, int64_t out_features) {
  if (x.scalar_type() == at::kFloat || !kNativeBf16Gemm || x.size(0) <= kWoFusedMaxRows ||
      brgemm_takes(x, scales)) {
    return weight_only_linear(x, weight, scales, zeros, bias, out_features);
  }
  const at::Tensor expanded =
      weight_only_expand(weight, scales, zeros, out_features).narrow(1, 0, out_features);
  const at::Tensor w = expanded.to(x.scalar_type());
  return bias.has_value() && bias->defined() ? at::addmm(*bias, x, w) : at::mm(x, w);
}

}  // namespace qpipe_cpu
