// Whether a buffer holds only zero bytes (QEMU's buffer_is_zero, as convert,
// compare, copy-on-read and the NBD server's --detect-zeroes ask it).
#ifndef IMGTOOL_BASE_ZERO_H_
#define IMGTOOL_BASE_ZERO_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace imgtool {

// True when the `n` bytes at `p` are all zero (n == 0: true). Stops at the
// first byte that is not (memcmp of the buffer against itself shifted by
// one byte, so libc's vectorised compare does the work).
inline bool IsZero(const uint8_t* p, size_t n) {
  return n == 0 || (p[0] == 0 && std::memcmp(p, p + 1, n - 1) == 0);
}

}  // namespace imgtool

#endif  // IMGTOOL_BASE_ZERO_H_
