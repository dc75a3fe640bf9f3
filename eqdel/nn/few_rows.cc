// Products of a few rows (a decode step's tokens) with a weight matrix, on CPU.
//
// XLA's CPU backend runs a one-row product through a general matrix kernel that reads
// 16-bit and quantized weights only after converting them to float32, and it converts
// loop-invariant weights once, before a decode loop, so every step reads float32. These
// kernels read each weight once, as stored (float32, bfloat16, int8 codes, 4-bit codes),
// convert in registers and accumulate in float32, with the output columns split over
// XLA's intra-op threads. Rows are float32, already rounded where the product asks for
// it; a 4-bit product's rows are zero-padded to whole groups. Bfloat16 weights run on
// AVX-512 BF16's dot products of pairs where the CPU has them, a tied head on the tile
// unit (AMX) where it has one. A decode step's attention on a float32
// key/value cache, read as stored, is here too (`attend`), and so is a float32 product of
// many rows (prefill, training) through OpenBLAS (`GemmImpl`), and the lookup of a
// bfloat16 embedding table (`GatherBF16Impl`).

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define EQDEL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace ffi = xla::ffi;
using eqdel::bf16_to_float;
using eqdel::float_to_bf16;
using eqdel::parallel_for;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int8_t v16s8 __attribute__((vector_size(16)));
typedef uint8_t v16u8 __attribute__((vector_size(16)));
typedef uint16_t v16u16 __attribute__((vector_size(32)));

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxRows = 16;
constexpr int64_t kAhead = 8;
constexpr int64_t kAccFloats = 8192;  // 32 KiB of partial sums per task, up to four rows
constexpr int64_t kManyRowsAccFloats = 2048;  // 8 KiB for more rows

template <class T>
inline T load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

inline v16 load_acc(const float* p) { return load<v16>(p); }
inline void store(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }

// Sixteen bytes widened to int32 lanes (GCC lowers `__builtin_convertvector` from bytes
// lane by lane), and a lookup of sixteen lanes in a sixteen-entry table.
inline v16i widen(const int8_t* p) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(load<v16s8>(p), v16i);
#endif
}

inline v16i widen(const uint8_t* p) {
#if defined(__AVX512F__)
  return (v16i)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return __builtin_convertvector(load<v16u8>(p), v16i);
#endif
}

inline v16 lookup(v16 table, v16i index) {
#if defined(__AVX512F__)
  return (v16)_mm512_permutexvar_ps((__m512i)index, (__m512)table);
#else
  return __builtin_shuffle(table, index);
#endif
}

// The sum of sixteen lanes, as a tree of adds.
inline float lane_sum(v16 v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float t[kLanes];
  std::memcpy(t, &v, sizeof(t));
  for (int64_t half = kLanes / 2; half > 0; half /= 2)
    for (int64_t l = 0; l < half; ++l) t[l] += t[l + half];
  return t[0];
#endif
}

// The lane sums of up to sixteen vectors at once: lane k of the result is the sum of
// `v[k]`'s lanes (0 for k >= N). A tree of interleaves (of pairs of lanes, of 64-bit
// pairs, then of 128-bit quarters) takes 45 operations where sixteen separate sums take
// about 130.
template <int N>
inline v16 lane_sums(const v16 (&v)[N]) {
  static_assert(N >= 1 && N <= 16);
  auto at = [&](int k) { return k < N ? v[k] : v16{}; };
  const v16i lo32 = {0, 16, 1, 17, 4, 20, 5, 21, 8, 24, 9, 25, 12, 28, 13, 29};
  const v16i hi32 = {2, 18, 3, 19, 6, 22, 7, 23, 10, 26, 11, 27, 14, 30, 15, 31};
  const v16i lo64 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const v16i hi64 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const v16i even128 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const v16i odd128 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  auto fold = [](v16 a, v16 b, v16i first, v16i second) {
    return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
  };
  v16 pairs[8], quads[4], halves[2];
  for (int j = 0; j < 8; ++j) pairs[j] = fold(at(2 * j), at(2 * j + 1), lo32, hi32);
  for (int j = 0; j < 4; ++j) quads[j] = fold(pairs[2 * j], pairs[2 * j + 1], lo64, hi64);
  for (int j = 0; j < 2; ++j) halves[j] = fold(quads[2 * j], quads[2 * j + 1], even128, odd128);
  return fold(halves[0], halves[1], even128, odd128);
}

