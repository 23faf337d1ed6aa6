// Linear layers' weights in tiles, the layout that qpipe's CPU products read: weight-only
// quantized weights (int8 values one per byte, int4 two: `kNibbles`; per-group fp32 scales and
// optional zero points: AWQ, GPTQ, qpipe's int4-wo / int8-wo), W8A8's int8 values on CPUs without
// VNNI, and dense fp32 or bf16 weights. For the quantized ones the eager path expands the whole
// weight to the model dtype on every call, which at decode sizes costs more than the GEMM (4-byte
// weights written, then read again): measured on a Zen 3 with SmolLM2 W4A16, 166 ms per token at
// concurrency 1.
//
// Here the weight is laid out once at load in tiles of kTile output features, k-major inside a
// tile ([tiles, in_features, kTile], the layer's `pack_for_cpu`), and read once per call at its
// own bit width. The threads split the tiles; each tile is expanded into an fp32 panel
// (in_features x kTile: L1/L2-sized), and every block of input rows runs an outer-product
// micro-kernel against it: one input value broadcast times kTile weights per multiply-add, with
// the block's accumulators in registers and no sums across lanes. Measured on a Zen 3, 32 rows x
// 576 -> 3072 with the weight in cache: 66 GFLOP/s for the earlier dot-product form on the plain
// layout, 139 here, as fast as oneDNN's fp32 GEMM on a packed weight while reading a quarter of
// its bytes. On CPUs with AVX512-BF16, bf16 inputs take its dot product instead (weight_only.cpp:
// the tiles' values paired for it at a few rows, expanded for brgemm or one GEMM at many;
// weight_only_product decides).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "tensor_args.h"
#include "vec.h"

namespace qpipe_cpu {

constexpr int64_t kTile = 16;  // output features per tile: 2 AVX2 vectors, 1 AVX-512 vector
constexpr int64_t kTileVecs = kTile / kLanes;
constexpr int kBlockRows = 12 / kTileVecs;  // 12 accumulators: 6 rows on AVX2, 12 on AVX-512

// kLanes int8 values as floats. GCC's generic conversion of a narrow int8 vector goes one
// element at a time; the sign-extend and convert instructions take two steps for all lanes.
inline vfloat widen_int8(const int8_t* p) {
  vfloat out;
#if defined(__AVX512F__)
  const __m512 v = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof out);
#elif defined(__AVX2__)
  const __m256 v = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&out, &v, sizeof out);
#else
  for (int64_t l = 0; l < kLanes; ++l) out[l] = static_cast<float>(p[l]);
#endif
  return out;
}

// int4 weights are kept two to a byte: tile rows 2m and 2m + 1 of output feature f in the low and
// high nibble of byte (m, f), each value plus 8 (0..15). A tile of k rows then takes k / 2 * kTile
// bytes, half what one byte per value reads at decode sizes, where the product waits on memory,
// and one load of kLanes bytes yields a weight vector of two rows. The +8 joins the zero point:
// (u - (z + 8)) * s equals (q - z) * s exactly. Tiles of one int8 per byte hold other weights.
template <typename Q>
constexpr bool kNibbles = std::is_same_v<Q, uint8_t>;
template <typename Q>
constexpr float kZeroOffset = kNibbles<Q> ? 8.f : 0.f;

// Weight vector v of tile row i as floats, for tiles of one value per element: int8, or bf16
// (dense bf16 weights on CPUs without a native bf16 GEMM: `dense_linear`).
inline vfloat widen_row(const int8_t* q, int64_t i, int64_t v) {
  return widen_int8(q + i * kTile + v * kLanes);
}
inline vfloat widen_row(const bf16* q, int64_t i, int64_t v) {
  return loadv(q + i * kTile + v * kLanes);
}

// Weight vector v of tile rows i and i + 1 as floats (i even for nibbles).
template <typename Q>
inline void widen_rows(const Q* q, int64_t i, int64_t v, vfloat& a, vfloat& b) {
  a = widen_row(q, i, v);
  b = widen_row(q, i + 1, v);
}
inline void widen_rows(const uint8_t* q, int64_t i, int64_t v, vfloat& a, vfloat& b) {
  const uint8_t* p = q + i / 2 * kTile + v * kLanes;
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
#elif defined(__AVX2__)
  const __m256i w = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(w, _mm256_set1_epi32(15)));
  const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(w, 4));
  std::memcpy(&a, &lo, sizeof a);
  std::memcpy(&b, &hi, sizeof b);
#else
  for (int64_t l = 0; l < kLanes; ++l) {
    a[l] = static_cast<float>(p[l] & 15);
    b[l] = static_cast<float>(p[l] >> 4);
  }
#endif
}

