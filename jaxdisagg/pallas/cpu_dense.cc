// Products of a few rows by a weight, y [M, N] = x [M, D] @ w [D, N], for the decode
// step on XLA:CPU (M = the slots of a batch, 1-8).
//
// At a few rows a product is a stream of its weight from memory; XLA:CPU's library
// GEMMs reach 12-21 GB/s there on SmolLM2's shapes, against ~28 GB/s the memory
// gives two cores. Here each thread takes a contiguous range of w's rows and walks
// R of them side by side in 16-lane chunks (R sequential streams, which the
// hardware prefetchers follow), using each loaded chunk for all M rows of x; the
// threads' partial sums are added at the end. BENCHMARKS.md has the measurements.

#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxdisagg_cpu;

constexpr int64_t kRows = 8;  // R: rows of w walked together (8 measured best of 4, 8, 16)

// y[M, N] = x[M, d0:d1] @ w[d0:d1, N] (x rows of length dd).
template <int M>
void rows_product(const float* x, int64_t dd, const float* w, int64_t n, int64_t d0,
                  int64_t d1, float* y) {
  std::fill(y, y + M * n, 0.0f);
  int64_t d = d0;
  for (; d + kRows <= d1; d += kRows) {
    const float* w0 = w + d * n;
    float a[M][kRows];
    for (int m = 0; m < M; ++m)
      for (int i = 0; i < kRows; ++i) a[m][i] = x[m * dd + d + i];
    for (int64_t j = 0; j < n; j += 16) {
      V16 acc[M];
      for (int m = 0; m < M; ++m) acc[m] = load16(y + m * n + j);
      for (int i = 0; i < kRows; ++i) {
        const V16 v = load16(w0 + i * n + j);
        for (int m = 0; m < M; ++m) acc[m] += a[m][i] * v;
      }
      for (int m = 0; m < M; ++m) store16(y + m * n + j, acc[m]);
    }
  }
  for (; d < d1; ++d)
    for (int64_t j = 0; j < n; j += 16) {
      const V16 v = load16(w + d * n + j);
      for (int m = 0; m < M; ++m) store16(y + m * n + j, load16(y + m * n + j) + x[m * dd + d] * v);
    }
}

using RowsFn = decltype(&rows_product<1>);

RowsFn rows_for(int64_t m) {
  switch (m) {
    case 1: return rows_product<1>;
    case 2: return rows_product<2>;
    case 3: return rows_product<3>;
    case 4: return rows_product<4>;
    case 5: return rows_product<5>;
    case 6: return rows_product<6>;
    case 7: return rows_product<7>;
    case 8: return rows_product<8>;
    default: return nullptr;
  }
}

ffi::Error product(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                   ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("small-batch product: x [M, D] and w [D, N] expected");
  const int64_t m = xd[0], dd = xd[1], n = wd[1];
  const RowsFn rows = rows_for(m);
  if (rows == nullptr || n % 16 != 0 || dd <= 0)
    return ffi::Error::InvalidArgument("small-batch product: 1-8 rows, N a multiple of 16");
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  // One contiguous range of rows a thread (more parts only added partial sums: 2 and 4
  // a thread measured no better), in whole groups of kRows.
  const int64_t parts = std::clamp<int64_t>(useful_threads(pool), 1, std::max<int64_t>(1, dd / kRows));
  const int64_t per = ((dd + parts - 1) / parts + kRows - 1) / kRows * kRows;
  std::vector<float> part(parts * m * n);
  float* pp = part.data();
  parallel_for(pool, parts, [=](int64_t i) {
    const int64_t d0 = std::min(dd, i * per), d1 = std::min(dd, d0 + per);
    rows(xp, dd, wp, n, d0, d1, pp + i * m * n);
  });
  for (int64_t j = 0; j < m * n; j += 16) {
    V16 s = load16(pp + j);
    for (int64_t i = 1; i < parts; ++i) s += load16(pp + i * m * n + j);
    store16(yp + j, s);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdisaggSmallBatchProductF32, product,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [M, D]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [D, N]
                                  .Ret<ffi::Buffer<ffi::F32>>());