// Runs `tile(k0, k1, c0, c1, acc)` over a grid of weight-row chunks and column tiles,
// each tile's partial sums `acc[rows][c1 - c0]` small enough for L1, and writes
// y[r, c] = (sum of the chunks' partial sums) * scale[c] (no scale when null). A one-row
// product takes whole rows of the weight, read front to back, split into chunks of rows
// over the threads; more rows take narrower tiles. Split into chunks, each task leaves
// its sums in the calling thread's scratch, and the last chunk of a tile to finish adds
// that tile's up. Beyond four rows the tiles hold a quarter of the sums: more tiles
// share out the work, so a tile is cut into fewer chunks, whose sums (rows x width
// each) one thread adds while the other may wait (SmolLM2's MLP products at 8 and 16
// rows: 25-30% faster on a Zen 4 host).
template <class Tile>
void product(ffi::ThreadPool& pool, int64_t rows, int64_t depth, int64_t out,
             const float* scale, float* y, const Tile& tile) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t budget = rows <= 4 ? kAccFloats : kManyRowsAccFloats;
  const int64_t width = std::min(out, std::max(kLanes, budget / rows / kLanes * kLanes));
  const int64_t tiles = (out + width - 1) / width;
  const int64_t wanted = (4 * threads + tiles - 1) / tiles;
  const int64_t chunks = std::clamp<int64_t>(wanted, 1, std::max<int64_t>(depth / 64, 1));
  const int64_t per = (depth + chunks - 1) / chunks, size = rows * out;
  thread_local std::vector<float> scratch;
  std::unique_ptr<std::atomic<int64_t>[]> pending;  // chunks of each tile still running
  if (chunks > 1) {
    if (scratch.size() < size_t(chunks * size)) scratch.resize(chunks * size);
    pending.reset(new std::atomic<int64_t>[tiles]);
    for (int64_t t = 0; t < tiles; ++t) pending[t].store(chunks, std::memory_order_relaxed);
  }
  float* partial = scratch.data();
  parallel_for(pool, chunks * tiles, [&](int64_t task) {
    alignas(64) float acc[kAccFloats];
    const int64_t chunk = task / tiles, c0 = task % tiles * width;
    const int64_t c1 = std::min(out, c0 + width), n = c1 - c0, k0 = chunk * per;
    std::fill(acc, acc + rows * n, 0.0f);
    tile(k0, std::min(depth, k0 + per), c0, c1, acc);
    if (chunks > 1) {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(partial + chunk * size + r * out + c0, acc + r * n, n * sizeof(float));
      if (pending[task % tiles].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
      for (int64_t r = 0; r < rows; ++r) {
        float* sums = acc + r * n;
        std::fill(sums, sums + n, 0.0f);
        for (int64_t other = 0; other < chunks; ++other) {
          const float* part = partial + other * size + r * out + c0;
          for (int64_t c = 0; c < n; ++c) sums[c] += part[c];
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c)
        y[r * out + c0 + c] = scale ? acc[r * n + c] * scale[c0 + c] : acc[r * n + c];
  });
}

// Weights stored [in, out], row-major: sixteen consecutive outputs of input i.
struct F32Rows {
  const float* w;
  int64_t out;
  v16 vec(int64_t i, int64_t c) const { return load<v16>(w + i * out + c); }
  float at(int64_t i, int64_t c) const { return w[i * out + c]; }
  void prefetch(int64_t i, int64_t c) const { __builtin_prefetch(w + i * out + c); }
};

struct BF16Rows {
  const uint16_t* w;
  int64_t out;
  v16 vec(int64_t i, int64_t c) const {
    v16u wide = __builtin_convertvector(load<v16u16>(w + i * out + c), v16u) << 16;
    return (v16)wide;
  }
  float at(int64_t i, int64_t c) const { return bf16_to_float(w[i * out + c]); }
  void prefetch(int64_t i, int64_t c) const { __builtin_prefetch(w + i * out + c); }
};

struct S8Rows {
  const int8_t* w;
  int64_t out;
  v16 vec(int64_t i, int64_t c) const {
    return __builtin_convertvector(widen(w + i * out + c), v16);
  }
  float at(int64_t i, int64_t c) const { return float(w[i * out + c]); }
  void prefetch(int64_t i, int64_t c) const { __builtin_prefetch(w + i * out + c); }
};

// Int8 codes with one scale per `group` inputs of each output, scales stored [groups, out].
struct S8GroupRows {
  const int8_t* w;
  const float* scales;
  int64_t out, group;
  v16 vec(int64_t i, int64_t c) const {
    return __builtin_convertvector(widen(w + i * out + c), v16) *
           load<v16>(scales + i / group * out + c);
  }
  float at(int64_t i, int64_t c) const {
    return float(w[i * out + c]) * scales[i / group * out + c];
  }
  void prefetch(int64_t i, int64_t c) const { __builtin_prefetch(w + i * out + c); }
};

// acc[r, c - c0] += sum over i in [i0, i1) of x[r, i] w[i, c], four inputs at a time,
// each weight row read front to back.
template <class W>
void dense_tile(const float* x, int64_t rows, int64_t in, const W& w, int64_t i0, int64_t i1,
                int64_t c0, int64_t c1, float* acc) {
  const int64_t width = c1 - c0, vectors = width / kLanes;
  int64_t i = i0;
  for (; i + 4 <= i1; i += 4) {
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t c = c0 + v * kLanes;
      v16 w0 = w.vec(i, c), w1 = w.vec(i + 1, c), w2 = w.vec(i + 2, c), w3 = w.vec(i + 3, c);
      if (i + kAhead + 4 <= i1)
        for (int j = 0; j < 4; ++j) w.prefetch(i + kAhead + j, c);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * in + i;
        float* a = acc + r * width + v * kLanes;
        store(a, load_acc(a) + xr[0] * w0 + xr[1] * w1 + xr[2] * w2 + xr[3] * w3);
      }
    }
    for (int64_t c = c0 + vectors * kLanes; c < c1; ++c)
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * in + i;
        acc[r * width + c - c0] += xr[0] * w.at(i, c) + xr[1] * w.at(i + 1, c) +
                                   xr[2] * w.at(i + 2, c) + xr[3] * w.at(i + 3, c);
      }
  }
  for (; i < i1; ++i)
    for (int64_t c = c0; c < c1; ++c)
      for (int64_t r = 0; r < rows; ++r) acc[r * width + c - c0] += x[r * in + i] * w.at(i, c);
}

template <class W>
void dense(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t in, int64_t out,
           const W& w, const float* scale, float* y) {
  product(pool, rows, in, out, scale, y,
          [&](int64_t i0, int64_t i1, int64_t c0, int64_t c1, float* acc) {
            dense_tile(x, rows, in, w, i0, i1, c0, c1, acc);
          });
}

// Weights stored [out, in] (a tied embedding table): y[r, o] = sum_i x[r, i] w[o, i] for
// R rows and O outputs at once, one vector of partial sums for each pair. With more than
// two rows, the next O outputs' weights are fetched ahead (`ahead(o, i)` prefetches).
template <int R, int O, class Vec, class At, class Ahead>
void transposed_block(const float* x, int64_t in, int64_t o, const Vec& vec, const At& at,
                      const Ahead& ahead, float* y, int64_t out) {
  v16 acc[R][O] = {};
  int64_t i = 0;
  for (; i + kLanes <= in; i += kLanes) {
    v16 wv[O];
    for (int p = 0; p < O; ++p) wv[p] = vec(o + p, i);
    if constexpr (R > 2)
      for (int p = 0; p < O; ++p) ahead(o + O + p, i);
    for (int r = 0; r < R; ++r) {
      const v16 xv = load<v16>(x + r * in + i);
      for (int p = 0; p < O; ++p) acc[r][p] += xv * wv[p];
    }
  }
  v16 parts[R * O];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < O; ++p) parts[r * O + p] = acc[r][p];
  const v16 sums = lane_sums(parts);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < O; ++p) {
      float sum = sums[r * O + p];
      for (int64_t j = i; j < in; ++j) sum += x[r * in + j] * at(o + p, j);
      y[r * out + o + p] = sum;
    }
}