// A tile's scale vector v of group g; a null `scales` stands for ones (W8A8's int8 values, whose
// products are summed exactly and scaled after).
inline vfloat tile_scale(const float* scales, int64_t g, int64_t v) {
  return scales != nullptr ? loadv(scales + g * kTile + v * kLanes) : splat(1.f);
}

// A tile's zero point vector v of group g, plus the storage's offset (`kNibbles`).
template <typename Q>
inline vfloat tile_zero(const float* zeros, int64_t g, int64_t v) {
  return (zeros != nullptr ? loadv(zeros + g * kTile + v * kLanes) : vfloat{}) + kZeroOffset<Q>;
}

// body(i, v, w) with w = (q - zero) * scale in fp32, the eager path's expansion value for value,
// for vector v of every row i of one tile; within a group and vector, rows come in order.
template <typename Q, typename Body>
inline void for_each_dequantized(const Q* q, const float* scales, const float* zeros, int64_t k,
                                 int64_t group, Body&& body) {
  for (int64_t g = 0; g < k / group; ++g) {
    for (int64_t v = 0; v < kTileVecs; ++v) {
      const vfloat s = tile_scale(scales, g, v);
      const vfloat z = tile_zero<Q>(zeros, g, v);
      const int64_t end = (g + 1) * group;
      int64_t i = g * group;
      for (; i + 2 <= end; i += 2) {
        vfloat a, b;
        widen_rows(q, i, v, a, b);
        body(i, v, (a - z) * s);
        body(i + 1, v, (b - z) * s);
      }
      if constexpr (!kNibbles<Q>) {  // a group of odd length (nibbles' groups are even)
        if (i < end) body(i, v, (widen_row(q, i, v) - z) * s);
      }
    }
  }
}

// One tile's weight dequantized in fp32, written as rows of kTile values (row i at
// dst + i * stride).
template <typename Q>
void expand_tile(float* dst, int64_t stride, const Q* q, const float* scales, const float* zeros,
                 int64_t k, int64_t group) {
  for_each_dequantized(q, scales, zeros, k, group, [&](int64_t i, int64_t v, vfloat w) {
    st(dst + i * stride + v * kLanes, w);
  });
}

// Independent partial sums per group in the direct blocks: one chain of multiply-adds per output
// vector waits on the FMA's latency at one or two rows; at three or more the rows interleave.
template <int ROWS>
constexpr int kPartialSums = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;

// Each row's sum of x over each group, [rows, groups] in fp32 (x of row stride k): the direct
// blocks take a zero point as s * (sum x q - z * sum x).
template <typename X>
std::vector<float> group_sums(const X* xs, int64_t rows, int64_t k, int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> sums(rows * groups);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      float sum = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) sum += ld(xs + r * k + i);
      sums[r * groups + g] = sum;
    }
  }
  return sums;
}

// body(std::integral_constant<int, count>) for 1 <= count <= ROWS: a block's row count as a
// compile-time constant, so that its accumulators are registers.
template <int ROWS, typename Body>
void with_block_rows(int64_t count, Body&& body) {
  if constexpr (ROWS > 0) {
    if (count == ROWS) {
      body(std::integral_constant<int, ROWS>{});
    } else {
      with_block_rows<ROWS - 1>(count, body);
    }
  }
}

// What a product does to its sums before the bias: W8A8 on CPUs without VNNI sums the int8
// values' products exactly, then scales them per output feature (the weight's scales) and per row
// (the tokens'), in that order, as the unfused `.mul_(weight_scale)` and `scale_rows` did.
struct Epilogue {
  const float* col_scale = nullptr;  // [out_features], or none
  const float* row_scale = nullptr;  // [rows], or none
};

template <typename V>
inline V scaled(V sum, const Epilogue& e, const V& col_scale, int64_t row) {
  if (e.col_scale != nullptr) sum = sum * col_scale;
  if (e.row_scale != nullptr) sum = sum * e.row_scale[row];
  return sum;
}

// Rows [r, r + count) of one tile's output, columns [first, first + cols) of `o` (row stride n),
// from `sums` (kTile per row) through the epilogue plus the bias. A whole tile's columns go a
// vector at a time: one element at a time cost ~5 % of the GEMM at 32-512 rows on a Zen 3 (+4 %
// offline at c=32).
template <typename T, typename B>
void store_tile_rows(T* o, int64_t n, const B* b, int64_t first, int64_t cols, const float* sums,
                     int64_t r, int64_t count, const Epilogue& e) {
  for (int64_t i = 0; i < count; ++i) {
    if (cols == kTile) {
      for (int64_t v = 0; v < kTileVecs; ++v) {
        const int64_t c = first + v * kLanes;
        const vfloat add = b != nullptr ? loadv(b + c) : vfloat{};
        const vfloat col = e.col_scale != nullptr ? loadv(e.col_scale + c) : vfloat{};
        st(o + (r + i) * n + c, scaled(loadv(sums + i * kTile + v * kLanes), e, col, r + i) + add);
      }
      continue;
    }
    for (int64_t c = first; c < first + cols; ++c) {
      const float add = b != nullptr ? ld(b + c) : 0.f;
      const float col = e.col_scale != nullptr ? e.col_scale[c] : 0.f;
      st(o + (r + i) * n + c, scaled(sums[i * kTile + c - first], e, col, r + i) + add);
    }
  }
}

