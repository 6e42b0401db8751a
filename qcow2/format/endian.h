// Big-endian loads and stores for qcow2 byte layouts (every qcow2 integer is
// big-endian, qcow2 spec "General"). Private to qcow2/format/: callers pass a
// pointer to at least sizeof(T) readable/writable bytes; no alignment needed.
#ifndef IMGTOOL_QCOW2_FORMAT_ENDIAN_H_
#define IMGTOOL_QCOW2_FORMAT_ENDIAN_H_

#include <cstdint>

namespace imgtool::qcow2::format::internal {

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

inline void StoreBE16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v >> 8);
  p[1] = static_cast<uint8_t>(v);
}

inline void StoreBE32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v >> 24);
  p[1] = static_cast<uint8_t>(v >> 16);
  p[2] = static_cast<uint8_t>(v >> 8);
  p[3] = static_cast<uint8_t>(v);
}

inline void StoreBE64(uint8_t* p, uint64_t v) {
  StoreBE32(p, static_cast<uint32_t>(v >> 32));
  StoreBE32(p + 4, static_cast<uint32_t>(v));
}

}  // namespace imgtool::qcow2::format::internal

#endif  // IMGTOOL_QCOW2_FORMAT_ENDIAN_H_