// `block(R, O, r, o)` for rows [r, r + R) against outputs [o, o + O), R and O as
// std::integral_constant: n rows, n from 1 to B.
template <int B, int O, class Block>
void row_block(int64_t n, int64_t r, int64_t o, const Block& block) {
  if (n == B)
    return block(std::integral_constant<int, B>(), std::integral_constant<int, O>(), r, o);
  if constexpr (B > 1) row_block<B - 1, O>(n, r, o, block);
}

// Every row against outputs [o, o + O), B rows at a time.
template <int B, int O, class Block>
void row_blocks(int64_t rows, int64_t o, const Block& block) {
  for (int64_t r = 0; r < rows; r += B)
    row_block<B, O>(std::min<int64_t>(B, rows - r), r, o, block);
}

// Runs `block(R, O, r, o)` (see `row_block`) over every row and output of a product whose
// weight is stored [out, in], the outputs split into tasks over the threads: eight
// outputs at a time for one or two rows, four for three or four rows, and two for more
// (eight rows at a time, so that a weight vector read once serves eight rows), so that
// the partial sums and the weight vectors stay in registers.
template <class Block>
void output_blocks(ffi::ThreadPool& pool, int64_t rows, int64_t out, const Block& block) {
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per = std::max<int64_t>(64, (out + 16 * threads - 1) / (16 * threads)) / 8 * 8;
  const int64_t tasks = (out + per - 1) / per;
  parallel_for(pool, tasks, [&](int64_t t) {
    int64_t o = t * per;
    const int64_t end = std::min(out, o + per);
    if (rows <= 2)
      for (; o + 8 <= end; o += 8) row_blocks<2, 8>(rows, o, block);
    else if (rows <= 4)
      for (; o + 4 <= end; o += 4) row_blocks<4, 4>(rows, o, block);
    else
      for (; o + 2 <= end; o += 2) row_blocks<8, 2>(rows, o, block);
    for (; o < end; ++o) row_blocks<8, 1>(rows, o, block);
  });
}

// `ahead(o, i)` prefetches the weights of output o from input i on; it may be given
// outputs past the last (a prefetch does not fault).
template <class Vec, class At, class Ahead>
void transposed(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t in, int64_t out,
                const Vec& vec, const At& at, const Ahead& ahead, float* y) {
  output_blocks(pool, rows, out, [&](auto R, auto O, int64_t r, int64_t o) {
    transposed_block<decltype(R)::value, decltype(O)::value>(x + r * in, in, o, vec, at, ahead,
                                                             y + r * out, out);
  });
}

// A bfloat16 tied head on the CPU's tile unit (AMX): one tile product multiplies 16
// outputs x 32 inputs of the table, read where they lie, by 32 inputs of every row,
// accumulating in float32 tiles, where the vector kernel converts each weight to float32
// and does a multiply-add per row. The rows are float32 values already rounded to
// bfloat16, so their top halves are exact. (Weights stored [in, out] would have to be
// repacked, input pairs side by side, for every tile: measured on SmolLM2's MLP
// products, that was no faster than the vector kernel below 12 rows.)
#if defined(EQDEL_AMX)
// Linux gives a process the tile registers only once it asks (once, for every thread).
bool amx_ready() {
  static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                                    18 /* XFEATURE_XTILEDATA */) == 0;
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Loads a tile configuration for this thread and releases it when done.
struct Tiles {
  explicit Tiles(const TileConfig& config) { _tile_loadconfig(&config); }
  ~Tiles() { _tile_release(); }
};

inline uint16_t top_half(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t(bits >> 16);
}

// Weights stored [out, in] (a tied embedding table), `in` a multiple of 32: tiles 5 to 7
// read 16 outputs x 32 inputs of the weight where it lies, tile 4 holds 32 inputs of
// every row in the tile unit's layout, tiles 0 to 3 the sums of 64 outputs x the rows.
void amx_transposed(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t in,
                    int64_t out, const uint16_t* w, float* y) {
  std::vector<uint16_t> pairs(rows * in);  // [in / 2, rows, 2]
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i)
      pairs[(i / 2 * rows + r) * 2 + i % 2] = top_half(x[r * in + i]);
  TileConfig config;
  for (int t = 0; t < 4; ++t) config.rows[t] = 16, config.colsb[t] = rows * 4;
  config.rows[4] = 16, config.colsb[4] = rows * 4;
  for (int t = 5; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  const int64_t whole = out / 64;
  parallel_for(pool, whole, [&](int64_t task) {
    Tiles tiles(config);
    alignas(64) float sums[4][16 * 16];
    const int64_t o = task * 64;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < in; k0 += 32) {
      _tile_loadd(4, pairs.data() + k0 * rows, rows * 4);
      const uint16_t* a = w + o * in + k0;
      _tile_loadd(5, a, in * 2);
      _tile_dpbf16ps(0, 5, 4);
      _tile_loadd(6, a + 16 * in, in * 2);
      _tile_dpbf16ps(1, 6, 4);
      _tile_loadd(7, a + 32 * in, in * 2);
      _tile_dpbf16ps(2, 7, 4);
      _tile_loadd(5, a + 48 * in, in * 2);
      _tile_dpbf16ps(3, 5, 4);
    }
    _tile_stored(0, sums[0], rows * 4);
    _tile_stored(1, sums[1], rows * 4);
    _tile_stored(2, sums[2], rows * 4);
    _tile_stored(3, sums[3], rows * 4);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < 64; ++c) y[r * out + o + c] = sums[c / 16][c % 16 * rows + r];
  });
  // The last outputs, fewer than 64, one dot product each.
  for (int64_t o = whole * 64; o < out; ++o)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t i = 0; i < in; ++i) sum += x[r * in + i] * bf16_to_float(w[o * in + i]);
      y[r * out + o] = sum;
    }
}
#endif