// out_features fill `tiles` tiles, the last one possibly padded.
inline void check_fits_tiles(int64_t out_features, int64_t tiles) {
  TORCH_CHECK(out_features > 0 && out_features > (tiles - 1) * kTile &&
                  out_features <= tiles * kTile,
              "out_features ", out_features, " does not fit ", tiles, " tiles");
}

// Whether a packed weight is the kernels' tiles of `dtype`, `width` values to a row.
inline bool tiles_of(const at::Tensor& weight, at::ScalarType dtype, int64_t width) {
  return weight.scalar_type() == dtype && !weight.is_mkldnn() && weight.dim() == 3 &&
         weight.size(2) == width;
}

// A weight in tiles of `dtype` (named `dtype_name` in the message) holding out_features rows.
inline void check_tiles(const at::Tensor& weight, at::ScalarType dtype, const char* dtype_name,
                        int64_t out_features) {
  TORCH_CHECK(tiles_of(weight, dtype, kTile) && weight.is_contiguous(),
              "weight must be contiguous ", dtype_name, " tiles [tiles, in_features, ", kTile, "]");
  check_fits_tiles(out_features, weight.size(0));
}

// Whether a linear layer has a bias, which must be contiguous [out_features] in x's dtype.
inline bool has_bias_for(const c10::optional<at::Tensor>& bias, const at::Tensor& x,
                         int64_t out_features) {
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || (bias->numel() == out_features &&
                            bias->scalar_type() == x.scalar_type() && bias->is_contiguous()),
              "bias must be contiguous [out] in x's dtype");
  return has_bias;
}

// out = block sums of x against a weight in tiles of `tile_elems` values each, through the
// epilogue plus the bias, for the kernels whose block takes two adjacent tiles at once (VNNI
// tiles, bf16 pair tiles): `block(rows, tiles, sums, x, w)` with both counts as integral
// constants. The threads split pairs of tiles; each pair is read once per block of kBlockRows
// rows, from L1 or L2 after the first.
template <typename T, typename B, typename X, typename W, typename Block>
void tile_pairs_product(T* o, int64_t n, const B* bias, const X* xs, int64_t rows, int64_t k,
                        const W* weights, int64_t tiles, int64_t tile_elems, const Epilogue& e,
                        Block&& block) {
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    float buffers[2][kBlockRows * kTile];
    float* sums[2] = {buffers[0], buffers[1]};
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t0 = 2 * pair, count_tiles = std::min<int64_t>(2, tiles - t0);
      const W* const w[2] = {weights + t0 * tile_elems,
                             weights + (t0 + count_tiles - 1) * tile_elems};
      for (int64_t r = 0; r < rows; r += kBlockRows) {
        const int64_t count = std::min<int64_t>(kBlockRows, rows - r);
        with_block_rows<kBlockRows>(count, [&](auto c) {
          if (count_tiles == 2) {
            block(c, std::integral_constant<int, 2>{}, sums, xs + r * k, w);
          } else {
            block(c, std::integral_constant<int, 1>{}, sums, xs + r * k, w);
          }
        });
        for (int64_t t = 0; t < count_tiles; ++t) {
          const int64_t first = (t0 + t) * kTile;
          store_tile_rows(o, n, bias, first, std::min(kTile, n - first), sums[t], r, count, e);
        }
      }
    }
  });
}

// o [rows, n] = x's fp32 rows (row stride k) times the tiled int8, int4-pair or bf16 weight
// (scales and zero points per group and tile, or none: `tile_scale`), through the epilogue, plus
// the bias (of type B: the output's, or fp32 for W8A8). The threads split the tiles. Instantiated
// in tiles.cpp for the layers that call it.
template <typename T, typename B, typename Q>
void tiles_product(T* o, const float* xs, int64_t rows, int64_t k, int64_t n, int64_t tiles,
                   const Q* q, const float* s, const float* z, int64_t group, const B* b,
                   const Epilogue& e);

// o [rows, n] = xs [rows, k] @ the fp32 weight in tiles `w` ([tiles, k, kTile], which are the
// panels themselves) + the bias b (or none).
void fp32_tiles_product(float* o, const float* xs, int64_t rows, int64_t k, int64_t n,
                        int64_t tiles, const float* w, const float* b);

}  // namespace qpipe_cpu
