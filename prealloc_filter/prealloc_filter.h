// The `preallocate` filter driver (QEMU's block/preallocate.c, QEMU 6.0+):
// sits between a format node and its file (`qcow2 -> preallocate -> file`).
// When a write ends past the data end and past the file's real end, it
// first zero-fills ahead of it with fallocate (write zeroes with
// no_fallback: never zero buffers) up to
// align_up(max(start, write end) + prealloc_size, max(prealloc_align,
// request alignment)), so the filesystem allocates in a few large extents
// instead of on every small write. The parent sees the data end as the
// length; Close() truncates the file back to it.
// Facts: ../shared/reference/preallocate-filter.md (§ numbers below).
//
// State (§3): data_end (the file length when the filter took the file,
// raised by every write ending past it: what size() returns and where the
// file is cut back to), file_end (cached real length of the file) and
// zero_start ([zero_start, file_end) is known to read as zeroes). The
// filter is active only on a read-write file that no one else may write to
// or resize; on a read-only file, or a posix_file::FileNode that shares
// write or resize with other openers, it is a pure pass-through.
//
// Concurrency (§8): a preallocation is issued from inside the write that
// needs it and never waits: if any request to the file is in flight (or
// about to be issued) that reaches past the preallocation's start, or
// another preallocation is running, it is skipped (file_end becomes
// unknown and is re-read from the file's length on the next extending
// write). Requests that reach past the start of a running preallocation
// wait for it (the preallocation extends the file, QEMU makes it
// serialising up to the end of the file); nothing else waits, so extending
// writes are not serialised behind one another.
//
// Differences from QEMU 7.2, each on the safe side:
//  * Data written inside [zero_start, data_end) without extending the data
//    end is remembered (up to kMaxDataRanges ranges, else zero_start moves
//    past it), and a zero write over it is never dropped: QEMU drops it and
//    keeps the old data (e.g. in a freed cluster that qcow2 reallocates
//    together with new ones past the data end). With that record, a zero
//    write that does not extend the data end is dropped too when it falls
//    inside the zero tail and meets no recorded data (QEMU forwards it).
//  * A request that reaches past a running preallocation waits for it
//    before the filter looks at it (QEMU: it tries its own preallocation,
//    finds the running one busy and forwards its zero write), so that zero
//    writes queued behind a preallocation are dropped.
//  * Crash recovery: while a preallocation may be outstanding, the file
//    carries the extended attribute `user.imgtool.preallocate`, "<data end>
//    <file end> <data end before> <file end before>" in decimal, set when
//    the last preallocation started: the data end then and the
//    preallocation's end, the data end at the last flush (or open, or
//    truncate) and the file's length before the preallocation. Each flush
//    (after waiting for a running preallocation) raises both data ends to
//    the data end: a zero write the filter dropped may lie in a cluster
//    that metadata flushed since points to. Close() removes the marker
//    after truncating. Opening a file that still has it (the last user was
//    killed) takes as data end the largest of a floor and the end of the
//    last written extent (FIEMAP after a sync: fallocate'd, never written
//    space is an unwritten extent), so the next Close() trims the stale
//    tail. The floor is <data end> if the file is exactly <file end> long,
//    and <data end before> (at most the length) if it is at least <file end
//    before> but shorter than <file end>: killed before the preallocation's
//    fallocate grew the file (io_uring runs it later), with the tail of the
//    one before still there. Any other length means the file was changed
//    since, and the marker is ignored. A marker of the first two fields
//    only (older builds, and after a truncate) needs the exact length.
//    QEMU leaves such a tail for good. Only for posix_file::FileNode
//    children; if the filesystem refuses user xattrs nothing is recorded.
//
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_PREALLOC_FILTER_PREALLOC_FILTER_H_
#define IMGTOOL_PREALLOC_FILTER_PREALLOC_FILTER_H_

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/filter_node.h"
#include "io/sync.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "prealloc_filter/prealloc_options.pb.h"

namespace imgtool::prealloc_filter {

inline constexpr uint64_t kDefaultPreallocAlign = uint64_t{1} << 20;
inline constexpr uint64_t kDefaultPreallocSize = uint64_t{128} << 20;

// Checks `options` against the file's request alignment in bytes (1
// without O_DIRECT; posix_file::FileNode::request_alignment()), §2.
// kInvalidArgument with QEMU's texts: "prealloc-align parameter of
// preallocate filter is not aligned to 512" if prealloc_align is not a
// multiple of 512, "prealloc-align parameter of preallocate filter is not
// aligned to underlying node request alignment (N)" if it is not a multiple
// of `child_request_alignment`. prealloc_size takes any value.
absl::Status ValidateOptions(const PreallocFilterOptions& options,
                             uint64_t child_request_alignment);

// Reads (a correct parent never reads the tail: size() hides it, and the
// tail reads as zeroes anyway), the allocated size ("disk size") and the
// child: io::FilterNode's.
class PreallocFilterNode : public io::FilterNode {
 public:
  ~PreallocFilterNode() override;

  // The data end while the filter is active (at first the file's length
  // rounded up to 512, as QEMU), else the file's length.
  uint64_t size() const override;
  // Waits for a running preallocation, truncates the file to the data end if
  // the file is longer (errors ignored, as QEMU; §5 "close"), removes the
  // crash marker, then closes the file and returns its Close() status.
  io::Task<absl::Status> Close() override;

  // False: pure pass-through (read-only, or the file is shared).
  bool active() const { return active_; }

  // The state of §3, for tests and `info`; nullopt = unknown (re-read from
  // the file when needed) or not active.
  std::optional<uint64_t> data_end() const { return data_end_; }
  std::optional<uint64_t> file_end() const { return file_end_; }
  std::optional<uint64_t> zero_start() const { return zero_start_; }

