// One AdamW step over one parameter, on CPU, in a single pass.
//
// Written in XLA, an AdamW update reads each parameter's gradient and moments in
// several fused loops, and XLA copies the moments first, because the loop that writes
// the new parameter reads the old moments that the other loops overwrite in place. This
// kernel reads the parameter, its gradient and both moments once and writes the
// parameter and the moments back in place (the call aliases them), float32 or bfloat16
// throughout, computing in float32. When the step is not to be applied (a non-finite
// gradient) it leaves them as they are.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The scalars of one step, in the order of the `hyper` operand.
enum Hyper {
  kLearningRate,
  kB1,
  kB2,
  kOneMinusB1,  // in float64 first, as optax computes it
  kOneMinusB2,
  kEps,
  kEpsRoot,
  kWeightDecay,
  kCorrection1,  // 1 - b1^t
  kCorrection2,  // 1 - b2^t
  kGradScale,    // the gradient's scale (the loss's normaliser times clipping)
  kApply,        // 1: apply the step; 0: leave everything as it is
  kHyperCount,
};

constexpr int64_t kChunk = 1 << 15;

inline float widen(float x) { return x; }
inline float widen(uint16_t bits) { return eqdel::bf16_to_float(bits); }

inline void narrow(float x, float* out) { *out = x; }

inline void narrow(float x, uint16_t* out) { *out = eqdel::float_to_bf16(x); }

template <class T>
void adamw(ffi::ThreadPool& pool, const float* hyper, int64_t size, const T* p, const T* g,
           const T* m, const T* v, T* p_out, T* m_out, T* v_out) {
  const float lr = hyper[kLearningRate], b1 = hyper[kB1], b2 = hyper[kB2];
  const float one_minus_b1 = hyper[kOneMinusB1], one_minus_b2 = hyper[kOneMinusB2];
  const float eps = hyper[kEps], eps_root = hyper[kEpsRoot], decay = hyper[kWeightDecay];
  const float c1 = hyper[kCorrection1], c2 = hyper[kCorrection2], scale = hyper[kGradScale];
  const int64_t chunks = (size + kChunk - 1) / kChunk;
  eqdel::parallel_for(pool, chunks, [&](int64_t chunk) {
    const int64_t end = std::min(size, (chunk + 1) * kChunk);
#pragma GCC ivdep
    for (int64_t i = chunk * kChunk; i < end; ++i) {
      const float grad = widen(g[i]) * scale;
      T m_new, v_new;
      narrow(one_minus_b1 * grad + b1 * widen(m[i]), &m_new);
      narrow(one_minus_b2 * (grad * grad) + b2 * widen(v[i]), &v_new);
      const float param = widen(p[i]);
      const float m_hat = widen(m_new) / c1, v_hat = widen(v_new) / c2;
      const float update = m_hat / (std::sqrt(v_hat + eps_root) + eps) + decay * param;
      narrow(param + -lr * update, &p_out[i]);
      m_out[i] = m_new;
      v_out[i] = v_new;
    }
  });
}

// When the step is skipped, results that XLA did not alias to their operands still need
// the operands' values.
template <class T>
void keep(const T* from, T* to, int64_t size) {
  if (from != to) std::memcpy(to, from, size * sizeof(T));
}

template <ffi::DataType D>
ffi::Error AdamWImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> hyper, ffi::Buffer<D> p,
                     ffi::Buffer<D> g, ffi::Buffer<D> m, ffi::Buffer<D> v,
                     ffi::ResultBuffer<D> p_out, ffi::ResultBuffer<D> m_out,
                     ffi::ResultBuffer<D> v_out) {
  using T = std::conditional_t<D == ffi::DataType::F32, float, uint16_t>;
  if (hyper.element_count() != kHyperCount)
    return ffi::Error::InvalidArgument("adamw: hyper must hold 12 scalars");
  const int64_t size = p.element_count();
  if (g.element_count() != size || m.element_count() != size || v.element_count() != size)
    return ffi::Error::InvalidArgument("adamw: parameter, gradient and moments differ in size");
  const float* h = hyper.typed_data();
  auto* ps = reinterpret_cast<const T*>(p.untyped_data());
  auto* ms = reinterpret_cast<const T*>(m.untyped_data());
  auto* vs = reinterpret_cast<const T*>(v.untyped_data());
  auto* pd = reinterpret_cast<T*>(p_out->untyped_data());
  auto* md = reinterpret_cast<T*>(m_out->untyped_data());
  auto* vd = reinterpret_cast<T*>(v_out->untyped_data());
  if (h[kApply] == 0) {
    keep(ps, pd, size);
    keep(ms, md, size);
    keep(vs, vd, size);
  } else {
    adamw(pool, h, size, ps, reinterpret_cast<const T*>(g.untyped_data()), ms, vs, pd, md, vd);
  }
  return ffi::Error::Success();
}

}  // namespace

#define EQDEL_ADAMW_HANDLER(name, type)                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, AdamWImpl<type>,                  \
                                ffi::Ffi::Bind()                        \
                                    .Ctx<ffi::ThreadPool>()             \
                                    .Arg<ffi::Buffer<ffi::F32>>()       \
                                    .Arg<ffi::Buffer<type>>()           \
                                    .Arg<ffi::Buffer<type>>()           \
                                    .Arg<ffi::Buffer<type>>()           \
                                    .Arg<ffi::Buffer<type>>()           \
                                    .Ret<ffi::Buffer<type>>()           \
                                    .Ret<ffi::Buffer<type>>()           \
                                    .Ret<ffi::Buffer<type>>())

EQDEL_ADAMW_HANDLER(EqdelAdamWF32, ffi::DataType::F32);
EQDEL_ADAMW_HANDLER(EqdelAdamWBF16, ffi::DataType::BF16);
