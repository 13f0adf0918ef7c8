// Paged decode attention for XLA:CPU as one custom call per layer.
//
// XLA:CPU runs the jnp formulation (reference.py) as a dozen ops a layer, each with a
// fixed cost of 100-300 us on a small machine, so at SmolLM2's shapes attention took
// longer than the model's matmuls. Here one call walks each slot's pages in order, in
// chunks of a few hundred keys: each key of a chunk is scored against the G query heads
// of its KV head, one softmax update per chunk raises a running maximum and sum (an
// online softmax across chunks), and the values are accumulated, so K and V are each
// read once and nothing is gathered or materialised but the chunk's scores.
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

inline float hmax(V8 v) {
  const V4 d = __builtin_shufflevector(v, v, 0, 1, 2, 3);
  const V4 e = __builtin_shufflevector(v, v, 4, 5, 6, 7);
  const V4 f = d > e ? d : e;
  return std::max(std::max(f[0], f[1]), std::max(f[2], f[3]));
}

inline float hmax(V16 v) {
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  const V8 b = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  return hmax(a > b ? a : b);
}

// As jnp indexing reads a table entry: negative counts from the end, then clamped.
inline int64_t page_index(int64_t entry, int64_t num_blocks) {
  return std::clamp<int64_t>(entry < 0 ? entry + num_blocks : entry, 0, num_blocks - 1);
}

// The most query heads of one KV head worked on together, and the longest head_dim,
// in vectors (a block's state is held in arrays of these sizes).
constexpr int64_t kMaxRows = 8, kMaxHV = 256 / kLanes;

// How many pages ahead of the one worked on its K or V is fetched (`chunk_scores`).
constexpr int64_t kPagesAhead = 2;

// One key's row of one KV head (hv vectors at `at` in this page) into out; `ahead`:
// also fetch the same row of a page kPagesAhead on into L2 (the first block of a KV
// head does).
inline void load_row(const float* page, const float* next, int64_t at, int64_t hv,
                     bool ahead, VN* out) {
  if (ahead)
    for (int64_t i = 0; i < hv; i += 64 / sizeof(VN))  // a cache line at a time
      __builtin_prefetch(next + at + kLanes * i, 0, 2);
  for (int64_t i = 0; i < hv; ++i) out[i] = loadN(page + at + kLanes * i);
}

// Keys whose scores one chunk of a slot's pages holds for all N query rows (32 KB of
// scores, in L1 with the page being read): a slot's pages are walked in chunks of
// about this many keys.
constexpr int64_t kChunkScores = 8192;

