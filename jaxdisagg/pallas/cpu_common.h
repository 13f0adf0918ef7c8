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

#include <sched.h>

#include "xla/ffi/api/ffi.h"

namespace jaxdisagg_cpu {

// How many threads a call should use: XLA's intra-op pool, but no more than the cores
// this process may run on. The pool is as large as the host platform's device count
// (8 virtual devices on 2 cores: 8 threads), and splitting a call 8 ways on 2 cores
// only adds waiting (SmolLM2's one-slot step: 29.7 ms against 22.2 with 1-2 devices).
// The affinity is read once: `launch` pins a pool before it starts.
inline int64_t useful_threads(xla::ffi::ThreadPool& pool) {
  static const int64_t cores = [] {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 ? int64_t{CPU_COUNT(&set)} : int64_t{0};
  }();
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  return cores > 0 ? std::min(threads, cores) : threads;
}

// 16 fp32 lanes (one AVX-512 register; the compiler splits it where vectors are
// narrower). The kernels take dims in multiples of 16 (the Python side checks).
typedef float V16 __attribute__((vector_size(64)));

// Unaligned loads and stores of a vector type V (memcpy: no aliasing or alignment
// assumptions, and compilers emit one vector move).
template <typename V>
inline V load_vec(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

template <typename V>
inline void store_vec(float* p, V v) { std::memcpy(p, &v, sizeof v); }

inline V16 load16(const float* p) { return load_vec<V16>(p); }
inline void store16(float* p, V16 v) { store_vec(p, v); }

typedef float V8 __attribute__((vector_size(32)));
typedef float V4 __attribute__((vector_size(16)));

// The sum of a vector's 16 lanes.
inline float hsum(V16 v) {
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const V4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Runs fn(0..total-1) on the caller and up to useful_threads(pool) - 1 pool tasks.
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
  const int64_t helpers = std::min<int64_t>(useful_threads(pool), total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == total; });
}

}  // namespace jaxdisagg_cpu
