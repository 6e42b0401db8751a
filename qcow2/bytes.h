// Big-endian loads and stores for the qcow2 driver's own header field and
// table writes (every qcow2 integer is big-endian). `p` points to at least
// sizeof(T) bytes; no alignment needed.
#ifndef IMGTOOL_QCOW2_BYTES_H_
#define IMGTOOL_QCOW2_BYTES_H_

#include <cstdint>

namespace imgtool::qcow2 {

inline uint16_t LoadBE16(const uint8_t* p) {
  return static_cast<uint16_t>((uint16_t{p[0]} << 8) | p[1]);
}
inline uint32_t LoadBE32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) |
         (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}
inline uint64_t LoadBE64(const uint8_t* p) {
  return (uint64_t{LoadBE32(p)} << 32) | LoadBE32(p + 4);
}
inline void StoreBE32(uint8_t* p, uint32_t v) {
  for (int i = 3; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}
inline void StoreBE64(uint8_t* p, uint64_t v) {
  for (int i = 7; i >= 0; --i, v >>= 8) p[i] = static_cast<uint8_t>(v);
}

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_BYTES_H_
