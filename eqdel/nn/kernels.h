// What eqdel's CPU kernels share: conversions between float32 and bfloat16 bits, and a
// parallel loop on XLA's intra-op threads.

#ifndef EQDEL_NN_KERNELS_H_
#define EQDEL_NN_KERNELS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace eqdel {

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

// The bits of the bfloat16 nearest to `x`, ties to even, as XLA converts; NaN stays NaN.
inline uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet = (bits >> 16) | 0x40u;
  return uint16_t(x != x ? quiet : rounded);
}

// Runs body(task) for task in [0, tasks) on the calling thread and the pool's threads;
// returns when every task is done. Tasks are claimed from a shared counter, so the call
// finishes even if no pool thread ever picks its work up.
template <class F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t tasks, const F& body) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, tasks, &body]() {
    int64_t finished = 0;
    for (int64_t t; (t = state->next.fetch_add(1)) < tasks;) {
      body(t);
      ++finished;
    }
    if (finished) state->done.fetch_add(finished);
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t h = 0; h < helpers; ++h) {
    // A helper that starts after the call returned finds no task left and touches
    // nothing but `state`, which it shares.
    pool.Schedule([state, tasks, work]() {
      if (state->next.load() < tasks) work();
    });
  }
  work();
  while (state->done.load() < tasks) std::this_thread::yield();
}

}  // namespace eqdel

#endif  // EQDEL_NN_KERNELS_H_
