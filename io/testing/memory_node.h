// MemoryNode: a protocol node over a byte buffer, for fuzzers and tests that
// open a format driver on bytes instead of a file. Every request completes
// at once, without an engine: RunInline() drives a task over such nodes to
// its end on the calling thread.
//
// The buffer never grows past `max_size` bytes: a write, write-zeroes or
// truncate that would end past it fails with kResourceExhausted ("<name>:
// No space left on device"), so a driver writing far past the end of a
// fuzzed image cannot make the process take memory beyond that bound.
// Reads past the end read zeroes; block status reports [0, size()) as data
// at the same offset of this node.
// Thread model: like every node, one thread at a time.
#ifndef IMGTOOL_IO_TESTING_MEMORY_NODE_H_
#define IMGTOOL_IO_TESTING_MEMORY_NODE_H_

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"

namespace imgtool::io::testing {

class MemoryNode final : public BlockNode {
 public:
  // A node named `name` holding `bytes` (its size is bytes.size()).
  // Precondition: bytes.size() <= max_size.
  MemoryNode(std::string name, std::vector<uint8_t> bytes, bool read_only,
             uint64_t max_size);

  uint64_t size() const override { return bytes_.size(); }
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return bytes_.size();
  }
  Task<absl::Status> Close() override;

  const std::vector<uint8_t>& bytes() const { return bytes_; }
  // Flush() calls so far.
  int flushes() const { return flushes_; }

 protected:
  Task<absl::Status> DoRead(uint64_t offset, IoVec buf) override;
  Task<absl::Status> DoWrite(uint64_t offset, ConstIoVec data) override;
  Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                   WriteZeroesFlags flags) override;
  Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  Task<absl::Status> DoFlush() override;
  Task<absl::Status> DoTruncate(uint64_t size, PreallocMode prealloc) override;
  Task<absl::StatusOr<BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  // kResourceExhausted unless `end` <= max_size_; grows bytes_ to `end`.
  absl::Status GrowTo(uint64_t end);

  std::vector<uint8_t> bytes_;
  uint64_t max_size_;
  int flushes_ = 0;
};

// Runs `task` on this thread until it finishes and returns its result, or
// nullopt if it suspended waiting for something that never came (no engine
// drives it; with MemoryNodes only that means a deadlock). The suspended
// task is then leaked, not destroyed.
template <typename T>
std::optional<T> RunInline(Task<T> task) {
  auto result = std::make_shared<std::optional<T>>();
  Spawn(std::move(task), [result](T v) { result->emplace(std::move(v)); });
  if (!result->has_value()) return std::nullopt;
  return std::move(**result);
}

}  // namespace imgtool::io::testing

#endif  // IMGTOOL_IO_TESTING_MEMORY_NODE_H_
