#include "io/aligned_buffer.h"

#include <bit>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace imgtool::io {

namespace {

// Memory of `size` (> 0) bytes aligned to the power of two `alignment`,
// zeroed if `zero`; 0 or the error of posix_memalign.
int Allocate(size_t size, size_t alignment, uint8_t** data, bool zero = true) {
  void* p = nullptr;
  // posix_memalign needs at least pointer alignment; more is still aligned
  // to the (smaller) power of two asked for.
  size_t a = alignment < sizeof(void*) ? sizeof(void*) : alignment;
  if (int err = posix_memalign(&p, a, size); err != 0) return err;
  if (zero) std::memset(p, 0, size);
  *data = static_cast<uint8_t*>(p);
  return 0;
}

}  // namespace

AlignedBuffer::AlignedBuffer(size_t size, size_t alignment)
    : size_(size), alignment_(alignment) {
  if (!std::has_single_bit(alignment)) std::abort();
  if (size == 0) return;
  if (Allocate(size, alignment, &data_) != 0) std::abort();
}

absl::StatusOr<AlignedBuffer> AlignedBuffer::Create(size_t size,
                                                    size_t alignment) {
  if (!std::has_single_bit(alignment)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Buffer alignment %d is not a power of two", alignment));
  }
  if (size == 0) return AlignedBuffer(nullptr, 0, alignment);
  uint8_t* data = nullptr;
  if (int err = Allocate(size, alignment, &data); err != 0) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("Failed to allocate %d bytes of memory: %s", size,
                        std::strerror(err)));
  }
  return AlignedBuffer(data, size, alignment);
}

AlignedBuffer AlignedBuffer::Uninitialized(size_t size, size_t alignment) {
  if (!std::has_single_bit(alignment)) std::abort();
  if (size == 0) return AlignedBuffer(nullptr, 0, alignment);
  uint8_t* data = nullptr;
  if (Allocate(size, alignment, &data, /*zero=*/false) != 0) std::abort();
  return AlignedBuffer(data, size, alignment);
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