// A chunk's pages [c0, c1), all heads, pass 1: the scores of its keys for each of the
// N query rows, scores[r * cap + key] (the chunk's keys in order, scaled).
//
// Each page once, in order; within a page, each KV head in turn with the block of
// query heads that share it (at most kMaxRows at a time), kLanes keys at a time: a key's
// K row is loaded once for every query head of the block, and the keys' products are
// summed by one transposed reduction. kHV, kG > 0 fix head_dim / kLanes and G at compile
// time (0: read from d) so the loops unroll and a block's queries stay in registers.
template <int64_t kHV, int64_t kG>
void chunk_scores(const float* q, const float* kp, const int32_t* table, int64_t len,
                  int64_t c0, int64_t c1, const Dims& d, float scale, int64_t cap,
                  float* scores) {
  constexpr int64_t kRows = kG ? std::min(kG, kMaxRows) : kMaxRows;
  constexpr int64_t kVecs = kHV ? kHV : kMaxHV;
  const int64_t hv = kHV ? kHV : d.h / kLanes, h = hv * kLanes, g_all = d.g;
  const int64_t stride = d.k * h;  // between a page's keys
  int64_t at = 0;  // the page's first key in the chunk
  for (int64_t p = c0; p < c1; ++p) {
    const int64_t keys = std::min<int64_t>(d.bs, len - p * d.bs);
    const float* k0 = kp + page_index(table[p], d.nb) * d.bs * stride;
    // The page two ahead's K is fetched into L2 row by row while this one is worked on:
    // the hardware prefetchers do not follow a table to the next page (without it, a
    // layer's attention on SmolLM2 at 8 slots out of cache took 1.5x the time). Into L1
    // it ran 0.92x slower: L1 keeps fewer misses in flight. Two pages ahead took
    // 0.80-0.94x the time of one page ahead at 8 slots out of cache on a Zen 3 host (4
    // alternated runs; 1 slot unchanged), four pages ahead 0.94-1.04x.
    const float* k1 = kp +
        page_index(table[std::min(p + kPagesAhead, c1 - 1)], d.nb) * d.bs * stride;
    for (int64_t k = 0; k < d.k; ++k)
      for (int64_t g0 = 0; g0 < g_all; g0 += kRows) {
        const int64_t rows = kG ? kRows : std::min(kRows, g_all - g0);
        const int64_t r0 = k * g_all + g0;  // the block's first query row
        VN qs[kRows][kVecs];
        for (int64_t g = 0; g < rows; ++g)
          for (int64_t i = 0; i < hv; ++i)
            qs[g][i] = loadN(q + (r0 + g) * h + kLanes * i) * scale;
        for (int64_t t0 = 0; t0 < keys; t0 += kLanes) {
          const int64_t nk = std::min<int64_t>(kLanes, keys - t0);
          VN part[kRows][kLanes];
          for (int64_t j = 0; j < kLanes; ++j) {
            if (j >= nk) {
              for (int64_t g = 0; g < rows; ++g) part[g][kBitrevN[j]] = VN{};
              continue;
            }
            VN kv[kVecs];
            load_row(k0, k1, (t0 + j) * stride + k * h, hv, g0 == 0, kv);
            for (int64_t g = 0; g < rows; ++g) {
              VN s = qs[g][0] * kv[0];
              for (int64_t i = 1; i < hv; ++i) s += qs[g][i] * kv[i];
              part[g][kBitrevN[j]] = s;
            }
          }
          // All the lanes are stored; lanes past nk are overwritten by the next keys'
          // (the rows have 16 floats of room at the end).
          for (int64_t g = 0; g < rows; ++g)
            storeN(scores + (r0 + g) * cap + at + t0, sum_each(part[g]));
        }
      }
    at += keys;
  }
}

// Pass 2: acc[r] += sum over the chunk's keys of weights[r * cap + key] * V[key], each
// page once in order, a block's accumulators in registers across the page.
template <int64_t kHV, int64_t kG>
void chunk_values(const float* vp, const int32_t* table, int64_t len, int64_t c0, int64_t c1,
                  const Dims& d, int64_t cap, const float* weights, float* acc) {
  constexpr int64_t kRows = kG ? std::min(kG, kMaxRows) : kMaxRows;
  constexpr int64_t kVecs = kHV ? kHV : kMaxHV;
  const int64_t hv = kHV ? kHV : d.h / kLanes, h = hv * kLanes, g_all = d.g;
  const int64_t stride = d.k * h;
  int64_t at = 0;
  for (int64_t p = c0; p < c1; ++p) {
    const int64_t keys = std::min<int64_t>(d.bs, len - p * d.bs);
    const float* v0 = vp + page_index(table[p], d.nb) * d.bs * stride;
    const float* v1 = vp +
        page_index(table[std::min(p + kPagesAhead, c1 - 1)], d.nb) * d.bs * stride;
    for (int64_t k = 0; k < d.k; ++k)
      for (int64_t g0 = 0; g0 < g_all; g0 += kRows) {
        const int64_t rows = kG ? kRows : std::min(kRows, g_all - g0);
        const int64_t r0 = k * g_all + g0;
        VN a[kRows][kVecs];
        for (int64_t g = 0; g < rows; ++g)
          for (int64_t i = 0; i < hv; ++i) a[g][i] = loadN(acc + (r0 + g) * h + kLanes * i);
        for (int64_t t = 0; t < keys; ++t) {
          VN vv[kVecs];
          load_row(v0, v1, t * stride + k * h, hv, g0 == 0, vv);
          for (int64_t g = 0; g < rows; ++g) {
            const float w = weights[(r0 + g) * cap + at + t];
            for (int64_t i = 0; i < hv; ++i) a[g][i] += w * vv[i];
          }
        }
        for (int64_t g = 0; g < rows; ++g)
          for (int64_t i = 0; i < hv; ++i) storeN(acc + (r0 + g) * h + kLanes * i, a[g][i]);
      }
    at += keys;
  }
}

