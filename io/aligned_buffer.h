// AlignedBuffer: an owning, zero-initialised block of memory whose start is
// aligned to a power of two, for O_DIRECT I/O (which needs the buffer, the
// offset and the length aligned to the device's logical block size, usually
// 512 or 4096 bytes; 4096 fits both).
//
//   AlignedBuffer buf(64 * 1024);              // 64 KiB, 4096-aligned, zeroes
//   struct iovec iov = {buf.data(), buf.size()};
//
// Thread model: a plain value; not synchronised.
#ifndef IMGTOOL_IO_ALIGNED_BUFFER_H_
#define IMGTOOL_IO_ALIGNED_BUFFER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::io {

class AlignedBuffer {
 public:
  static constexpr size_t kDefaultAlignment = 4096;

  // An empty buffer: size() 0, data() nullptr.
  AlignedBuffer() = default;

  // Allocates `size` bytes (0 allowed: empty buffer) starting at a multiple
  // of `alignment` bytes, all zero. `alignment` must be a power of two; the
  // program aborts if it is not or if memory runs out (like `new`). For
  // sizes that come from the user, use Create.
  explicit AlignedBuffer(size_t size, size_t alignment = kDefaultAlignment);

  // The same, but failures are returned: kInvalidArgument if `alignment` is
  // not a power of two, kResourceExhausted "Failed to allocate <size> bytes
  // of memory: Cannot allocate memory" if the memory cannot be had (e.g. a
  // buffer larger than the address space or the overcommit limit).
  static absl::StatusOr<AlignedBuffer> Create(
      size_t size, size_t alignment = kDefaultAlignment);

  // Like the constructor, but the contents are left as the allocator
  // returns them (indeterminate): for buffers the caller fills completely
  // before reading, where zeroing would only cost time (2 MiB copy-on-write
  // buffers: a memset and 512 page faults each).
  static AlignedBuffer Uninitialized(size_t size,
                                     size_t alignment = kDefaultAlignment);

  // Move-only; a moved-from buffer is empty.
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  uint8_t* data() { return data_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }  // bytes
  bool empty() const { return size_ == 0; }
  size_t alignment() const { return alignment_; }  // bytes

  absl::Span<uint8_t> span() { return absl::Span<uint8_t>(data_, size_); }
  absl::Span<const uint8_t> span() const {
    return absl::Span<const uint8_t>(data_, size_);
  }

 private:
  // Takes ownership of `data` (from posix_memalign).
  AlignedBuffer(uint8_t* data, size_t size, size_t alignment)
      : data_(data), size_(size), alignment_(alignment) {}

  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  size_t alignment_ = kDefaultAlignment;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_ALIGNED_BUFFER_H_