#if defined(__AVX512BF16__)
// A bfloat16 table stored [out, in] on AVX-512 BF16: an output's inputs already lie in
// pairs, so one instruction (vdpbf16ps) multiplies 32 of them by the same 32 inputs of a
// row (`x`, bfloat16) and adds the pairs' products to 16 float32 sums, where the vector
// kernel widens the weights to float32 first and needs two multiply-adds.
template <int R, int O>
void pair_block(const uint16_t* x, int64_t in, const uint16_t* w, int64_t o, float* y,
                int64_t out) {
  __m512 acc[R][O];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < O; ++p) acc[r][p] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= in; i += 32) {
    __m512bh wv[O];
    for (int p = 0; p < O; ++p) wv[p] = (__m512bh)_mm512_loadu_si512(w + (o + p) * in + i);
    if constexpr (R > 2)
      for (int p = 0; p < O; ++p) __builtin_prefetch(w + (o + O + p) * in + i);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * in + i);
      for (int p = 0; p < O; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], xv, wv[p]);
    }
  }
  v16 parts[R * O];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < O; ++p) parts[r * O + p] = (v16)acc[r][p];
  const v16 sums = lane_sums(parts);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < O; ++p) {
      float sum = sums[r * O + p];
      for (int64_t j = i; j < in; ++j)
        sum += bf16_to_float(x[r * in + j]) * bf16_to_float(w[(o + p) * in + j]);
      y[r * out + o + p] = sum;
    }
}

void pair_transposed(ffi::ThreadPool& pool, const uint16_t* x, int64_t rows, int64_t in,
                     int64_t out, const uint16_t* w, float* y) {
  output_blocks(pool, rows, out, [&](auto R, auto O, int64_t r, int64_t o) {
    pair_block<decltype(R)::value, decltype(O)::value>(x + r * in, in, w, o, y + r * out, out);
  });
}

// acc[r, c - c0] += sum over i in [i0, i1) of x[r, i] w[i, c] for bfloat16 weights
// stored [in, out] and bfloat16 rows, on AVX-512 BF16: the weight rows of two inputs are
// interleaved in registers into pairs, and each pair of a row's inputs (one 32-bit
// broadcast) multiplies them with vdpbf16ps, eight inputs per pass over the sums, each
// weight row read front to back. Blocks of 32 outputs keep their sums in the
// interleaving's order, (0-3, 8-11, 16-19, 24-27) and (4-7, 12-15, 20-23, 28-31), and put
// them in order once at the end.
void pair_dense_tile(const uint16_t* x, int64_t rows, int64_t in, const uint16_t* w,
                     int64_t out, int64_t i0, int64_t i1, int64_t c0, int64_t c1, float* acc) {
  const int64_t width = c1 - c0, blocks = width / 32;
  auto pair_of = [&](int64_t r, int64_t i) {
    uint32_t bits;
    std::memcpy(&bits, x + r * in + i, 4);
    return (__m512bh)_mm512_set1_epi32(int(bits));
  };
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t c = c0 + b * 32;
      __m512bh lo[4], hi[4];
      for (int q = 0; q < 4; ++q) {
        const __m512i a = _mm512_loadu_si512(w + (i + 2 * q) * out + c);
        const __m512i d = _mm512_loadu_si512(w + (i + 2 * q + 1) * out + c);
        lo[q] = (__m512bh)_mm512_unpacklo_epi16(a, d);
        hi[q] = (__m512bh)_mm512_unpackhi_epi16(a, d);
      }
      if (i + kAhead + 8 <= i1)
        for (int j = 0; j < 8; ++j) __builtin_prefetch(w + (i + kAhead + j) * out + c);
      for (int64_t r = 0; r < rows; ++r) {
        float* a = acc + r * width + b * 32;
        __m512 sum_lo = _mm512_loadu_ps(a), sum_hi = _mm512_loadu_ps(a + 16);
        for (int q = 0; q < 4; ++q) {
          const __m512bh xp = pair_of(r, i + 2 * q);
          sum_lo = _mm512_dpbf16_ps(sum_lo, xp, lo[q]);
          sum_hi = _mm512_dpbf16_ps(sum_hi, xp, hi[q]);
        }
        _mm512_storeu_ps(a, sum_lo);
        _mm512_storeu_ps(a + 16, sum_hi);
      }
    }
  }
  const int64_t last = i;  // the inputs left, fewer than 8, go below
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                           30, 31);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float* a = acc + r * width + b * 32;
      const __m512 lo = _mm512_loadu_ps(a), hi = _mm512_loadu_ps(a + 16);
      _mm512_storeu_ps(a, _mm512_permutex2var_ps(lo, first, hi));
      _mm512_storeu_ps(a + 16, _mm512_permutex2var_ps(lo, second, hi));
    }
  // The inputs left over, and the last outputs (fewer than 32), widened to float32.
  const BF16Rows rest{w, out};
  auto widened = [&](int64_t from, int64_t to, int64_t ca, int64_t cb) {
    int64_t c = ca;
    for (; c + kLanes <= cb; c += kLanes)
      for (int64_t k = from; k < to; ++k) {
        const v16 wv = rest.vec(k, c);
        for (int64_t r = 0; r < rows; ++r) {
          float* a = acc + r * width + c - c0;
          store(a, load_acc(a) + bf16_to_float(x[r * in + k]) * wv);
        }
      }
    for (; c < cb; ++c)
      for (int64_t k = from; k < to; ++k)
        for (int64_t r = 0; r < rows; ++r)
          acc[r * width + c - c0] += bf16_to_float(x[r * in + k]) * rest.at(k, c);
  };
  widened(last, i1, c0, c0 + blocks * 32);
  widened(i0, i1, c0 + blocks * 32, c1);
}
#endif

