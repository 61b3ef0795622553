// Division by a divisor that is fixed for a whole kernel launch, as a multiply-high, an add and
// a shift (the round-up method of Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994). The prefill kernels divide by the group size and by their schedule's
// counts at every query block; as plain `/` each of those is a chain of about twenty dependent
// instructions (I2F, MUFU.RCP, F2I, IMAD.HI and the corrections), and a block's set-up ran a
// dozen of them back to back. The host builds each divisor once (make_fast_divisor).
#pragma once

#include <cstdint>

#include "errors.h"  // GQA_HOST_DEVICE

namespace gqa {

struct FastDivisor {
  uint32_t divisor = 1;
  uint32_t multiplier = 1;  // floor(2^32 * (2^shift - divisor) / divisor) + 1 (< 2^32)
  uint32_t shift = 0;       // ceil(log2(divisor))

  // n / divisor for 0 <= n <= INT32_MAX. With t = floor(n * multiplier / 2^32) <= n, the sum
  // t + n stays below 2^32, so the method's (N + 1)-bit add fits 32 bits.
  GQA_HOST_DEVICE int divide(int n) const {
    const uint32_t un = static_cast<uint32_t>(n);
#if defined(__CUDA_ARCH__)
    const uint32_t t = __umulhi(un, multiplier);
#else
    const uint32_t t = static_cast<uint32_t>((static_cast<uint64_t>(un) * multiplier) >> 32);
#endif
    return static_cast<int>((t + un) >> shift);
  }
  GQA_HOST_DEVICE int remainder(int n, int quotient) const {
    return n - quotient * static_cast<int>(divisor);
  }
};

// divisor in [1, INT32_MAX] (the callers pass positive int32 counts).
inline FastDivisor make_fast_divisor(int32_t d) {
  FastDivisor f;
  const uint32_t ud = d > 0 ? static_cast<uint32_t>(d) : 1u;
  uint32_t shift = 0;
  while ((uint64_t{1} << shift) < ud) ++shift;
  f.divisor = ud;
  f.shift = shift;
  // 2^32 * (2^shift - d) < 2^63 for shift <= 31.
  f.multiplier = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - ud)) / ud + 1);
  return f;
}

}  // namespace gqa