// Scores [0, n) of a row -> their exponentials relative to the row's running maximum,
// which is raised to the chunk's: returns the factor for what came before.
inline float softmax_chunk(float* s, int64_t n, float& row_max, float& row_sum) {
  VN mv = VN{} + kNegInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const VN x = loadN(s + j);
    mv = mv > x ? mv : x;
  }
  float mx = hmax(mv);
  for (int64_t t = j; t < n; ++t) mx = std::max(mx, s[t]);
  mx = std::max(mx, row_max);
  const float keep = row_max == kNegInf ? 0.0f : fast_exp(row_max - mx);
  VN sum{};
  for (j = 0; j + kLanes <= n; j += kLanes) {
    const VN e = fast_exp_lanes(loadN(s + j) - mx);
    storeN(s + j, e);
    sum += e;
  }
  float total = hsum(sum);
  for (int64_t t = j; t < n; ++t) total += (s[t] = fast_exp(s[t] - mx));
  row_max = mx;
  row_sum = row_sum * keep + total;
  return keep;
}

// A slot's pages [p0, p1), all heads: unnormalised partials for each of the N query
// rows, acc [N, H] (sum of weight * value), row_max [N] and row_sum [N] (sum of weights).
//
// In chunks of pages: all of a chunk's scores first (K read once), one softmax update
// a row for the whole chunk, then the weighted values (V read once). An online softmax
// per 16 keys (a maximum, two exponentials and a rescale of the accumulators on a
// dependent chain every 16 keys) was 40% of the kernel's time.
template <int64_t kHV, int64_t kG>
void attend_pages(const float* q, const float* kp, const float* vp, const int32_t* table,
                  int64_t len, int64_t p0, int64_t p1, const Dims& d, float scale, float* acc,
                  float* row_max, float* row_sum) {
  const int64_t h = d.h;
  std::fill(acc, acc + d.n * h, 0.0f);
  std::fill(row_sum, row_sum + d.n, 0.0f);
  std::fill(row_max, row_max + d.n, kNegInf);
  const int64_t per_chunk = std::max<int64_t>(1, kChunkScores / d.n / d.bs);  // pages
  const int64_t cap = per_chunk * d.bs + 16;
  thread_local std::vector<float> buffer;
  buffer.resize(d.n * cap);
  float* scores = buffer.data();
  for (int64_t c0 = p0; c0 < p1; c0 += per_chunk) {
    const int64_t c1 = std::min(p1, c0 + per_chunk);
    const int64_t keys = std::min(len, c1 * d.bs) - c0 * d.bs;
    chunk_scores<kHV, kG>(q, kp, table, len, c0, c1, d, scale, cap, scores);
    for (int64_t r = 0; r < d.n; ++r) {
      const float keep = softmax_chunk(scores + r * cap, keys, row_max[r], row_sum[r]);
      if (keep != 1.0f)
        for (int64_t i = 0; i < h; ++i) acc[r * h + i] *= keep;
    }
    chunk_values<kHV, kG>(vp, table, len, c0, c1, d, cap, scores, acc);
  }
}

using AttendFn = decltype(&attend_pages<0, 0>);

// The compiled-in shapes (the head_dims and groupings of the Llama family), else the
// general walk.
template <int64_t kHV>
AttendFn attend_for_groups(int64_t g) {
  switch (g) {
    case 1: return attend_pages<kHV, 1>;
    case 2: return attend_pages<kHV, 2>;
    case 3: return attend_pages<kHV, 3>;
    case 4: return attend_pages<kHV, 4>;
    case 8: return attend_pages<kHV, 8>;
    default: return attend_pages<kHV, 0>;
  }
}

AttendFn attend_for(const Dims& d) {
  switch (d.h) {
    case 64: return attend_for_groups<64 / kLanes>(d.g);
    case 128: return attend_for_groups<128 / kLanes>(d.g);
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
      lens.dimensions()[0] != d.b || d.nb <= 0 || d.h % 16 != 0 || d.h > kLanes * kMaxHV)
    return ffi::Error::InvalidArgument("paged decode: inconsistent shapes, or head_dim "
                                       "not a multiple of 16 up to 256");
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
