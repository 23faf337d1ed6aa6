// Weight-only quantized linear layers (int8, or int4 two to a byte; per-group scales and optional
// zero points) on their tiles (tiles.h): the fp32 products, AVX512-BF16's dot product on the tiles
// or oneDNN's bf16 micro-GEMM where the CPU multiplies bf16, or one expansion and a GEMM.
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
bool amx_usable() {
  static const bool usable = at::cpu::init_amx();
  return usable;
}
bool bf16_brgemm_usable() { return amx_usable() || kNativeBf16Gemm; }

// The brgemm path's blocking, measured on a Sapphire Rapids VM (2 cores, AMX) over SmolLM2's 120
// products per step: 4 tiles (N = 64) beat 2 and 8; 256-row calls took 512 rows in 63 ms against
// 94 ms in 32-row calls (oneDNN's bf16 GEMM on a packed bf16 weight: 58 ms).
constexpr int64_t kBrgemmTiles = 4;
constexpr int64_t kBrgemmRows = 256;  // input rows per brgemm call
// bf16 inputs of more rows than this take the brgemm path where it is usable (on CPUs without
// AMX, weight-only tiles only above kPairsMaxRows). Below, the direct blocks read the weight faster
// than any expansion: measured as above, 2 / 4 / 8 / 12 / 16 rows 6.2 / 8.4 / 13.7 / 19.1 / 24.2
// ms direct against 13.7-14.5 ms through AMX at any of them; on a Zen 4 (AVX512-BF16, no AMX) 8
// rows 14.8 ms direct, 9 rows 15.9 ms through brgemm.
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

#if defined(__AVX512BF16__)
// Weight-only tiles straight into AVX512-BF16's dot product, for bf16 inputs of a few rows.
// `vdpbf16ps` sums two inputs' products per output lane, so a weight operand holds tile rows i and
// i + 1 of the 16 features side by side; their integer values are exact in bf16. For int4 one
// 16-byte load holds those two rows (tiles.h: low and high nibble) and one `vpermw` over a table
// of the 16 values' bf16 bits makes the operand: 4 instructions per 32 weights, then one per row
// for 32 multiply-adds, where the fp32 direct blocks take 5 to widen the same weights and 2 per
// row. int8 rows are widened to fp32 and their bf16 halves interleaved: 6 instructions. A bf16
// input times such an integer is exact in fp32, and each group's sums are scaled once,
// s * (sum x q - z * sum x), as in the fp32 direct blocks: the same result up to summation order,
// closer to the exact product than brgemm's bf16 expansion of (q - z) * s.
static_assert(kTileVecs == 1, "the bf16 pair kernel takes one-vector tiles (AVX-512)");

// The bf16 bits of each stored nibble's value (nibble - 8) for vpermw: 32 entries, 16 used.
__m512i nibble_bf16_table() {
  alignas(64) bf16 table[32] = {};
  for (int u = 0; u < 16; ++u) {
    const float value = static_cast<float>(u) - kZeroOffset<uint8_t>;
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    table[u] = static_cast<bf16>(bits >> 16);
  }
  return _mm512_load_si512(table);
}

// Tile rows i and i + 1 (i even) as 16 pairs of bf16 values, row i's in the low half of each lane.
inline __m512bh weight_pairs(const uint8_t* q, int64_t i, __m512i table) {
  const __m512i w = _mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i / 2 * kTile)));
  // each lane's low nibble to bits 0-3, its high nibble to bits 16-19: (w | w << 12) & 0x000F000F
  const __m512i index = _mm512_ternarylogic_epi32(w, _mm512_slli_epi32(w, 12),
                                                  _mm512_set1_epi32(0x000F000F), 0xA8);
  return (__m512bh)_mm512_permutexvar_epi16(index, table);
}
inline __m512bh weight_pairs(const int8_t* q, int64_t i, __m512i) {
  const auto as_float = [&](int64_t row) {
    return _mm512_castps_si512(_mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + row * kTile)))));
  };
  // an integer's fp32 bits end in 16 zeros: its bf16 bits are the top half, whole
  return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(as_float(i), 16), as_float(i + 1),
                                             _mm512_set1_epi32(0xFFFF0000), 0xD8);
}

// part[r] += x[r][i] * w[i] + x[r][i + 1] * w[i + 1] for ROWS bf16 rows (row stride k).
template <int ROWS>
__attribute__((always_inline)) inline void bf16_pair_step(vfloat (&part)[ROWS], const bf16* x,
                                                          int64_t k, int64_t i, __m512bh w) {
#pragma GCC unroll 8
  for (int r = 0; r < ROWS; ++r) {
    int32_t two;
    std::memcpy(&two, x + r * k + i, sizeof two);
    part[r] = (vfloat)_mm512_dpbf16_ps((__m512)part[r], (__m512bh)_mm512_set1_epi32(two), w);
  }
}

