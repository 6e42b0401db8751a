// The `null-co` and `null-aio` protocol drivers (QEMU 7.2's block/null.c;
// facts from there and from qemu-img/qemu-io 7.2 runs): a node of `size`
// bytes (default 1 GiB) rounded up to a multiple of 512, as QEMU counts
// lengths in sectors, with no storage. Writes, zero writes, discards and
// flushes succeed and are dropped. Reads return zeroes with read-zeroes=on;
// without it (QEMU 7.2's default) they leave the caller's buffer as it was
// (qemu-io's buffers are filled with 0xab, so it shows 0xab). Block status:
// the whole range from the queried offset, "zero" with offset = the queried
// offset in this node with read-zeroes=on; neither data nor zero without it
// (qemu-img map: not present). Allocated size 0. Resize is refused
// (kUnimplemented "Image format driver does not support resize", QEMU's
// text). The two drivers differ in QEMU only in how requests complete
// (coroutines or AIO callbacks); here they are the same node.
//
// latency-ns: every read, write, zero write, discard and flush completes
// after that many nanoseconds, waited on a timerfd read through the engine
// (io_uring); where the engine cannot read a timerfd (the thread-pool and
// Linux AIO engines read with preadv/io_submit, which a timerfd refuses),
// the node sleeps on the calling thread instead, holding up the engine for
// that time.
//
// Filenames: QEMU's only filename for these drivers is "null-co://"
// (null-aio://); ParseNullFilename checks it.
//
// Units: bytes (latency: nanoseconds). Thread model: like every node, used
// from its engine's thread only.
#ifndef IMGTOOL_NULL_BLOCK_NULL_NODE_H_
#define IMGTOOL_NULL_BLOCK_NULL_NODE_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "null_block/null_options.pb.h"

namespace imgtool::null_block {

inline constexpr uint64_t kDefaultNullSize = uint64_t{1} << 30;

// QEMU's null_co_parse_filename / null_aio_parse_filename: `filename` must
// be exactly "<driver>://" ("null-co://" for driver "null-co").
// kInvalidArgument "The only allowed filename for this driver is
// 'null-co://'" otherwise.
absl::Status ParseNullFilename(absl::string_view driver,
                               absl::string_view filename);

class NullNode final : public io::BlockNode {
 public:
  // A node of `driver` ("null-co" or "null-aio") with `options`. `engine`
  // (not owned, may be null: latency is then slept on the calling thread)
  // must outlive the node. kInvalidArgument "latency-ns is invalid" for a
  // negative latency (QEMU's text).
  static absl::StatusOr<std::unique_ptr<NullNode>> Open(
      std::string driver, const NullOptions& options, io::Engine* engine,
      bool read_only);

  uint64_t size() const override { return size_; }
  // 0: a null node occupies nothing.
  absl::StatusOr<uint64_t> AllocatedSize() const override { return 0; }
  io::Task<absl::Status> Close() override;

  const std::string& driver() const { return driver_; }
  bool read_zeroes() const { return read_zeroes_; }
  int64_t latency_ns() const { return latency_ns_; }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  NullNode(std::string driver, uint64_t size, int64_t latency_ns,
           bool read_zeroes, io::Engine* engine, bool read_only);

  // Waits latency_ns_ (nothing if 0); see the file comment.
  io::Task<void> Delay();

  const std::string driver_;
  const uint64_t size_;
  const int64_t latency_ns_;
  const bool read_zeroes_;
  io::Engine* const engine_;
};

}  // namespace imgtool::null_block

#endif  // IMGTOOL_NULL_BLOCK_NULL_NODE_H_
