// Products of a few rows by a weight for the decode step on XLA:CPU (M = the slots of
// a batch): y [M, N] = x [M, D] @ w [D, N] (the layers, 1-16 rows), and the tied LM
// head's y [M, V] = x [M, D] @ e [V, D]^T.
//
// At a few rows a product is a stream of its weight from memory; XLA:CPU's library
// GEMMs reach 12-21 GB/s there on SmolLM2's shapes, against ~28 GB/s the memory
// gives two cores. Here each thread takes a contiguous range of w's rows and walks
// R of them side by side in chunks of a vector register (R sequential streams, which the
// hardware prefetchers follow), using each loaded chunk for all M rows of x; the
// threads' partial sums are added at the end. BENCHMARKS.md has the measurements.

#include <utility>
#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxdisagg_cpu;

constexpr int64_t kRows = 8;  // R: rows of w walked together (8 measured best of 4, 8, 16)

// Up to kGroup rows of x pass over w at once: M x R broadcast values and M accumulators
// stay in registers. More rows go in groups of kGroup over column tiles of kCols, so
// the R x kCols tile one group loaded from memory is still in L1 for the next group
// and w is read from memory once (16 rows at once spilled: 1.18x XLA's time). Past 8
// rows the multiply-adds bound it, not memory (~110 GFLOP/s on two cores here): 30
// layers' SmolLM2 MLP products at 12-16 rows took 0.80-0.85x XLA's time, at 24 1.05x,
// so the kernel stops at 16 (`cpu.SMALL_PRODUCT_ROWS`). Tiles of 128-1024 measured alike.
constexpr int64_t kGroup = 8, kCols = 256;

// y[M, j0:j1] += x[M, d:d+R] @ w[d:d+R, j0:j1] (x rows of length dd, w rows of length n,
// y rows ys apart; w0 = w + d * n). `ahead`: also fetch the next R rows into L2 (the
// first group of x's rows does it, the others find the tile in cache).
template <int M>
void rows_tile(const float* x, int64_t dd, const float* w0, int64_t n, int64_t d,
               int64_t j0, int64_t j1, float* y, int64_t ys, bool ahead) {
  float a[M][kRows];
  for (int m = 0; m < M; ++m)
    for (int i = 0; i < kRows; ++i) a[m][i] = x[m * dd + d + i];
  for (int64_t j = j0; j < j1; j += kLanes) {
    VN acc[M];
    // With 16 registers and 4 rows of x, GCC hoists the 32 broadcasts out of this loop,
    // spills them, and reloads each w vector once per row of x. Hiding where `a` is
    // (an empty asm) makes it broadcast from `a` at each use instead: 0.84-0.85x the
    // time at 4 rows on a Zen 3 host (30 SmolLM2 layers, one thread, alternated in one
    // process); at 1, 2, 3 and 8 rows the same barrier measured 1.00-1.04x.
    const float* ap = &a[0][0];
    if constexpr (kRegs == 16 && M == 4) asm("" : "+r"(ap));
    for (int m = 0; m < M; ++m) acc[m] = loadN(y + m * ys + j);
    for (int i = 0; i < kRows; ++i) {
      const VN v = loadN(w0 + i * n + j);
      // The next group's rows, into L2: 0.80-0.94x the time at 1-8 rows of x.
      if (ahead) __builtin_prefetch(w0 + (kRows + i) * n + j, 0, 2);
      for (int m = 0; m < M; ++m) acc[m] += ap[m * kRows + i] * v;
    }
    for (int m = 0; m < M; ++m) storeN(y + m * ys + j, acc[m]);
  }
}

using TileFn = decltype(&rows_tile<1>);

// make(k) for k == m: a kernel's variant compiled for exactly m rows (1 <= m <= kGroup).
template <typename Fn, typename Make, int... Ms>
Fn pick(int64_t m, Make make, std::integer_sequence<int, Ms...>) {
  Fn fn = nullptr;
  ((fn = (m == Ms + 1 ? make(std::integral_constant<int, Ms + 1>{}) : fn)), ...);
  return fn;
}

// The variants for m rows of x taken kGroup at a time, picked once a call rather than
// per tile: every group but the last has kGroup rows, the last the rest.
template <typename Fn>
struct Groups {
  Fn full, last;
  Fn at(int64_t m0, int64_t m) const { return m0 + kGroup < m ? full : last; }
};

template <typename Fn, typename Make>
Groups<Fn> groups_for(int64_t m, Make make) {
  const auto seq = std::make_integer_sequence<int, kGroup>{};
  return {pick<Fn>(kGroup, make, seq), pick<Fn>((m - 1) % kGroup + 1, make, seq)};
}

