#include "io/aligned_buffer.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace imgtool::io {

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment)
    : size_(size), alignment_(alignment) {
  if (!std::has_single_bit(alignment)) std::abort();
  if (size == 0) return;
  void* p = nullptr;
  // posix_memalign needs at least pointer alignment; more is still aligned
  // to the (smaller) power of two asked for.
  size_t a = alignment < sizeof(void*) ? sizeof(void*) : alignment;
  if (posix_memalign(&p, a, size) != 0) std::abort();
  std::memset(p, 0, size);
  data_ = static_cast<uint8_t*>(p);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      alignment_(other.alignment_) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    alignment_ = other.alignment_;
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

}  // namespace imgtool::io
