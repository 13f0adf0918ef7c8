// What the CPU kernels share: 16-lane vectors, and a parallel loop over XLA's
// intra-op thread pool in which the calling thread takes items too, so a call
// completes even when every pool thread is busy.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxdisagg_cpu {

// 16 fp32 lanes (one AVX-512 register; the compiler splits it where vectors are
// narrower). The kernels take dims in multiples of 16 (the Python side checks).
typedef float V16 __attribute__((vector_size(64)));

inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, V16 v) { std::memcpy(p, &v, sizeof v); }

// Runs fn(0..total-1) on the caller and up to pool.num_threads() - 1 pool tasks.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, Fn fn) {
  struct Shared {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, total, fn]() {
    int64_t mine = 0;
    for (int64_t i; (i = shared->next.fetch_add(1)) < total; ++mine) fn(i);
    if (mine > 0 && shared->done.fetch_add(mine) + mine == total) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->cv.notify_all();
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == total; });
}

}  // namespace jaxdisagg_cpu