 protected:
  // Preallocates if the write ends past the file end (§4), then forwards.
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override;
  // As DoWrite; a zero write without may_unmap that falls inside the known
  // zero tail [zero_start, file_end) is dropped (§4 step 4-5; see the
  // differences above).
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  // Pass-through, state untouched.
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  // With the crash marker set, waits for a running preallocation and
  // raises the marker's data ends to the data end; then forwards.
  io::Task<absl::Status> DoFlush() override;
  // §5: growing past the data end with kFalloc inside the preallocated
  // tail only moves the data end; other growing modes first drop the
  // filter's preallocation (truncate to the data end), then forward; on
  // success the state becomes `size`, on error unknown.
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  // The file's answer (offset within the data end; beyond the file's
  // current length: zeroes, not allocated).
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  friend io::Task<absl::StatusOr<std::unique_ptr<PreallocFilterNode>>>
  OpenPreallocFilter(std::unique_ptr<io::BlockNode> file,
                     const PreallocFilterOptions& options);

  // A request to the file in flight (or waiting to be issued): [start, end).
  struct Inflight {
    uint64_t start;
    uint64_t end;
  };
  // A running preallocation: [start, end) and who waits for it.
  struct Prealloc {
    uint64_t start;
    uint64_t end;
    io::Event done;
  };

  PreallocFilterNode(std::unique_ptr<io::BlockNode> file, bool active,
                     uint64_t request_alignment, uint64_t align,
                     uint64_t prealloc_size);

  // §4 handle_write: updates the state for a write of [offset, offset +
  // length) and preallocates if needed. Returns true if `merge_zero` and the
  // range is known to read as zeroes (the zero write can be dropped).
  io::Task<bool> HandleWrite(uint64_t offset, uint64_t length, bool merge_zero);
  // The file's length rounded up to 512 bytes: QEMU's bdrv_getlength(),
  // which is what the filter's state starts from ([V]: a 196624-byte qcow2
  // gets its first preallocation at 197120).
  uint64_t FileLength() const;
  // file_end, read from the file (FileLength) first if it is unknown.
  uint64_t KnownFileEnd();
  // Makes file_end unknown (re-read on next use) and bumps file_end_epoch_.
  void InvalidateFileEnd();
  // zero_start := `zero_start`; forgets data_in_zero_tail_.
  void SetZeroStart(uint64_t zero_start);
  // Records data written to [start, end) (inside the zero tail).
  void AddData(uint64_t start, uint64_t end);
  // Whether [start, end) meets recorded data.
  bool OverlapsData(uint64_t start, uint64_t end) const;
  // Fills data_end/file_end/zero_start from the file if unknown.
  void InitState();
  // Runs `request`, the file request over [offset, offset + length)
  // (bytes), registered in inflight_ while it runs, after waiting while it
  // reaches past the start of a running preallocation. Returns its status.
  io::Task<absl::Status> RunRequest(uint64_t offset, uint64_t length,
                                    io::Task<absl::Status> request);
  // Waits until no preallocation runs.
  io::Task<void> WaitForPrealloc();
  // The crash marker's fields (see the file comment); `before` is (data
  // end, file length) before the last preallocation, if known.
  struct Marker {
    uint64_t data_end = 0;
    uint64_t file_end = 0;
    std::optional<std::pair<uint64_t, uint64_t>> before;
    bool operator==(const Marker&) const = default;
  };
  // Crash marker (see the file comment); no-ops without a FileNode fd.
  void SetMarker(const Marker& marker);
  void RemoveMarker();

  const bool active_;
  const uint64_t request_alignment_;  // of the file, >= 1
  const uint64_t align_;              // max(prealloc_align, request alignment)
  const uint64_t prealloc_size_;
  // file_ as a posix_file::FileNode (null for other nodes): its
  // allocating write zeroes and its descriptor (for the crash marker).
  posix_file::FileNode* file_node_ = nullptr;
  int fd_ = -1;

  std::optional<uint64_t> data_end_;
  std::optional<uint64_t> file_end_;
  std::optional<uint64_t> zero_start_;
  // Data written at or past zero_start (below the data end), start -> end,
  // disjoint and not touching.
  static constexpr size_t kMaxDataRanges = 64;
  std::map<uint64_t, uint64_t> data_in_zero_tail_;
  // Bumped whenever file_end_ is made unknown; a preallocation sets
  // file_end_ on success only if nothing did so while it ran.
  uint64_t file_end_epoch_ = 0;
  // The crash marker's value, if set.
  std::optional<Marker> marker_;
  // The data end at the last flush (or open, or truncate).
  uint64_t flushed_data_end_ = 0;
  std::list<Inflight> inflight_;
  std::unique_ptr<Prealloc> prealloc_;  // the running preallocation
};

// Builds the filter over `file` (ownership passes to the filter, also on
// error; the file is not closed on error) after ValidateOptions with the
// file's request alignment (a posix_file::FileNode's; 1 for other nodes).
// `file` is normally a posix_file::FileNode opened read-write with the
// default FileOpenOptions (write and resize not shared: a second opener
// gets `Failed to get "write" lock`). If the file carries the crash marker,
// the data end is recovered from its extents (see above). Errors:
// kInvalidArgument from ValidateOptions; block status errors of the file
// while recovering.
io::Task<absl::StatusOr<std::unique_ptr<PreallocFilterNode>>>
OpenPreallocFilter(std::unique_ptr<io::BlockNode> file,
                   const PreallocFilterOptions& options);

}  // namespace imgtool::prealloc_filter

#endif  // IMGTOOL_PREALLOC_FILTER_PREALLOC_FILTER_H_