// Four-bit codes, two per byte, stored [packed, out]. Each kernel turns byte row k into
// the two inputs it holds, `lo(k)` and `hi(k)`, and their values for sixteen outputs.
template <class Codes>
void nibble_tile(const float* x, int64_t rows, int64_t in, const Codes& codes, int64_t k0,
                 int64_t k1, int64_t c0, int64_t c1, float* acc) {
  const int64_t width = c1 - c0, vectors = width / kLanes;
  int64_t k = k0;
  for (; k + 2 <= k1; k += 2) {  // two byte rows, four inputs, per pass over the sums
    const int64_t lo0 = codes.lo(k), hi0 = codes.hi(k), lo1 = codes.lo(k + 1),
                  hi1 = codes.hi(k + 1);
    for (int64_t v = 0; v < vectors; ++v) {
      const int64_t c = c0 + v * kLanes;
      v16 a_lo, a_hi, b_lo, b_hi;
      codes.vec(k, c, a_lo, a_hi);
      codes.vec(k + 1, c, b_lo, b_hi);
      if (k + kAhead + 2 <= k1) {
        codes.prefetch(k + kAhead, c);
        codes.prefetch(k + kAhead + 1, c);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * in;
        float* a = acc + r * width + v * kLanes;
        store(a, load_acc(a) + xr[lo0] * a_lo + xr[hi0] * a_hi + xr[lo1] * b_lo +
                     xr[hi1] * b_hi);
      }
    }
    for (int64_t c = c0 + vectors * kLanes; c < c1; ++c) {
      float a_lo, a_hi, b_lo, b_hi;
      codes.at(k, c, a_lo, a_hi);
      codes.at(k + 1, c, b_lo, b_hi);
      for (int64_t r = 0; r < rows; ++r) {
        const float* xr = x + r * in;
        acc[r * width + c - c0] +=
            xr[lo0] * a_lo + xr[hi0] * a_hi + xr[lo1] * b_lo + xr[hi1] * b_hi;
      }
    }
  }
  for (; k < k1; ++k) {
    const int64_t lo = codes.lo(k), hi = codes.hi(k);
    for (int64_t c = c0; c < c1; ++c) {
      float w_lo, w_hi;
      codes.at(k, c, w_lo, w_hi);
      for (int64_t r = 0; r < rows; ++r)
        acc[r * width + c - c0] += x[r * in + lo] * w_lo + x[r * in + hi] * w_hi;
    }
  }
}

// Int4Linear: in every block of `group` inputs byte k holds input k (low four bits) and
// k + group / 2 (high); w = q * scale + offset, per block and output.
struct Int4Codes {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t out, group, packed;
  int64_t lo(int64_t k) const { return k / (group / 2) * group + k % (group / 2); }
  int64_t hi(int64_t k) const { return lo(k) + group / 2; }
  void vec(int64_t k, int64_t c, v16& w_lo, v16& w_hi) const {
    const int64_t g = k / (group / 2);
    v16 s = load<v16>(scales + g * out + c), z = load<v16>(offsets + g * out + c);
    v16i b = widen(codes + k * out + c);
    w_lo = __builtin_convertvector(b & 15, v16) * s + z;
    w_hi = __builtin_convertvector(b >> 4, v16) * s + z;
  }
  void at(int64_t k, int64_t c, float& w_lo, float& w_hi) const {
    const int64_t g = k / (group / 2);
    const float s = scales[g * out + c], z = offsets[g * out + c];
    const uint8_t b = codes[k * out + c];
    w_lo = float(b & 15) * s + z;
    w_hi = float(b >> 4) * s + z;
  }
  void prefetch(int64_t k, int64_t c) const { __builtin_prefetch(codes + k * out + c); }
};

// NF4Linear: byte k holds inputs 2k (low four bits) and 2k + 1 (high); w = level * scale,
// one scale per `group` inputs and output.
struct NF4Codes {
  const uint8_t* codes;
  const float* scales;
  const float* levels;
  int64_t out, group, packed, groups;
  int64_t lo(int64_t k) const { return 2 * k; }
  int64_t hi(int64_t k) const { return 2 * k + 1; }
  // An odd group size puts a byte's two inputs in two groups, each with its scale; the
  // padding input of an odd count (code 0, row 0) takes the last group's.
  const float* scale(int64_t input, int64_t c) const {
    return scales + std::min(input / group, groups - 1) * out + c;
  }
  void vec(int64_t k, int64_t c, v16& w_lo, v16& w_hi) const {
    const v16 table = load<v16>(levels);
    v16i b = widen(codes + k * out + c);
    w_lo = lookup(table, b & 15) * load<v16>(scale(2 * k, c));
    w_hi = lookup(table, b >> 4) * load<v16>(scale(2 * k + 1, c));
  }
  void at(int64_t k, int64_t c, float& w_lo, float& w_hi) const {
    const uint8_t b = codes[k * out + c];
    w_lo = levels[b & 15] * *scale(2 * k, c);
    w_hi = levels[b >> 4] * *scale(2 * k + 1, c);
  }
  void prefetch(int64_t k, int64_t c) const { __builtin_prefetch(codes + k * out + c); }
};

template <class Codes>
void nibbles(ffi::ThreadPool& pool, const float* x, int64_t rows, int64_t in, int64_t out,
             const Codes& codes, float* y) {
  product(pool, rows, codes.packed, out, nullptr, y,
          [&](int64_t k0, int64_t k1, int64_t c0, int64_t c1, float* acc) {
            nibble_tile(x, rows, in, codes, k0, k1, c0, c1, acc);
          });
}

ffi::Error check_rows(int64_t rows) {
  if (rows < 1 || rows > kMaxRows)
    return ffi::Error::InvalidArgument("few-rows product: 1 to 16 rows");
  return ffi::Error::Success();
}

ffi::Error F32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y, int64_t transposed_weight) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1];
  if (auto e = check_rows(rows); e.failure()) return e;
  const float* wd = w.typed_data();
  if (transposed_weight) {
    transposed(
        pool, x.typed_data(), rows, in, out,
        [=](int64_t o, int64_t i) { return load<v16>(wd + o * in + i); },
        [=](int64_t o, int64_t i) { return wd[o * in + i]; },
        [=](int64_t o, int64_t i) { __builtin_prefetch(wd + o * in + i); }, y->typed_data());
  } else {
    dense(pool, x.typed_data(), rows, in, out, F32Rows{wd, out}, nullptr, y->typed_data());
  }
  return ffi::Error::Success();
}

ffi::Error BF16Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> w,
                    ffi::ResultBuffer<ffi::F32> y, int64_t transposed_weight) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1];
  if (auto e = check_rows(rows); e.failure()) return e;
  const uint16_t* wd = w.typed_data();
  // The rows are rounded to bfloat16 here, where XLA would round them in an operation of
  // its own before the call.
  const float* xd = x.typed_data();
