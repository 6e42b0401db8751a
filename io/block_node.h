// BlockNode: one node of a block graph (a protocol driver such as `file`, a
// filter such as `preallocate`, a format such as `qcow2`). Callers use the
// public non-virtual operations; they do the checks that every node shares
// (length overflow, read-only, the write-zeroes fallback) once, then call the
// driver's Do* override. Drivers never repeat those checks.
//
// Units: offsets and lengths are bytes. Alignment: any, unless a driver says
// otherwise (posix_file bounces unaligned O_DIRECT requests itself).
// Thread model: used from its engine's thread only.
#ifndef IMGTOOL_IO_BLOCK_NODE_H_
#define IMGTOOL_IO_BLOCK_NODE_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/task.h"

namespace imgtool::io {

using IoVec = absl::Span<uint8_t>;
using ConstIoVec = absl::Span<const uint8_t>;

// How a truncate that grows a node backs the new range (QEMU's
// PreallocMode for protocol nodes; qcow2 adds kMetadata).
enum class PreallocMode { kOff, kMetadata, kFalloc, kFull };

// Parses "off", "metadata", "falloc", "full". kInvalidArgument otherwise.
absl::StatusOr<PreallocMode> ParsePreallocMode(const std::string& name);
const char* PreallocModeName(PreallocMode mode);

struct WriteZeroesFlags {
  bool may_unmap = false;    // the range may be deallocated (punch a hole)
  bool no_fallback = false;  // fail with kUnimplemented rather than write zeroes
};

// The state of a range, from one node's point of view (QEMU's
// BDRV_BLOCK_DATA / ZERO / OFFSET_VALID).
struct BlockStatus {
  uint64_t length = 0;         // bytes from the queried offset with this state
  bool data = false;           // allocated at this layer
  bool zero = false;           // reads as zeroes
  bool offset_valid = false;   // host_offset means something
  uint64_t host_offset = 0;    // where the range's bytes are in `file`
  const class BlockNode* file = nullptr;  // node holding the bytes, if any
};

class BlockNode {
 public:
  virtual ~BlockNode() = default;

  // Name of the image as given by the user (used in every error message).
  const std::string& filename() const { return filename_; }
  bool read_only() const { return read_only_; }

  // Length of the node in bytes.
  virtual uint64_t size() const = 0;

  // Reads buf.size() bytes at `offset`. Bytes past size() read as zeroes.
  // Errors: kOutOfRange if offset + length overflows; I/O errors from the
  // driver.
  Task<absl::Status> Read(uint64_t offset, IoVec buf);

  // Writes `data` at `offset`. kFailedPrecondition on a read-only node,
  // kOutOfRange on overflow.
  Task<absl::Status> Write(uint64_t offset, ConstIoVec data);

  // Makes [offset, offset + length) read as zeroes. If the driver has no
  // efficient way (kUnimplemented) and !flags.no_fallback, writes zero
  // buffers of at most 1 MiB instead.
  Task<absl::Status> WriteZeroes(uint64_t offset, uint64_t length,
                                 WriteZeroesFlags flags);

  // Hints that the range is unused; it may read back as anything the driver
  // documents (zeroes for files that punch holes). kUnimplemented is not an
  // error to callers: discard is advisory.
  Task<absl::Status> Discard(uint64_t offset, uint64_t length);

  // Makes completed writes durable (fdatasync for files).
  Task<absl::Status> Flush();

  // Sets the length to `size`. Growing backs the new range per `prealloc`;
  // shrinking with prealloc != kOff is kInvalidArgument.
  Task<absl::Status> Truncate(uint64_t size, PreallocMode prealloc);

  // State of the range starting at `offset` (< size()), for at most
  // `max_length` bytes (the answer's length is in 1..max_length).
  Task<absl::StatusOr<BlockStatus>> GetBlockStatus(uint64_t offset,
                                                   uint64_t max_length);

  // Bytes the node occupies on its storage ("disk size"), if known.
  virtual absl::StatusOr<uint64_t> AllocatedSize() const {
    return absl::UnimplementedError("allocated size unknown");
  }

  // The backing node whose data shows through where this node has none
  // (qcow2's backing file), or null. Not owned by the caller.
  virtual BlockNode* backing() const { return nullptr; }

  // Flushes what needs flushing and releases the node's resources. Errors
  // are returned here, never hidden in a destructor.
  virtual Task<absl::Status> Close() = 0;

 protected:
  BlockNode(std::string filename, bool read_only)
      : filename_(std::move(filename)), read_only_(read_only) {}

  virtual Task<absl::Status> DoRead(uint64_t offset, IoVec buf) = 0;
  virtual Task<absl::Status> DoWrite(uint64_t offset, ConstIoVec data) = 0;
  virtual Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                           WriteZeroesFlags flags);
  virtual Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length);
  virtual Task<absl::Status> DoFlush() = 0;
  virtual Task<absl::Status> DoTruncate(uint64_t size, PreallocMode prealloc);
  virtual Task<absl::StatusOr<BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) = 0;

 private:
  std::string filename_;
  bool read_only_;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_BLOCK_NODE_H_
