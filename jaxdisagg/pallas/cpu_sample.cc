// What an all-greedy decode step needs of its logits [B, V]: each row's first argmax and
// its log-normaliser log(sum_j exp(x_j - x_max)), so the chosen token's log-probability
// is (x_token - x_max) - log_norm, as log_softmax gives it, and no [B, V] array is made.
//
// XLA:CPU runs jnp.argmax as a scalar reduce of (value, index) pairs and log_softmax as
// three passes with a [B, V] temporary: at SmolLM2's 8 x 49152 they took 0.9 and 1.1 ms
// of a 34 ms step. Here each row is two vector passes (a per-lane maximum with its
// index, then a sum of exponentials), rows spread over the threads.

#include <limits>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxdisagg_cpu;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// The first index of the row's maximum, jnp.argmax's answer: NaN counts as the largest
// and the first NaN wins; a row with no NaN takes the first of equal maxima.
int64_t first_argmax(const float* x, int64_t v) {
  const int64_t whole = v / 16 * 16;
  int64_t best = 0;
  if (whole > 0) {
    V16 bv = load16(x);
    I16 bi, lane;
    for (int k = 0; k < 16; ++k) bi[k] = lane[k] = k;
    I16 nan = bv != bv;
    for (int64_t j = 16; j < whole; j += 16) {
      const V16 c = load16(x + j);
      const I16 at = lane + static_cast<int32_t>(j);
      const I16 more = c > bv;  // strict: an equal later value keeps the earlier index
      bv = more ? c : bv;
      bi = more ? at : bi;
      nan |= c != c;
    }
    bool any_nan = false;
    for (int k = 0; k < 16; ++k) any_nan |= nan[k] != 0;
    if (any_nan) {
      for (int64_t j = 0; j < v; ++j)
        if (x[j] != x[j]) return j;
    }
    float m = bv[0];
    best = bi[0];
    for (int k = 1; k < 16; ++k)  // lanes hold disjoint index sets: the smallest index wins ties
      if (bv[k] > m || (bv[k] == m && bi[k] < best)) m = bv[k], best = bi[k];
  }
  for (int64_t j = whole; j < v; ++j) {
    if (x[j] != x[j]) return j;
    if (j == 0 || x[j] > x[best]) best = j;
  }
  return best;
}

// log(sum_j exp(x_j - m)) for the row's finite maximum m; NaN when m is not finite, where
// log_softmax's every entry is NaN too.
float log_norm(const float* x, int64_t v, float m) {
  if (!std::isfinite(m)) return kNaN;
  const int64_t whole = v / (2 * kLanes) * (2 * kLanes);
  const VN mv = VN{} + m;
  VN s0{}, s1{};  // two chains: each exponential is ~15 dependent operations
  for (int64_t j = 0; j < whole; j += 2 * kLanes) {
    s0 += fast_exp_lanes(loadN(x + j) - mv);
    s1 += fast_exp_lanes(loadN(x + j + kLanes) - mv);
  }
  float total = hsum(s0 + s1);
  for (int64_t j = whole; j < v; ++j) total += fast_exp(x[j] - m);
  return std::log(total);
}

ffi::Error argmax_log_norm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                           ffi::ResultBuffer<ffi::S32> index,
                           ffi::ResultBuffer<ffi::F32> norm) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] <= 0)
    return ffi::Error::InvalidArgument("argmax/log-norm: logits [B, V>0] expected");
  const int64_t b = d[0], v = d[1];
  const float* x = logits.typed_data();
  int32_t* out_i = index->typed_data();
  float* out_n = norm->typed_data();
  parallel_for(pool, b, [=](int64_t r) {
    const float* row = x + r * v;
    const int64_t i = first_argmax(row, v);
    out_i[r] = static_cast<int32_t>(i);
    out_n[r] = log_norm(row, v, row[i]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdisaggArgmaxLogNormF32, argmax_log_norm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // logits [B, V]
                                  .Ret<ffi::Buffer<ffi::S32>>()  // first argmax [B]
                                  .Ret<ffi::Buffer<ffi::F32>>());  // log-normaliser [B]