// y[m, N] = x[m, d0:d1] @ w[d0:d1, N], any m >= 1; y's rows ys apart.
void rows_product(const float* x, int64_t m, int64_t dd, const float* w, int64_t n,
                  int64_t d0, int64_t d1, float* y, int64_t ys) {
  std::fill(y, y + m * ys, 0.0f);
  const int64_t cols = m <= kGroup ? n : kCols;  // one group: whole rows, as before
  const auto fns = groups_for<TileFn>(m, [](auto k) -> TileFn {
    return rows_tile<decltype(k)::value>;
  });
  // w's rows 4 KB-aliased (see `product`): on a Zen 3 host (AVX2) the 8 rows walked fill
  // their L1 set's 8 ways and prefetching the next 8 evicted them (1.3-1.5x the time with
  // it). A Zen 4 host gains from the prefetch there as elsewhere (AVX-512 build: 0.82-0.97x
  // the time at 1-8 rows; its AVX2 build mixed, 0.85-1.05x), so only AVX2 builds skip it.
  const bool ahead = kLanes == 16 || (n * 4) % 4096 != 0;
  int64_t d = d0;
  for (; d + kRows <= d1; d += kRows)
    for (int64_t j0 = 0; j0 < n; j0 += cols)
      for (int64_t m0 = 0; m0 < m; m0 += kGroup)
        fns.at(m0, m)(x + m0 * dd, dd, w + d * n, n, d, j0, std::min(n, j0 + cols),
                      y + m0 * ys, ys, ahead && m0 == 0);
  for (; d < d1; ++d)
    for (int64_t j = 0; j < n; j += kLanes) {
      const VN v = loadN(w + d * n + j);
      for (int64_t r = 0; r < m; ++r)
        storeN(y + r * ys + j, loadN(y + r * ys + j) + x[r * dd + d] * v);
    }
}

ffi::Error product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("small-batch product: x [M, D] and w [D, N] expected");
  const int64_t m = xd[0], dd = xd[1], n = wd[1];
  if (m <= 0 || n % 16 != 0 || dd <= 0)
    return ffi::Error::InvalidArgument(
        "small-batch product: rows, D and N a multiple of 16 expected");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // One contiguous range of rows a thread (more parts only added partial sums: 2 and 4
  // a thread measured no better), in whole groups of kRows.
  const int64_t parts = std::clamp<int64_t>(useful_threads(pool), 1, std::max<int64_t>(1, dd / kRows));
  const int64_t per = ((dd + parts - 1) / parts + kRows - 1) / kRows * kRows;
  // The partial sums' rows are padded by a cache line: w's rows, when 4 KB apart or a
  // multiple of it (SmolLM2's gate/up, N = 3072), map to one set of L1, and y's rows at
  // the same stride joined them there (that product ran at a quarter of the others'
  // rate on a Zen 3 host, in cache or not).
  const int64_t ys = n + 16, size = m * ys;
  std::vector<float> part(parts * size);
  float* pp = part.data();
  parallel_for(pool, parts, [=](int64_t i) {
    const int64_t d0 = std::min(dd, i * per), d1 = std::min(dd, d0 + per);
    rows_product(xp, m, dd, wp, n, d0, d1, pp + i * size, ys);
  });
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; j += kLanes) {
      VN s = loadN(pp + r * ys + j);
      for (int64_t i = 1; i < parts; ++i) s += loadN(pp + i * size + r * ys + j);
      storeN(yp + r * n + j, s);
    }
  return ffi::Error::Success();
}

// Rows of e the head kernel prefetches (into L2) ahead of the ones it reads. At 4+ rows
// of x the multiply-adds take long enough that the hardware prefetcher falls behind:
// one thread read SmolLM2's head at 6.2 GB/s without this and 9.6 GB/s with it at 8
// rows (fetched into L1; 2-8 rows ahead measured alike). Into L2, two threads read it
// at 25-27 GB/s at 1-8 rows, this machine's streaming rate.
constexpr int64_t kAhead = 4;

