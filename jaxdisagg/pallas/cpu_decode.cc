// Paged decode attention for XLA:CPU as one custom call per layer.
//
// XLA:CPU runs the jnp formulation (reference.py) as a dozen ops a layer, each with a
// fixed cost of 100-300 us on a small machine, so at SmolLM2's shapes attention took
// longer than the model's matmuls. Here one call walks each slot's pages once, in
// order: each key of a page is scored against the G query heads of its KV head, an
// online softmax keeps a running maximum and sum, and the values accumulate in the
// same pass, so K and V are each read once and nothing is gathered or materialised.
//
// Layouts (as reference.py): q [B, N, H] with N = K*G (query head n = k*G + g);
// pages [NB, bs, K, H]; tables [B, P]; lens [B] keys per slot (0: empty slot, zeros).
// Table entries are read as jnp indexing reads them (negative from the end, clamped).
//
// Work items are (slot, range of its pages), shared out over XLA's intra-op thread pool
// (a lone slot is split too, as in flash-decoding, and the partials merged); the
// calling thread takes items as well, so the call completes even when the pool is busy.

#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxdisagg_cpu;

// A masked key's score, and the running maximum of a row (or split) with no keys yet.
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Dims {
  int64_t b, n, h, nb, bs, k, g, p;
};

// exp(x) / 2^n for n = round(x / ln 2): Cody-Waite range reduction and a degree-6
// polynomial, on one float or on 8 lanes (the constants broadcast).
template <typename T>
inline T exp_reduced(T x, T n) {
  const T r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// exp for the softmax, in a form the compiler vectorises (std::exp is a scalar libm call,
// and at G*bs calls a page it cost as much as all the multiply-adds): within 1 ulp of
// exp over [-87, 0], the range used here. Arguments below -87 count as -87 (a weight of
// 1.6e-38, i.e. none).
inline float fast_exp(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_reduced(x, n) * scale;
}

typedef int32_t I8 __attribute__((vector_size(32)));

inline V8 load8(const float* p) { return load_vec<V8>(p); }
inline void store8(float* p, V8 v) { store_vec(p, v); }

inline V8 splat8(float x) { return V8{x, x, x, x, x, x, x, x}; }

// fast_exp on 8 lanes, for a row's scores at once, rounding by adding and subtracting
// 1.5 * 2^23 (to nearest, as nearbyint).
inline V8 fast_exp8(V8 x) {
  const V8 lo = splat8(-87.0f), magic = splat8(12582912.0f);
  x = x < lo ? lo : x;
  const V8 n = (x * 1.44269504088896341f + magic) - magic;
  const I8 bits = (__builtin_convertvector(n, I8) + 127) << 23;
  V8 scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_reduced(x, n) * scale;
}

inline float hmax8(V8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

inline float hsum8(V8 v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

// As jnp indexing reads a table entry: negative counts from the end, then clamped.
inline int64_t page_index(int64_t entry, int64_t num_blocks) {
  return std::clamp<int64_t>(entry < 0 ? entry + num_blocks : entry, 0, num_blocks - 1);
}

// A slot's pages [p0, p1), all heads: unnormalised partials for each of the N query
// rows, acc [N, H] (sum of weight * value), row_max [N] and row_sum [N] (sum of weights).
// Each page is walked once, key by key, every KV head in turn, so the reads are
// sequential and each byte of K and V is read once.
// kH, kG > 0 fix head_dim and the query heads per KV head at compile time (0: read
// from d): the loops over them unroll, 0.86-0.91x the time on an AVX2 host.
template <int64_t kH, int64_t kG>
void attend_pages(const float* q, const float* kp, const float* vp, const int32_t* table,
                  int64_t len, int64_t p0, int64_t p1, const Dims& d, float scale, float* acc,
                  float* row_max, float* row_sum) {
  const int64_t g_rows = kG ? kG : d.g, h = kH ? kH : d.h, bs = d.bs, kv_heads = d.k;
  const int64_t n = kv_heads * g_rows;
  const int64_t padded = (bs + 7) / 8 * 8;  // a row's scores: whole 8-lane vectors
  std::fill(acc, acc + n * h, 0.0f);
  std::fill(row_sum, row_sum + n, 0.0f);
  std::fill(row_max, row_max + n, kNegInf);
  std::vector<float> score(n * padded), qs(n * h);
  for (int64_t i = 0; i < n * h; ++i) qs[i] = q[i] * scale;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t page = page_index(table[p], d.nb);
    const int64_t keys = std::min<int64_t>(bs, len - p * bs);
    const float* k0 = kp + page * bs * kv_heads * h;  // key t, head k at (t * K + k) * H
    const float* v0 = vp + page * bs * kv_heads * h;
    // The next page's K and V are fetched into L2 line by line while this one is
    // worked on: the hardware prefetchers do not follow a table to the next page. On
    // SmolLM2's shapes, 30 layers' pages out of cache, this took a layer's attention
    // from 560-590 to 350 us at 8 slots and from 83 to 73 us at one. Fetched into L1
    // instead, it took 0.92x the time without: L1 keeps fewer misses in flight.
    const int64_t next = page_index(table[std::min(p + 1, p1 - 1)], d.nb);
    const float* k1 = kp + next * bs * kv_heads * h;
    const float* v1 = vp + next * bs * kv_heads * h;
    for (int64_t t = 0; t < keys; ++t)
      for (int64_t k = 0; k < kv_heads; ++k) {
        const float* kr = k0 + (t * kv_heads + k) * h;
        for (int64_t i = 0; i < h; i += 16)
          __builtin_prefetch(k1 + (t * kv_heads + k) * h + i, 0, 2);
        for (int64_t g = 0; g < g_rows; ++g) {
          const float* qr = qs.data() + (k * g_rows + g) * h;
          V16 sum = load16(qr) * load16(kr);
          for (int64_t i = 16; i < h; i += 16) sum += load16(qr + i) * load16(kr + i);
          score[(k * g_rows + g) * padded + t] = hsum(sum);
        }
      }
    for (int64_t r = 0; r < n; ++r) {
      // Online softmax on 8 lanes (written key by key, it took a third of the kernel's
      // time on an AVX2 host): rescale what came before to the new running maximum.
      // Keys past the page's last are masked to weight 0.
      float* s = score.data() + r * padded;
      std::fill(s + keys, s + padded, kNegInf);
      V8 mv = load8(s);
      for (int64_t t = 8; t < padded; t += 8) {
        const V8 x = load8(s + t);
        mv = x > mv ? x : mv;
      }
      const float m = p == p0 ? hmax8(mv) : std::max(hmax8(mv), row_max[r]);
      const float keep = p == p0 ? 0.0f : fast_exp(row_max[r] - m);
      V8 sum = splat8(0.0f);
      for (int64_t t = 0; t < padded; t += 8) {
        const V8 x = load8(s + t);
        const V8 e = x == kNegInf ? splat8(0.0f) : fast_exp8(x - m);
        store8(s + t, e);
        sum += e;
      }
      row_max[r] = m;
      row_sum[r] = row_sum[r] * keep + hsum8(sum);
      if (keep != 1.0f) {
        float* a = acc + r * h;
        for (int64_t i = 0; i < h; ++i) a[i] *= keep;
      }
    }
    for (int64_t t = 0; t < keys; ++t)
      for (int64_t k = 0; k < kv_heads; ++k) {
        const float* vr = v0 + (t * kv_heads + k) * h;
        for (int64_t i = 0; i < h; i += 16)
          __builtin_prefetch(v1 + (t * kv_heads + k) * h + i, 0, 2);
        for (int64_t i = 0; i < h; i += 16) {
          const V16 v = load16(vr + i);
          for (int64_t g = 0; g < g_rows; ++g) {
            float* a = acc + (k * g_rows + g) * h + i;
            store16(a, load16(a) + score[(k * g_rows + g) * padded + t] * v);
          }
        }
      }
  }
}

using AttendFn = decltype(&attend_pages<0, 0>);

// The compiled-in shapes (the head_dims and groupings of the Llama family), else the
// general walk.
template <int64_t kH>
AttendFn attend_for_groups(int64_t g) {
  switch (g) {
    case 1: return attend_pages<kH, 1>;
    case 2: return attend_pages<kH, 2>;
    case 3: return attend_pages<kH, 3>;
    case 4: return attend_pages<kH, 4>;
    case 8: return attend_pages<kH, 8>;
    default: return attend_pages<kH, 0>;
  }
}

AttendFn attend_for(const Dims& d) {
  switch (d.h) {
    case 64: return attend_for_groups<64>(d.g);
    case 128: return attend_for_groups<128>(d.g);
    default: return attend_for_groups<0>(d.g);
  }
}

ffi::Error decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pages,
                  ffi::Buffer<ffi::F32> v_pages, ffi::Buffer<ffi::S32> tables,
                  ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), pd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || pd.size() != 4 || td.size() != 2 || lens.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged decode: q [B,N,H], pages [NB,bs,K,H], "
                                       "tables [B,P], lens [B] expected");
  Dims d{qd[0], qd[1], qd[2], pd[0], pd[1], pd[2], 0, td[1]};
  if (pd[3] != d.h || d.k <= 0 || d.n % d.k != 0 || td[0] != d.b ||
      lens.dimensions()[0] != d.b || d.nb <= 0 || d.h % 16 != 0)
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes, or head_dim "
                                       "not a multiple of 16");
  d.g = d.n / d.k;
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = tables.typed_data();
  const int32_t* lp = lens.typed_data();
  float* op = out->typed_data();
  // Items are (slot, split of its pages): a slot's keys split so that even one slot
  // keeps every thread busy (flash-decoding); partials are merged below.
  const int64_t threads = useful_threads(pool);
  const int64_t splits = std::clamp<int64_t>((2 * threads + d.b - 1) / d.b, 1, d.p);
  const int64_t per_split = (d.p + splits - 1) / splits;
  const int64_t row = d.n * (d.h + 2);  // one partial: acc [N, H], max [N], sum [N]
  std::vector<float> part(d.b * splits * row);
  float* pp = part.data();
  const AttendFn attend = attend_for(d);
  parallel_for(pool, d.b * splits, [=](int64_t item) {
    const int64_t b = item / splits, split = item % splits;
    const int64_t used = std::min<int64_t>((std::max<int32_t>(lp[b], 0) + d.bs - 1) / d.bs, d.p);
    const int64_t p0 = std::min(split * per_split, used), p1 = std::min(p0 + per_split, used);
    float* acc = pp + item * row;
    attend(qp + b * d.n * d.h, kp, vp, tp + b * d.p, lp[b], p0, p1, d, scale, acc,
           acc + d.n * d.h, acc + d.n * (d.h + 1));
  });
  for (int64_t b = 0; b < d.b; ++b)
    for (int64_t r = 0; r < d.n; ++r) {
      float m = kNegInf;
      for (int64_t sp = 0; sp < splits; ++sp)
        m = std::max(m, pp[(b * splits + sp) * row + d.n * d.h + r]);
      float* o = op + (b * d.n + r) * d.h;
      std::fill(o, o + d.h, 0.0f);
      if (m == kNegInf) continue;  // an empty slot: zeros
      float total = 0.0f;
      for (int64_t sp = 0; sp < splits; ++sp) {
        const float* acc = pp + (b * splits + sp) * row;
        const float mx = acc[d.n * d.h + r];
        if (mx == kNegInf) continue;
        const float w = fast_exp(mx - m);
        total += w * acc[d.n * (d.h + 1) + r];
        for (int64_t i = 0; i < d.h; ++i) o[i] += w * acc[r * d.h + i];
      }
      const float inv = 1.0f / total;
      for (int64_t i = 0; i < d.h; ++i) o[i] *= inv;
    }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdisaggPagedDecodeF32, decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pages
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pages
                                  .Arg<ffi::Buffer<ffi::S32>>()  // block tables
                                  .Arg<ffi::Buffer<ffi::S32>>()  // lengths
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));
