// The fp32 products over weights in tiles (tiles.h): outer-product micro-kernels whose
// accumulators stay in registers, against an fp32 panel per tile or, for a few input rows, the
// tile's quantized values widened in registers.
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace qpipe_cpu {
namespace {

// acc[r] += x[r][i] * w for ROWS input rows (row stride k), fused: one step of the micro-kernels.
// The unroll pragma keeps the accumulators in registers.
template <int ROWS>
__attribute__((always_inline)) inline void outer_product_step(vfloat (&acc)[ROWS][kTileVecs],
                                                              const vfloat (&w)[kTileVecs],
                                                              const float* x, int64_t k,
                                                              int64_t i) {
#pragma GCC unroll 12
  for (int r = 0; r < ROWS; ++r) {
    const vfloat xv = splat(x[r * k + i]);
    for (int64_t v = 0; v < kTileVecs; ++v) acc[r][v] = fmadd(xv, w[v], acc[r][v]);
  }
}

template <int ROWS>
__attribute__((always_inline)) inline void store_sums(float* sums,
                                                      const vfloat (&acc)[ROWS][kTileVecs]) {
  for (int r = 0; r < ROWS; ++r) {
    for (int64_t v = 0; v < kTileVecs; ++v) st(sums + r * kTile + v * kLanes, acc[r][v]);
  }
}

// sums[r][c] = x[r] . panel[:, c] for ROWS input rows (row stride k) and the kTile panel columns.
template <int ROWS>
void panel_block(float* sums, const float* x, int64_t k, const float* panel) {
  vfloat acc[ROWS][kTileVecs] = {};
  for (int64_t i = 0; i < k; ++i) {
    vfloat w[kTileVecs];
    for (int64_t v = 0; v < kTileVecs; ++v) w[v] = loadv(panel + i * kTile + v * kLanes);
    outer_product_step<ROWS>(acc, w, x, k, i);
  }
  store_sums<ROWS>(sums, acc);
}

// panel_block over two adjacent one-vector tiles (AVX-512) at once, into sums0 and sums1: each
// broadcast of x feeds two multiply-adds, and 2 * ROWS of the 32 registers accumulate.
template <int ROWS>
void panel_pair_block(float* sums0, float* sums1, const float* x, int64_t k, const float* p0,
                      const float* p1) {
  vfloat acc0[ROWS] = {}, acc1[ROWS] = {};
  for (int64_t i = 0; i < k; ++i) {
    fetch_stream_ahead(p0 + i * kTile);
    fetch_stream_ahead(p1 + i * kTile);
    const vfloat w0 = loadv(p0 + i * kTile), w1 = loadv(p1 + i * kTile);
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; ++r) {
      const vfloat xv = splat(x[r * k + i]);
      acc0[r] = fmadd(xv, w0, acc0[r]);
      acc1[r] = fmadd(xv, w1, acc1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    st(sums0 + r * kTile, acc0[r]);
    st(sums1 + r * kTile, acc1[r]);
  }
}

// panel_block for a block of up to kDirectRows rows of an input of at most kDirectMaxRows, where
// writing a panel and reading it back costs more than expanding the tile again for each block:
// each weight vector is widened in registers and used at once. Each group's sums of x * q come
// first, the scale and zero point once per group after them, s * (sum x q - z * sum x) with the
// rows' sums of x over the group in `xsum` ([ROWS, groups]; null without a zero point), instead
// of (q - z) * s for every weight: two vector operations fewer per weight vector. Measured on a
// Zen 3 (576 -> 3072, weight in cache): 4 rows 0.16 ms here, 0.31 ms through a panel; at 16 rows
// the two forms are even. With the weights from DRAM at one row, the factored form with its
// partial sums read 7.9 -> 10.4 GB/s (a plain read of the tiles: 11.8).
template <int ROWS, typename Q>
void direct_block(float* sums, const float* x, const float* xsum, int64_t k, const Q* q,
                  const float* scales, const float* zeros, int64_t group) {
  constexpr int kSets = kPartialSums<ROWS>;
  constexpr int kStep = kSets < 2 ? 2 : kSets;  // rows per iteration, read in pairs
  const int64_t groups = k / group;
  vfloat acc[ROWS][kTileVecs] = {};
  for (int64_t g = 0; g < groups; ++g) {
    vfloat part[kSets][ROWS][kTileVecs] = {};
    const int64_t end = (g + 1) * group;
    int64_t i = g * group;
    for (; i + kStep <= end; i += kStep) {
#pragma GCC unroll 4
      for (int u = 0; u < kStep; u += 2) {
        vfloat a[kTileVecs], b[kTileVecs];
        for (int64_t v = 0; v < kTileVecs; ++v) widen_rows(q, i + u, v, a[v], b[v]);
        outer_product_step<ROWS>(part[u % kSets], a, x, k, i + u);
        outer_product_step<ROWS>(part[(u + 1) % kSets], b, x, k, i + u + 1);
      }
    }
    for (; i + 2 <= end; i += 2) {  // a group of a length that kStep does not divide
      vfloat a[kTileVecs], b[kTileVecs];
      for (int64_t v = 0; v < kTileVecs; ++v) widen_rows(q, i, v, a[v], b[v]);
      outer_product_step<ROWS>(part[0], a, x, k, i);
      outer_product_step<ROWS>(part[0], b, x, k, i + 1);
    }
    if constexpr (!kNibbles<Q>) {  // a group of odd length (nibbles' groups are even)
      if (i < end) {
        vfloat w[kTileVecs];
        for (int64_t v = 0; v < kTileVecs; ++v) w[v] = widen_row(q, i, v);
        outer_product_step<ROWS>(part[0], w, x, k, i);
      }
    }
    for (int64_t v = 0; v < kTileVecs; ++v) {
      const vfloat s = tile_scale(scales, g, v);
      const vfloat z = tile_zero<Q>(zeros, g, v);
      for (int r = 0; r < ROWS; ++r) {
        vfloat t = part[0][r][v];
        for (int u = 1; u < kSets; ++u) t += part[u][r][v];
        if (xsum != nullptr) t = fmadd(-z, splat(xsum[r * groups + g]), t);
        acc[r][v] = fmadd(t, s, acc[r][v]);
      }
    }
  }
  store_sums<ROWS>(sums, acc);
}

constexpr int kDirectRows = 4;  // 8 partial sums and 8 accumulators on AVX2
constexpr int64_t kDirectMaxRows = 16;

// One tile's output for all `rows` of x (row stride k): every block of kBlockRows rows against
// the tile's fp32 panel [k, kTile].
template <typename T, typename B>
void panel_rows(T* o, int64_t n, const B* b, int64_t first, int64_t cols, const float* xs,
                int64_t rows, int64_t k, const float* panel, const Epilogue& e) {
  float sums[kBlockRows * kTile];
  for (int64_t r = 0; r < rows; r += kBlockRows) {
    const int64_t count = std::min<int64_t>(kBlockRows, rows - r);
    with_block_rows<kBlockRows>(count, [&](auto c) {
      panel_block<decltype(c)::value>(sums, xs + r * k, k, panel);
    });
    store_tile_rows(o, n, b, first, cols, sums, r, count, e);
  }
}

}  // namespace

template <typename T, typename B, typename Q>
void tiles_product(T* o, const float* xs, int64_t rows, int64_t k, int64_t n, int64_t tiles,
                   const Q* q, const float* s, const float* z, int64_t group, const B* b,
                   const Epilogue& e) {
  const int64_t groups = k / group, tile_scales = groups * kTile;
  const int64_t tile_values = k / (kNibbles<Q> ? 2 : 1) * kTile;
  const bool direct = rows <= kDirectMaxRows;
  const bool zero_points = z != nullptr || kNibbles<Q>;
  const std::vector<float> xsum =
      direct && zero_points ? group_sums(xs, rows, k, group) : std::vector<float>{};
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(direct ? 0 : k * kTile);
    float sums[kDirectRows * kTile];
    for (int64_t t = begin; t < end; ++t) {
      // a thread's tiles are one contiguous stretch of the weight: fetch the next one
      if (t + 1 < end) prefetch_bytes(q + (t + 1) * tile_values, tile_values * sizeof(Q));
      const Q* q_tile = q + t * tile_values;
      const float* s_tile = s != nullptr ? s + t * tile_scales : nullptr;
      const float* z_tile = z != nullptr ? z + t * tile_scales : nullptr;
      const int64_t first = t * kTile, cols = std::min(kTile, n - first);
      if (!direct) {
        expand_tile(panel.data(), kTile, q_tile, s_tile, z_tile, k, group);
        panel_rows(o, n, b, first, cols, xs, rows, k, panel.data(), e);
        continue;
      }
      for (int64_t r = 0; r < rows; r += kDirectRows) {
        const int64_t count = std::min<int64_t>(kDirectRows, rows - r);
        with_block_rows<kDirectRows>(count, [&](auto c) {
          const float* row_sums = zero_points ? xsum.data() + r * groups : nullptr;
          direct_block<decltype(c)::value>(sums, xs + r * k, row_sums, k, q_tile, s_tile, z_tile,
                                           group);
        });
        store_tile_rows(o, n, b, first, cols, sums, r, count, e);
      }
    }
  });
}

