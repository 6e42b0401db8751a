// Alignment helpers. `alignment` must be a power of two unless the function
// says otherwise; values are bytes.
#ifndef IMGTOOL_BASE_ALIGN_H_
#define IMGTOOL_BASE_ALIGN_H_

#include <cstdint>

namespace imgtool {

constexpr bool IsPowerOfTwo(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

// Rounds down/up to a multiple of `alignment` (power of two). AlignUp of a
// value within alignment-1 of 2^64 wraps; callers check ranges first.
constexpr uint64_t AlignDown(uint64_t v, uint64_t alignment) {
  return v & ~(alignment - 1);
}
constexpr uint64_t AlignUp(uint64_t v, uint64_t alignment) {
  return (v + alignment - 1) & ~(alignment - 1);
}
constexpr bool IsAligned(uint64_t v, uint64_t alignment) {
  return (v & (alignment - 1)) == 0;
}

// The same for any non-zero `alignment`, not only powers of two.
constexpr uint64_t RoundDownTo(uint64_t v, uint64_t alignment) {
  return v - v % alignment;
}
constexpr uint64_t RoundUpTo(uint64_t v, uint64_t alignment) {
  return RoundDownTo(v + alignment - 1, alignment);
}

}  // namespace imgtool

#endif  // IMGTOOL_BASE_ALIGN_H_
