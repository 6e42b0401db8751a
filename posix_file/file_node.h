// The `file` protocol driver and its device twins `host_device` and
// `host_cdrom`: a block node over a regular file, or over a block or
// character device (QEMU's file-posix). Creation with preallocation and an XFS extent
// size hint, cache modes incl. O_DIRECT with request alignment probing and
// bounce buffers, OFD image locks, fallocate-based write zeroes/discard
// with a probed-once fallback, and block status from SEEK_DATA/SEEK_HOLE.
// Facts: ../shared/reference/file-posix.md.
// Thread model: like every node, used from its engine's thread only.
#ifndef IMGTOOL_POSIX_FILE_FILE_NODE_H_
#define IMGTOOL_POSIX_FILE_FILE_NODE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::posix_file {

// Extended attribute (value "1") a file carries while it may be longer than
// its data because a FileNode grew its length ahead
// (FileNode::GrowLengthAhead): a killed writer leaves it, and only then does
// FileNode::AdoptHoleTail take the hole after the data.
inline constexpr char kGrownAheadMarker[] = "user.imgtool.grown-ahead";

// Creates (or replaces, as qemu-img does) the file `path` with
// `options` (file-posix.md §1-3: lock, truncate to 0, nocow, extent size
// hint, then grow with the preallocation mode, never truncating to the final
// size before falloc). Warnings such as "Failed to set extent size hint:
// <strerror>" (only for an explicit non-zero hint) go to `warnings`.
// On a block or character device (QEMU's host_device create) the length is
// kept: `size` up to the device length is fine, more is kInvalidArgument
// "<path>: Cannot grow device files", preallocation is kUnimplemented
// "<path>: Unsupported preallocation mode '<mode>'", and the first 512 bytes
// are zeroed; hint and nocow do not apply.
// Errors name the path: kInvalidArgument for bad options, kFailedPrecondition
// if another process holds the image's locks, errno-derived codes for
// syscalls. On failure after the locks were taken, a file that did not
// exist before is removed and an existing one is left at length 0 rather
// than looking like a valid image. A file whose locks cannot be taken is
// never removed or changed, even one this call created: another process
// opened it in between and owns it.
absl::Status CreateFile(const std::string& path,
                        const FileCreateOptions& options,
                        std::ostream* warnings);

class FileNode : public io::BlockNode {
 public:
  // Opens `options.filename` for I/O through `engine` (not owned, must
  // outlive the node). Takes the OFD locks of file-posix.md §7; a conflict
  // is kFailedPrecondition: `Failed to get "write" lock` + `Is another
  // process using the image [<file>]?` (one line, joined by "\n" only if
  // qemu-img prints two). Which bytes are locked follows read_only,
  // force_share and share_all_with_others (file_options.proto); a node that
  // shares everything locks byte 103 (resize) on its first Truncate, which
  // fails with `Failed to get "resize" lock` if another opener denies it.
  // Probes O_DIRECT alignment for cache=none and directsync. A file longer
  // than 2^63 - 2^30 bytes (rounded up to 512; QEMU's limit) is kOutOfRange
  // "Could not refresh total sector count: File too large".
  // The file is opened first, then checked, in QEMU's order, so a
  // directory opened read-write fails in open(2) ("<path>: Could not open:
  // Is a directory") and read-only in the check: the `file` driver
  // (options.driver() "file" or empty) needs a regular file,
  // kInvalidArgument "'file' driver requires '<path>' to be a regular file"
  // (/dev/null too); host_device and host_cdrom need a character or block
  // device, kInvalidArgument "'host_device' driver requires '<path>' to be
  // either a character or block device". A read-write open of a block
  // device set read-only (BLKROGET) is kPermissionDenied "The device is not
  // writable: Permission denied". On a device, block status is data with
  // its offset for the whole range (QEMU's host_device has no block status
  // of its own), the node's length is the device's, and Truncate may only
  // keep or lower it ("Cannot grow device files"). Image locks are taken on
  // devices as on files.
  static absl::StatusOr<std::unique_ptr<FileNode>> Open(
      io::Engine& engine, const FileOpenOptions& options,
      std::ostream* warnings);

  // Closes the file if Close did not (without flushing; a grown-ahead
  // length is still cut back to the data, errors ignored).
  ~FileNode() override;

  uint64_t size() const override;
  absl::StatusOr<uint64_t> AllocatedSize() const override;
  io::Task<absl::Status> Close() override;

  // O_DIRECT request alignment in bytes (1 without O_DIRECT). Requests need
  // not be aligned: unaligned ones are bounced.
  uint64_t request_alignment() const;

  // The XFS extent size hint in effect on the file, read back with
  // FS_IOC_FSGETXATTR: nullopt if the filesystem has none or no hint is set.
  std::optional<uint64_t> ExtentSizeHint() const;