// sums[r] = x[r] . dequant(tile) for ROWS bf16 rows, in fp32; `xsum` as in the fp32 direct blocks
// ([ROWS, groups] sums of x per group; null without zero points).
template <int ROWS, typename Q>
void pairs_bf16_block(float* sums, const bf16* x, const float* xsum, int64_t k, const Q* q,
                      const float* scales, const float* zeros, int64_t group, __m512i table) {
  constexpr int kSets = kPartialSums<ROWS>;
  const int64_t groups = k / group;
  vfloat acc[ROWS] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat part[kSets][ROWS] = {};
    const int64_t end = (g + 1) * group;
    int64_t i = g * group;
    for (; i + 2 * kSets <= end; i += 2 * kSets) {
#pragma GCC unroll 4
      for (int u = 0; u < kSets; ++u) {
        bf16_pair_step<ROWS>(part[u], x, k, i + 2 * u, weight_pairs(q, i + 2 * u, table));
      }
    }
    for (; i < end; i += 2) bf16_pair_step<ROWS>(part[0], x, k, i, weight_pairs(q, i, table));
    const vfloat s = loadv(scales + g * kTile);
    for (int r = 0; r < ROWS; ++r) {
      vfloat t = part[0][r];
      for (int u = 1; u < kSets; ++u) t += part[u][r];
      if (xsum != nullptr) t = fmadd(-loadv(zeros + g * kTile), splat(xsum[r * groups + g]), t);
      acc[r] = fmadd(t, s, acc[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) st(sums + r * kTile, acc[r]);
}

constexpr int kPairBlockRows = 8;
// bf16 inputs of up to this many rows take the pair kernel on CPUs without AMX, where brgemm runs
// on the same dot product. SmolLM2 W4A16's 120 products per step on a Zen 4, weights from DRAM,
// ms, before (fp32 direct blocks up to 8 rows, brgemm above) -> here: 1 / 2 / 4 / 8 rows 4.3-4.4 /
// 4.8-4.9 / 6.7-6.9 / 12.2-12.5 -> 3.9-5.0 / 4.3-5.3 / 5.2 / 6.8-8.8; 12 / 16 / 24 / 32 / 64 rows
// 15.4-15.5 / 17.3-17.8 / 21.0-21.1 / 25.2-25.3 / 40.9 -> 10.2-10.3 / 11.5-11.6 / 15.7-16.0 /
// 19.6-20.6 / 36.5-37.5; 128 level (71 against 72.6); 256 / 512 rows 1 / 3 % behind. With AMX,
// brgemm's tiles win from 9 rows (the comment at kBrgemmMinRows), so there the pair kernel takes
// only the rows the direct blocks took.
constexpr int64_t kPairsMaxRows = 64;

// Whether weight_only_linear takes x to the pair kernel: bf16 rows few enough, groups of even
// length (int4 pairs always have them).
bool pairs_take(const at::Tensor& x, int64_t group) {
  return x.scalar_type() == at::kBFloat16 && group % 2 == 0 &&
         x.size(0) <= (amx_usable() ? kBrgemmMinRows : kPairsMaxRows);
}

// o [rows, n] = x (bf16) @ dequant(w).T + bias: the threads split the tiles, each read once for
// every block of kPairBlockRows rows; fp32 sums, then the bias and one rounding.
template <typename Q>
void pairs_bf16_product(bf16* o, const bf16* xs, int64_t rows, int64_t k, int64_t n,
                        int64_t tiles, const Q* q, const float* s, const float* z, int64_t group,
                        const bf16* b) {
  const int64_t groups = k / group, tile_scales = groups * kTile;
  const int64_t tile_values = k / (kNibbles<Q> ? 2 : 1) * kTile;
  const std::vector<float> xsum =
      z != nullptr ? group_sums(xs, rows, k, group) : std::vector<float>{};
  const __m512i table = nibble_bf16_table();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    float sums[kPairBlockRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      // a thread's tiles are one contiguous stretch of the weight: fetch the next one
      if (t + 1 < end) prefetch_bytes(q + (t + 1) * tile_values, tile_values * sizeof(Q));
      const int64_t first = t * kTile, cols = std::min(kTile, n - first);
      for (int64_t r = 0; r < rows; r += kPairBlockRows) {
        const int64_t count = std::min<int64_t>(kPairBlockRows, rows - r);
        with_block_rows<kPairBlockRows>(count, [&](auto c) {
          pairs_bf16_block<decltype(c)::value>(
              sums, xs + r * k, z != nullptr ? xsum.data() + r * groups : nullptr, k,
              q + t * tile_values, s + t * tile_scales, z != nullptr ? z + t * tile_scales : nullptr,
              group, table);
        });
        store_tile_rows(o, n, b, first, cols, sums, r, count, Epilogue{});
      }
    }
  });
}
#endif

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
#if defined(__AVX512BF16__)
  if (pairs_take(x, k / scales.size(1))) {
    const at::Tensor xc = x.contiguous();
    with_tile_values(weight, [&](const auto* q) {
      pairs_bf16_product(ptr<bf16>(out), ptr<bf16>(xc), rows, k, n, weight.size(0), q,
                         scales.data_ptr<float>(), has_zeros ? zeros->data_ptr<float>() : nullptr,
                         k / scales.size(1), has_bias ? ptr<bf16>(*bias) : nullptr);
    });
    return out;
  }
#endif
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

// x @ dequant(w).T + bias by whichever form suits x (tiles.cpp's, the pair kernel, brgemm,
// expansion + GEMM). bf16 inputs of more than kBrgemmMinRows rows go to brgemm where it is usable
// (on AVX512-BF16 without AMX, above kPairsMaxRows). SmolLM2 W4A16's 120
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