#if defined(EQDEL_AMX)
  const bool tile_unit = transposed_weight && in % 32 == 0 && amx_ready();
#else
  const bool tile_unit = false;
#endif
#if defined(__AVX512BF16__)
  if (!tile_unit) {
    thread_local std::vector<uint16_t> halves;
    halves.resize(rows * in);
    for (int64_t i = 0; i < rows * in; ++i) halves[i] = float_to_bf16(xd[i]);
    const uint16_t* xh = halves.data();  // this thread's: the tasks run on others
    if (transposed_weight) {
      pair_transposed(pool, xh, rows, in, out, wd, y->typed_data());
    } else {
      product(pool, rows, in, out, nullptr, y->typed_data(),
              [&](int64_t i0, int64_t i1, int64_t c0, int64_t c1, float* acc) {
                pair_dense_tile(xh, rows, in, wd, out, i0, i1, c0, c1, acc);
              });
    }
    return ffi::Error::Success();
  }
#endif
  thread_local std::vector<float> rounded;
  rounded.resize(rows * in);
  for (int64_t i = 0; i < rows * in; ++i) rounded[i] = bf16_to_float(float_to_bf16(xd[i]));
  xd = rounded.data();
#if defined(EQDEL_AMX)
  if (tile_unit) {
    amx_transposed(pool, xd, rows, in, out, wd, y->typed_data());
    return ffi::Error::Success();
  }
#endif
  if (transposed_weight) {
    transposed(
        pool, xd, rows, in, out,
        [=](int64_t o, int64_t i) {
          v16u wide = __builtin_convertvector(load<v16u16>(wd + o * in + i), v16u) << 16;
          return (v16)wide;
        },
        [=](int64_t o, int64_t i) { return bf16_to_float(wd[o * in + i]); },
        [=](int64_t o, int64_t i) { __builtin_prefetch(wd + o * in + i); }, y->typed_data());
  } else {
    dense(pool, xd, rows, in, out, BF16Rows{wd, out}, nullptr, y->typed_data());
  }
  return ffi::Error::Success();
}

// Int8Linear: scales [out] (one per output, `group` 0) or [groups, out] (one per `group`
// inputs of each output).
ffi::Error Int8Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> codes,
                    ffi::Buffer<ffi::F32> scales, ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1];
  if (auto e = check_rows(rows); e.failure()) return e;
  if (group > 0) {
    S8GroupRows w{codes.typed_data(), scales.typed_data(), out, group};
    dense(pool, x.typed_data(), rows, in, out, w, nullptr, y->typed_data());
  } else {
    dense(pool, x.typed_data(), rows, in, out, S8Rows{codes.typed_data(), out},
          scales.typed_data(), y->typed_data());
  }
  return ffi::Error::Success();
}

// Int8Embedding as a tied head: codes stored [out, in], w[o, i] = code * scale[o, i / group].
// A group that is a multiple of sixteen inputs puts every vector in one group.
ffi::Error Int8TransposedImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                              ffi::Buffer<ffi::S8> codes, ffi::Buffer<ffi::F32> scales,
                              ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1], groups = scales.dimensions()[1];
  if (auto e = check_rows(rows); e.failure()) return e;
  const int8_t* cd = codes.typed_data();
  const float* sd = scales.typed_data();
  const bool whole = group % kLanes == 0;
  // A power of two (llama.cpp's 32) finds a vector's group by a shift, not a division.
  const int shift = whole && (group & (group - 1)) == 0 ? __builtin_ctzll(group) : -1;
  transposed(
      pool, x.typed_data(), rows, in, out,
      [=](int64_t o, int64_t i) {
        const v16 w = __builtin_convertvector(widen(cd + o * in + i), v16);
        const float* s = sd + o * groups;
        if (shift >= 0) return w * s[i >> shift];
        if (whole) return w * s[i / group];
        v16 lanes;
        for (int64_t l = 0; l < kLanes; ++l) lanes[l] = s[(i + l) / group];
        return w * lanes;
      },
      [=](int64_t o, int64_t i) { return float(cd[o * in + i]) * sd[o * groups + i / group]; },
      [=](int64_t o, int64_t i) { __builtin_prefetch(cd + o * in + i); }, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error Int4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                    ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> offsets,
                    ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1], packed = codes.dimensions()[0];
  if (auto e = check_rows(rows); e.failure()) return e;
  Int4Codes c{codes.typed_data(), scales.typed_data(), offsets.typed_data(), out, group, packed};
  nibbles(pool, x.typed_data(), rows, in, out, c, y->typed_data());
  return ffi::Error::Success();
}

ffi::Error NF4Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> codes,
                   ffi::Buffer<ffi::F32> scales, ffi::Buffer<ffi::F32> levels,
                   ffi::ResultBuffer<ffi::F32> y, int64_t group) {
  const int64_t rows = x.dimensions()[0], in = x.dimensions()[1];
  const int64_t out = y->dimensions()[1], packed = codes.dimensions()[0];
  if (auto e = check_rows(rows); e.failure()) return e;
  NF4Codes c{codes.typed_data(), scales.typed_data(), levels.typed_data(), out, group, packed,
             scales.dimensions()[0]};
  nibbles(pool, x.typed_data(), rows, in, out, c, y->typed_data());
  return ffi::Error::Success();
}

// exp(x) for sixteen lanes (Cephes' expf: x = n ln 2 + f with |f| <= ln 2 / 2, and a
// degree-7 polynomial for exp(f)), to about one ulp; lanes below the smallest normal
// result give 0.
inline v16 exp16(v16 x) {
  const v16i underflow = x < -87.33654f;  // the lanes whose exp(x) is 0
  x = x < -87.33654f ? v16{} - 87.33654f : x;
  x = x > 88.72283f ? v16{} + 88.72283f : x;
  v16 n = x * 1.44269504088896341f + 0.5f;
  v16 whole = __builtin_convertvector(__builtin_convertvector(n, v16i), v16);
  n = whole > n ? whole - 1.0f : whole;  // floor
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  const v16 z = x * x;
  v16 y = v16{} + 1.9875691500e-4f;
  y = y * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  const v16i bits = (__builtin_convertvector(n, v16i) + 127) << 23;
  y *= (v16)bits;
  return underflow ? v16{} : y;
}