// The tied head: y[m, v] = x[m] . e[v] for v in [v0, v1), kR rows of e side by side
// (each row of e is one sequential stream of D floats), every loaded chunk used for
// all M rows of x. XLA:CPU hands this product to a GEMM that read SmolLM2's 113 MB
// head at 8-13 GB/s at 2-8 rows (BENCHMARKS.md).
template <int M, int kR>
void head_rows(const float* x, int64_t dd, const float* e, int64_t nv, int64_t v0,
               int64_t v1, float* y) {
  int64_t v = v0;
  for (; v + kR <= v1; v += kR) {
    const float* e0 = e + v * dd;
    VN acc[M][kR] = {};
    for (int64_t j = 0; j < dd; j += kLanes) {
      VN xs[M];
      for (int m = 0; m < M; ++m) xs[m] = loadN(x + m * dd + j);
      for (int r = 0; r < kR; ++r) {
        const VN c = loadN(e0 + r * dd + j);
        __builtin_prefetch(e0 + (r + kAhead) * dd + j, 0, 2);  // a hint: past the end is harmless
        for (int m = 0; m < M; ++m) acc[m][r] += xs[m] * c;
      }
    }
    if constexpr (M * kR == kLanes) {  // all the sums by one transposed reduction
      VN in[kLanes];
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < kR; ++r) in[kBitrevN[m * kR + r]] = acc[m][r];
      const VN s = sum_each(in);
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < kR; ++r) y[m * nv + v + r] = s[m * kR + r];
    } else {
      for (int m = 0; m < M; ++m)
        for (int r = 0; r < kR; ++r) y[m * nv + v + r] = hsum(acc[m][r]);
    }
  }
  if (v < v1) head_rows<M, 1>(x, dd, e, nv, v, v1, y);
}

// Rows of e walked together: enough independent sums to hide the multiply-add's
// latency at few rows of x, few enough that M x kR accumulators, M chunks of x and one
// of e stay in registers (32 with AVX-512, 16 with AVX2).
template <int M>
void head_for_rows(const float* x, int64_t dd, const float* e, int64_t nv, int64_t v0,
                   int64_t v1, float* y) {
  constexpr int kPairs = kRegs >= 32 ? 8 : 4;  // the most rows of x that take 2 rows of e
  head_rows<M, (M <= 2 ? 4 : M <= kPairs ? 2 : 1)>(x, dd, e, nv, v0, v1, y);
}

using HeadFn = decltype(&head_for_rows<1>);

// Up to kGroup rows of x go through the kernel at once (more accumulators than
// registers spilled: 16 rows at once ran 1.1-1.2x XLA's time). More rows take e in
// tiles of kHeadTile rows that stay in cache while every group of x's rows passes
// over them, so e is still read from memory once.
constexpr int64_t kHeadTile = 64;

void head_range(const float* x, int64_t m, int64_t dd, const float* e, int64_t nv,
                int64_t v0, int64_t v1, float* y) {
  const auto fns = groups_for<HeadFn>(m, [](auto k) -> HeadFn {
    return head_for_rows<decltype(k)::value>;
  });
  for (int64_t t = v0; t < v1; t += kHeadTile)
    for (int64_t m0 = 0; m0 < m; m0 += kGroup)
      fns.at(m0, m)(x + m0 * dd, dd, e, nv, t, std::min(t + kHeadTile, v1), y + m0 * nv);
}

ffi::Error head(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> e,
                ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), ed = e.dimensions();
  if (xd.size() != 2 || ed.size() != 2 || xd[1] != ed[1])
    return ffi::Error::InvalidArgument("tied head: x [M, D] and e [V, D] expected");
  const int64_t m = xd[0], dd = xd[1], nv = ed[0];
  if (m <= 0 || dd % 16 != 0 || nv <= 0)
    return ffi::Error::InvalidArgument("tied head: rows, D a multiple of 16 and V expected");
  const float* xp = x.typed_data();
  const float* ep = e.typed_data();
  float* yp = y->typed_data();
  // Each thread a contiguous range of e's rows, writing its own columns of y.
  const int64_t parts = std::clamp<int64_t>(useful_threads(pool), 1, nv);
  const int64_t per = (nv + parts - 1) / parts;
  parallel_for(pool, parts, [=](int64_t i) {
    const int64_t v0 = std::min(nv, i * per), v1 = std::min(nv, v0 + per);
    head_range(xp, m, dd, ep, nv, v0, v1, yp);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdisaggTiedHeadF32, head,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // e [V, D]
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdisaggSmallBatchProductF32, product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [D, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The helpers' spin after a call, in us (`Helpers::spin_ns`): benchmarks compare
// spinning and parking in one process.
extern "C" void JaxdisaggSetHelperSpinUs(int64_t us) {
  jaxdisagg_cpu::Helpers::get().spin_ns.store(std::max<int64_t>(0, us) * 1000);
}