void fp32_tiles_product(float* o, const float* xs, int64_t rows, int64_t k, int64_t n,
                        int64_t tiles, const float* w, const float* b) {
  if constexpr (kTileVecs == 1) {  // pairs of one-vector tiles, each broadcast feeding both
    tile_pairs_product(o, n, b, xs, rows, k, w, tiles, k * kTile, Epilogue{},
                       [&](auto c, auto t, auto& sums, auto x, auto& panels) {
                         constexpr int kRows = decltype(c)::value;
                         if constexpr (decltype(t)::value == 2) {
                           panel_pair_block<kRows>(sums[0], sums[1], x, k, panels[0], panels[1]);
                         } else {
                           panel_block<kRows>(sums[0], x, k, panels[0]);
                         }
                       });
    return;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * kTile;
      panel_rows(o, n, b, first, std::min(kTile, n - first), xs, rows, k, w + t * k * kTile,
                 Epilogue{});
    }
  });
}

// The products the layers ask for: weight-only tiles (int8, int4 pairs) and dense bf16 tiles with
// a bias of the output's dtype, W8A8's int8 values with an fp32 bias.
#define QPIPE_TILES_PRODUCT(T, B, Q)                                                            \
  template void tiles_product<T, B, Q>(T*, const float*, int64_t, int64_t, int64_t, int64_t,    \
                                       const Q*, const float*, const float*, int64_t, const B*, \
                                       const Epilogue&)
QPIPE_TILES_PRODUCT(float, float, int8_t);
QPIPE_TILES_PRODUCT(float, float, uint8_t);
QPIPE_TILES_PRODUCT(float, float, bf16);
QPIPE_TILES_PRODUCT(float, bf16, bf16);  // bf16 x (and bias) summed into fp32 logits
QPIPE_TILES_PRODUCT(bf16, bf16, int8_t);
QPIPE_TILES_PRODUCT(bf16, bf16, uint8_t);
QPIPE_TILES_PRODUCT(bf16, bf16, bf16);
QPIPE_TILES_PRODUCT(bf16, float, int8_t);
#undef QPIPE_TILES_PRODUCT

}  // namespace qpipe_cpu