// A decode step's attention on a float32 key/value cache as stored, `[batch, length,
// kv_heads, head_dim]` (XLA transposes every layer's whole cache to `[batch, kv_heads,
// length, head_dim]` first). One task per sequence, key/value head and span of slots,
// taking the head's group of query heads (for every token) one after another: the
// query's scores against each slot, their exponentials in float32 from the span's
// largest (sixteen at a time, `exp16`), and the values' sum weighted by them, four slots
// per pass over the sums, skipping four slots that all weigh exactly zero (masked: the
// cache's unwritten end). A task's keys and values stay in cache for the group's other
// queries. With fewer sequences and heads than twice the threads, the slots are split
// into spans whose sums are then combined, rescaled to the largest score of all. Masked
// slots score `masked`, as XLA's attention does. (Slot-major, one read of each key for
// every query at once, with a horizontal sum and a scalar exponential per score, this
// took twice as long: 61 against 27 us for 8 sequences of 80 slots.)
constexpr int64_t kMinSpan = 256;

void attend(ffi::ThreadPool& pool, const float* q, const bool* allowed, const float* k,
            const float* v, int64_t batch, int64_t tokens, int64_t heads, int64_t length,
            int64_t kv_heads, int64_t dim, float scale, float masked, float* out) {
  const int64_t group = heads / kv_heads, queries = group * tokens, pairs = batch * kv_heads;
  const int64_t wanted = (2 * pool.num_threads() + pairs - 1) / pairs;
  const int64_t spans = std::max<int64_t>(1, std::min(wanted, length / kMinSpan));
  const int64_t span = (length + spans - 1) / spans;
  // Per task and query: the span's largest score, its sum of exponentials, and the
  // values' sum weighted by them.
  const int64_t stride = dim + 2;
  std::vector<float> partial(spans > 1 ? pairs * spans * queries * stride : 0);
  // Query r is token r / group of query head h * group + r % group.
  auto at = [&](int64_t b, int64_t h, int64_t r) {
    return ((b * tokens + r / group) * heads + h * group + r % group) * dim;
  };
  parallel_for(pool, pairs * spans, [&](int64_t task) {
    const int64_t pair = task / spans, b = pair / kv_heads, h = pair % kv_heads;
    const int64_t s0 = (task % spans) * span, s1 = std::min(length, s0 + span), n = s1 - s0;
    // Slot s of this head's keys and values; the slots lie kv_heads vectors apart.
    const int64_t apart = kv_heads * dim;
    const float* keys = k + (b * length * kv_heads + h) * dim;
    const float* values = v + (b * length * kv_heads + h) * dim;
    const int64_t vectors = dim / kLanes;
    thread_local std::vector<float> scores, sums;  // each thread keeps its scratch
    scores.resize(n);
    sums.resize(dim);
    float* p = scores.data();
    for (int64_t r = 0; r < queries; ++r) {
      const int64_t token = r / group;
      const float* x = q + at(b, h, r);
      const bool* ok = allowed + (b * tokens + token) * length;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = s0; s < s1; ++s) {
        float score = masked;
        if (ok[s]) {
          const float* key = keys + s * apart;
          v16 acc = {};
          for (int64_t c = 0; c < vectors; ++c)
            acc += load<v16>(x + c * kLanes) * load<v16>(key + c * kLanes);
          score = lane_sum(acc);
          for (int64_t c = vectors * kLanes; c < dim; ++c) score += x[c] * key[c];
          score *= scale;
        }
        p[s - s0] = score;
        top = std::max(top, score);
      }
      v16 lanes = {};
      int64_t s = 0;
      for (; s + kLanes <= n; s += kLanes) {
        const v16 e = exp16(load<v16>(p + s) - top);
        store(p + s, e);
        lanes += e;
      }
      float total = lane_sum(lanes);
      for (; s < n; ++s) total += (p[s] = std::exp(p[s] - top));
      // The values weighted by the exponentials, four slots at a time.
      std::fill(sums.begin(), sums.end(), 0.0f);
      float* sum = sums.data();
      int64_t t = 0;
      for (; t + 4 <= n; t += 4) {
        const float* value = values + (s0 + t) * apart;
        const float p0 = p[t], p1 = p[t + 1], p2 = p[t + 2], p3 = p[t + 3];
        if (p0 == 0.0f && p1 == 0.0f && p2 == 0.0f && p3 == 0.0f) continue;  // masked
        if (t + 4 + kAhead <= n)
          for (int64_t c = 0; c < dim; c += kLanes)
            for (int64_t j = 0; j < 4; ++j) __builtin_prefetch(value + (kAhead + j) * apart + c);
        for (int64_t c = 0; c < vectors * kLanes; c += kLanes)
          store(sum + c, load_acc(sum + c) + p0 * load<v16>(value + c) +
                             p1 * load<v16>(value + apart + c) +
                             p2 * load<v16>(value + 2 * apart + c) +
                             p3 * load<v16>(value + 3 * apart + c));
        for (int64_t c = vectors * kLanes; c < dim; ++c)
          sum[c] += p0 * value[c] + p1 * value[apart + c] + p2 * value[2 * apart + c] +
                    p3 * value[3 * apart + c];
      }
      for (; t < n; ++t)
        for (int64_t c = 0; c < dim; ++c) sum[c] += p[t] * values[(s0 + t) * apart + c];
      if (spans == 1) {
        float* o = out + at(b, h, r);
        for (int64_t c = 0; c < dim; ++c) o[c] = sum[c] / total;
        continue;
      }
      float* saved = &partial[(task * queries + r) * stride];
      saved[0] = top;
      saved[1] = total;
      std::memcpy(saved + 2, sum, dim * sizeof(float));
    }
  });
  if (spans == 1) return;
  parallel_for(pool, pairs, [&](int64_t pair) {
    const int64_t b = pair / kv_heads, h = pair % kv_heads;
    for (int64_t r = 0; r < queries; ++r) {
      auto saved = [&](int64_t i) { return &partial[((pair * spans + i) * queries + r) * stride]; };
      float top = saved(0)[0];
      for (int64_t i = 1; i < spans; ++i) top = std::max(top, saved(i)[0]);
      float total = 0.0f;
      float* o = out + at(b, h, r);
      std::fill(o, o + dim, 0.0f);
      for (int64_t i = 0; i < spans; ++i) {
        const float weight = std::exp(saved(i)[0] - top);
        total += weight * saved(i)[1];
        for (int64_t c = 0; c < dim; ++c) o[c] += weight * saved(i)[2 + c];
      }
      for (int64_t c = 0; c < dim; ++c) o[c] /= total;
    }
  });
}