  // Number of extents of the file according to FIEMAP (for tests, `info`
  // and benchmarks).
  absl::StatusOr<uint64_t> ExtentCount() const;

  int fd() const;

  // True if other openers may write to or resize the file while this node
  // is open (share_all_with_others or force_share in FileOpenOptions), so
  // the file's length can change behind the node's back. False for the
  // default read-write open, which denies both (lock bytes 201 and 203;
  // another writer gets `Failed to get "write" lock`): what the
  // preallocate filter needs to own the end of the file.
  bool shares_write_or_resize() const;

  // Lets writes past the end of the data grow the file's length first, to
  // `step` bytes (rounded up to 1 MiB; at most RLIMIT_FSIZE, past which
  // ftruncate raises SIGXFSZ) past their end, with a plain ftruncate
  // (a hole: no blocks), so that O_DIRECT writes appending to a growing
  // file run in parallel: XFS and ext4 serialize a write that starts or
  // ends past the file's length (XFS waits for every write in flight and
  // zeroes the gap). size() and block status still end at the data;
  // Truncate and Close cut the file back to size(), so a closed file is as
  // long as without this. A crash leaves up to `step` + 1 MiB of hole after
  // the data, and the file marked (kGrownAheadMarker, set before the file
  // first grows ahead and removed when it is cut back; a file that cannot
  // be marked is not grown ahead). For format nodes that ignore bytes past
  // their data (qcow2 allocates from its refcounts, not from the file's
  // length), never for raw images, whose length is their disk size. A
  // no-op unless the node is a regular file opened read-write that denies
  // other writers and resizers (!shares_write_or_resize()). 0 turns it
  // off.
  void GrowLengthAhead(uint64_t step);

  // After GrowLengthAhead, for the hole a killed writer that grew ahead
  // left after the data, if the file carries kGrownAheadMarker (any other
  // hole tail, such as the discarded last clusters of a qcow2 image that
  // QEMU keeps, stays as QEMU keeps it): takes the end of the file past
  // `used_end` (bytes) that holds no data (SEEK_DATA/SEEK_HOLE; never
  // written preallocation counts as a hole) as length grown ahead, so
  // size() ends at the last data past `used_end` (at `used_end` if none)
  // and Truncate and Close cut the rest. The caller vouches that the
  // format uses nothing past `used_end`: qcow2 passes the end of its last
  // cluster with a nonzero refcount (Qcow2Node::RefcountedEnd), so images
  // whose clusters are all refcounted but holes (preallocation=metadata)
  // keep their length, and so does data after the last cluster (a failed
  // write's). Never below a write made or in flight. QEMU leaves such a
  // tail for good (qemu-img resize with preallocation then fails "Cannot
  // use preallocation for shrinking files"); a preallocating Truncate of
  // this node still fails so while it would end below the length the file
  // had (as QEMU's). A no-op without growing ahead or where lseek fails.
  void AdoptHoleTail(uint64_t used_end);
  // Whether AdoptHoleTail may take anything: after GrowLengthAhead, on a
  // file that carries kGrownAheadMarker. Test it before working out
  // `used_end` (qcow2 reads refcount blocks for it), so that opening an
  // unmarked file costs one fgetxattr(2) and no reads.
  bool MayHaveTailGrownAhead() const;

  // Write zeroes that must leave the range allocated, by fallocate only
  // (ZERO_RANGE, else punch hole + allocate, else allocate past the end of
  // the file; file-posix.md §4), growing the file if the range ends past it:
  // the preallocate filter's request (QEMU: write zeroes with NO_FALLBACK).
  // kUnimplemented where the filesystem cannot allocate (ext4 without
  // extents), after which the range still reads as zeroes but may be a
  // hole; never writes zero buffers. Other errors as WriteZeroes.
  io::Task<absl::Status> WriteZeroesAllocated(uint64_t offset,
                                              uint64_t length);

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  struct State;
  FileNode(std::string filename, bool read_only, std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Number of extents of the open file `fd` according to FIEMAP (after
// FIEMAP_FLAG_SYNC: delayed allocations are counted). Errors: the ioctl's
// errno as ErrnoStatus naming `name` ("NAME: FIEMAP: ...").
absl::StatusOr<uint64_t> FiemapExtentCount(int fd, const std::string& name);

namespace internal {
// Test hook: CreateFile calls `hook(path)` after opening (and maybe
// creating) the file and before taking its locks, so that a test can play
// the process that wins the race. Empty = none. Not thread-safe.
void SetBeforeCreateLockHookForTesting(
    std::function<void(const std::string& path)> hook);
}  // namespace internal

}  // namespace imgtool::posix_file

#endif  // IMGTOOL_POSIX_FILE_FILE_NODE_H_
