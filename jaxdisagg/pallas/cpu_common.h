// What the CPU kernels share: 16-lane vectors, and a parallel loop in which the
// calling thread takes items too, so a call completes even when no other thread is
// free: on the kernels' own spinning helpers, or XLA's intra-op pool when they are busy.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

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

// Sixteen vectors -> one vector of their sums, lane j = the sum of v[j] when the
// inputs come in bit-reversed order (v[bitrev(j)] holds key j's products): four levels of
// pairwise shuffles and adds, 15 of each for 16 sums, where a horizontal sum per key
// costs 4 shuffles and adds on a dependent chain (it was half the kernel's time).
inline V16 sum_each_of_16(const V16* v) {
  V16 w[8], u[4], z[2];
  for (int j = 0; j < 8; ++j)
    w[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                   18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                   25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    u[j] = __builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                   10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(w[2 * j], w[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    z[j] = __builtin_shufflevector(u[2 * j], u[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                   24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(u[2 * j], u[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}

constexpr int kBitrev16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline float hsum(V8 v) {
  const V4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// As sum_each_of_16, for eight vectors of eight lanes (inputs in kBitrev8 order).
inline V8 sum_each_of_8(const V8* v) {
  V8 w[4], u[2];
  for (int j = 0; j < 4; ++j)
    w[j] = __builtin_shufflevector(v[2 * j], v[2 * j + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * j], v[2 * j + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int j = 0; j < 2; ++j)
    u[j] = __builtin_shufflevector(w[2 * j], w[2 * j + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
           __builtin_shufflevector(w[2 * j], w[2 * j + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(u[0], u[1], 0, 8, 2, 10, 4, 12, 6, 14) +
         __builtin_shufflevector(u[0], u[1], 1, 9, 3, 11, 5, 13, 7, 15);
}

constexpr int kBitrev8[8] = {0, 4, 2, 6, 1, 5, 3, 7};

// The kernels' working vector: one register of the target, 16 lanes with AVX-512 and 8
// without (AVX2). Arrays of vectors wider than the registers, which the register-blocked
// kernels hold, GCC keeps in memory and moves lane pairs through general registers: on
// AVX2 (a Zen 3 host) the 8-row product ran at 19 GFLOP/s a core and the 8-row tied
// head at 6 (BENCHMARKS.md). kRegs: how many the register file holds.
#if defined(__AVX512F__)
typedef V16 VN;
constexpr int kRegs = 32;
#else
typedef V8 VN;
constexpr int kRegs = 16;
#endif
constexpr int kLanes = sizeof(VN) / sizeof(float);
inline VN loadN(const float* p) { return load_vec<VN>(p); }
inline void storeN(float* p, VN v) { store_vec(p, v); }

// One vector of the sums of kLanes vectors, lane j the sum of in[kBitrevN[j]].
inline V16 sum_each(const V16* in) { return sum_each_of_16(in); }
inline V8 sum_each(const V8* in) { return sum_each_of_8(in); }
constexpr const int* kBitrevN = kLanes == 16 ? kBitrev16 : kBitrev8;

// exp(x) / 2^n for n = round(x / ln 2): Cody-Waite range reduction and a degree-6
// polynomial, on one float or on a vector's lanes (the constants broadcast).
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

typedef int32_t I16 __attribute__((vector_size(64)));

// fast_exp on a vector's lanes, for a block of scores at once, rounding by
// adding and subtracting 1.5 * 2^23 (to nearest, as nearbyint).
template <typename V>
inline V fast_exp_lanes(V x) {
  using I = decltype(x < x);  // the int32 vector of the same width
  const V lo = V{} - 87.0f, magic = V{} + 12582912.0f;
  x = x < lo ? lo : x;
  const V n = (x * 1.44269504088896341f + magic) - magic;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  V scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return exp_reduced(x, n) * scale;
}

// Helper threads of the kernels' own that spin between calls instead of sleeping.
//
// A decode step makes ~150 custom calls of 30-600 us, with XLA's small fusions between
// them. Through XLA's intra-op pool each call wakes a parked thread, and the wake-up
// (an IPI on a VM) costs ~20 us a call: a 1.3 MB product on two threads took 64 us
// where one thread alone takes 74. These threads spin for kSpinNs after each call, so
// within a step they are awake when the next call comes, then park (`spin_ns`). One call at a time
// uses them; a call that finds them busy uses XLA's pool. The caller takes items too,
// so a call completes even if no helper ever runs.
class Helpers {
 public:
  // The process's helpers, made on first use and again in a forked child, where
  // threads do not survive (an atfork handler forgets the parent's: no getpid() on
  // every call, which is a syscall and a step makes ~150 calls).
  static Helpers& get() {
    Helpers* h = current().load(std::memory_order_acquire);
    if (h != nullptr) return *h;
    static std::mutex make;
    std::lock_guard<std::mutex> lock(make);
    h = current().load(std::memory_order_acquire);
    if (h == nullptr) {
      static const int registered = pthread_atfork(nullptr, nullptr, [] {
        current().store(nullptr);  // the parent's object stays, unused: it may be mid-call
      });
      (void)registered;
      h = new Helpers();  // never freed: its detached threads use it to the end
      current().store(h, std::memory_order_release);
    }
    return *h;
  }

  // Runs fn(0..total-1) on the caller and up to `threads` - 1 helpers; false (nothing
  // run) when another call holds them (or total does not fit the job word).
  template <typename Fn>
  bool run(int64_t total, int64_t threads, Fn& fn) {
    if (total > static_cast<int64_t>(kField)) return false;
    std::unique_lock<std::mutex> hold(busy_, std::try_to_lock);
    if (!hold.owns_lock()) return false;
    grow(std::min<int64_t>(threads, total) - 1);
    call_ = [](void* f, int64_t i) { (*static_cast<Fn*>(f))(i); };
    ctx_ = &fn;
    done_.store(0);
    const uint64_t gen = ((word_.load() >> 40) + 1) & kGeneration;  // wraps at 2^24
    word_.store(gen << 40 | static_cast<uint64_t>(total) << 20);  // publishes the job
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lock(mu_);
      cv_.notify_all();
    }
    work(gen);
    // A helper may hold the last items; spin a little for them, then sleep: a helper
    // descheduled by other work on the cores (another pool's program) would otherwise
    // keep this thread spinning on a core that helper needs.
    const int64_t until = now_ns() + kWaitSpinNs;
    while (done_.load() != total && now_ns() < until) pause();
    if (done_.load() != total) {
      std::unique_lock<std::mutex> lock(mu_);
      waiting_.store(true);
      done_cv_.wait(lock, [&] { return done_.load() == total; });
      waiting_.store(false);
    }
    return true;
  }

 private:
  static constexpr uint64_t kField = (1u << 20) - 1, kGeneration = (1u << 24) - 1;
  static constexpr int64_t kWaitSpinNs = 20'000;  // the caller's, for the last items

  static std::atomic<Helpers*>& current() {
    static std::atomic<Helpers*> h{nullptr};
    return h;
  }

  static void pause() {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }

  static int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  // Items of job `gen`: claimed from one word (generation 24 bits, total and next item
  // 20 bits each), so a late helper can never claim an item of a job other than the
  // one it read. A claimed item keeps its job's call and context alive: the caller
  // waits until every item is done.
  void work(uint64_t gen) {
    uint64_t w = word_.load();
    while ((w >> 40) == gen && (w & kField) < ((w >> 20) & kField)) {
      if (!word_.compare_exchange_weak(w, w + 1)) continue;
      call_(ctx_, static_cast<int64_t>(w & kField));
      const uint64_t total = (w >> 20) & kField;
      if (done_.fetch_add(1) + 1 == static_cast<int64_t>(total) && waiting_.load()) {
        std::lock_guard<std::mutex> lock(mu_);
        done_cv_.notify_all();
      }
      w = word_.load();
    }
  }

  void grow(int64_t helpers) {
    for (; started_ < helpers; ++started_) std::thread([this] { loop(); }).detach();
  }

  void loop() {
    uint64_t seen = word_.load() >> 40;
    for (;;) {
      const int64_t until = now_ns() + spin_ns.load(std::memory_order_relaxed);
      uint64_t gen;
      while ((gen = word_.load() >> 40) == seen && now_ns() < until) pause();
      if (gen == seen) {
        std::unique_lock<std::mutex> lock(mu_);
        sleepers_.fetch_add(1);
        cv_.wait(lock, [&] { return (word_.load() >> 40) != seen; });
        sleepers_.fetch_sub(1);
        gen = word_.load() >> 40;
      }
      seen = gen;
      work(gen);
    }
  }

 public:
  // How long a helper spins after a call before it parks, in ns: 200 us unless
  // JAXDISAGG_CPU_SPIN_US says otherwise (0: park at once, as XLA's pool threads do).
  std::atomic<int64_t> spin_ns{[] {
    const char* us = std::getenv("JAXDISAGG_CPU_SPIN_US");
    return us != nullptr ? std::max<int64_t>(0, std::atoll(us)) * 1000 : int64_t{200'000};
  }()};
 private:
  std::mutex busy_, mu_;
  std::condition_variable cv_, done_cv_;
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::atomic<bool> waiting_{false};
  int64_t started_ = 0;  // guarded by busy_
  void (*call_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
};

// Runs fn(0..total-1) on the caller and up to useful_threads(pool) - 1 other threads:
// the kernels' spinning helpers when free, else XLA's pool.
template <typename Fn>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t total, Fn fn) {
  const int64_t threads = useful_threads(pool);
  if (threads <= 1 || total <= 1) {
    for (int64_t i = 0; i < total; ++i) fn(i);
    return;
  }
  if (Helpers::get().run(total, threads, fn)) return;
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
  const int64_t helpers = std::min<int64_t>(threads, total) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done.load() == total; });
}

}  // namespace jaxdisagg_cpu