ffi::Error AttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                         ffi::Buffer<ffi::PRED> allowed, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out, float scale,
                         float masked) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const int64_t heads = qd[2], kv_heads = kd[2];
  if (heads % kv_heads)
    return ffi::Error::InvalidArgument("attention: heads not a multiple of kv_heads");
  attend(pool, q.typed_data(), allowed.typed_data(), k.typed_data(), v.typed_data(), qd[0],
         qd[1], heads, kd[1], kv_heads, qd[3], scale, masked, out->typed_data());
  return ffi::Error::Success();
}

// OpenBLAS's single-threaded `cblas_sgemm` (row-major), handed over by `eqdel_set_sgemm`.
using Sgemm = void (*)(int order, int transpose_a, int transpose_b, int m, int n, int k,
                       float alpha, const float* a, int lda, const float* b, int ldb,
                       float beta, float* c, int ldc);
Sgemm sgemm = nullptr;
constexpr int kRowMajor = 101, kNoTranspose = 111, kTranspose = 112;

// y[rows, out] = x @ w (x @ wᵀ for a weight stored [out, in]), or the same for each
// matrix of a batch (every operand with one leading dimension more). OpenBLAS's kernels
// reach more of this CPU's float32 peak than XLA's on a transformer's shapes. Each matrix
// of the output is cut into enough blocks to give every thread of XLA's pool work, along
// its rows or, when it has more columns, along its columns (whole vectors of 16), and
// each block is one single-threaded sgemm, so that no second thread pool competes with
// XLA's.
ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y, int64_t transposed_weight) {
  if (sgemm == nullptr) return ffi::Error::Internal("gemm: OpenBLAS is not loaded");
  const auto xs = x.dimensions(), ws = w.dimensions(), ys = y->dimensions();
  const size_t rank = ys.size();
  if (rank < 2 || rank > 3 || xs.size() != rank || ws.size() != rank)
    return ffi::Error::InvalidArgument("gemm: operands must be matrices or one batch of them");
  const int64_t batch = rank == 3 ? ys[0] : 1;
  const int64_t rows = xs[rank - 2], in = xs[rank - 1];
  const int64_t out = ys[rank - 1], ldw = ws[rank - 1];
  if (std::max({rows, in, out, ldw}) > INT_MAX)
    return ffi::Error::InvalidArgument("gemm: a dimension exceeds 32-bit BLAS indices");
  float* yd = y->typed_data();
  if (batch == 0 || rows == 0 || out == 0) return ffi::Error::Success();
  if (in == 0) {
    std::fill(yd, yd + batch * rows * out, 0.0f);
    return ffi::Error::Success();
  }
  const float* xd = x.typed_data();
  const float* wd = w.typed_data();
  const int tw = transposed_weight ? kTranspose : kNoTranspose;
  const bool by_rows = rows >= out;
  const int64_t extent = by_rows ? rows : out;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t per_matrix = std::min(extent, (threads + batch - 1) / batch);
  const int64_t block = (extent + per_matrix * kLanes - 1) / (per_matrix * kLanes) * kLanes;
  const int64_t blocks = (extent + block - 1) / block;
  parallel_for(pool, batch * blocks, [&](int64_t t) {
    const int64_t i = t / blocks, start = t % blocks * block;
    const int64_t size = std::min(extent, start + block) - start;
    const float* xi = xd + i * rows * in;
    const float* wi = wd + i * in * out;
    float* yi = yd + i * rows * out;
    if (by_rows) {
      sgemm(kRowMajor, kNoTranspose, tw, size, out, in, 1.0f, xi + start * in, in, wi, ldw,
            0.0f, yi + start * out, out);
    } else {
      const float* wt = wi + (transposed_weight ? start * ldw : start);
      sgemm(kRowMajor, kNoTranspose, tw, rows, size, in, 1.0f, xi, in, wt, ldw, 0.0f,
            yi + start, out);
    }
  });
  return ffi::Error::Success();
}

// Rows of a bfloat16 table, copied as stored: XLA's CPU backend computes a 16-bit gather
// in float32, and in a decode loop it converts the whole table once per call to gather a
// row per step. A negative id counts from the end, and an id outside the table gives a
// row of NaN, as `jnp.take` does.
ffi::Error GatherBF16Impl(ffi::Buffer<ffi::BF16> table, ffi::Buffer<ffi::S32> ids,
                          ffi::ResultBuffer<ffi::BF16> rows) {
  const int64_t vocab = table.dimensions()[0], dim = table.dimensions()[1];
  const auto* t = reinterpret_cast<const uint16_t*>(table.untyped_data());
  auto* out = reinterpret_cast<uint16_t*>(rows->untyped_data());
  const int32_t* id = ids.typed_data();
  for (int64_t i = 0; i < int64_t(ids.element_count()); ++i) {
    const int64_t row = id[i] < 0 ? id[i] + vocab : id[i];
    if (row >= 0 && row < vocab)
      std::memcpy(out + i * dim, t + row * dim, dim * sizeof(uint16_t));
    else
      std::fill(out + i * dim, out + (i + 1) * dim, uint16_t(0x7FC0));
  }
  return ffi::Error::Success();
}

}  // namespace

extern "C" void eqdel_set_sgemm(void* function) { sgemm = reinterpret_cast<Sgemm>(function); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelGemm, GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsF32, F32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsBF16, BF16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsInt8, Int8Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsInt8Transposed, Int8TransposedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsInt4, Int4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelFewRowsNF4, NF4Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("group"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelAttention, AttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("masked"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(EqdelGatherBF16, GatherBF16Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
