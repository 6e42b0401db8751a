// The data path of the `file` driver, shared by FileNode and CreateFile:
// reads and writes through an io::Engine with short-transfer retries and
// O_DIRECT bounce buffers, fallocate with a probed-once fallback, write
// zeroes, discard, and truncate with preallocation (file-posix.md §3-4, §6).
// Internal to posix_file.
//
// Thread model: used from the engine's thread only. Several requests may be
// in flight; O_DIRECT writes that read-modify-write padding wait for
// overlapping writes (and vice versa) so padding never overwrites new data.
#ifndef IMGTOOL_POSIX_FILE_FILE_IO_H_
#define IMGTOOL_POSIX_FILE_FILE_IO_H_

#include <sys/stat.h>

#include <coroutine>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"

namespace imgtool::posix_file::internal {

// Zero-initialised memory aligned to `alignment` (a power of two).
class AlignedBuffer {
 public:
  AlignedBuffer(uint64_t size, uint64_t alignment);
  uint8_t* data() const { return data_.get(); }
  uint64_t size() const { return size_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  uint64_t size_;
};

// O_DIRECT alignment in bytes: of file offsets and lengths, and of buffer
// addresses.
struct DioAlignment {
  uint64_t request = 1;
  uint64_t memory = 1;
};

// Finds the O_DIRECT alignment of `fd` (opened with O_DIRECT):
// XFS_IOC_DIOINFO on XFS files (as QEMU), else statx STATX_DIOALIGN, else
// BLKSSZGET for block devices, else pread probes of
// 1, 512 .. 4096 bytes on the first allocated data (a hole proves nothing;
// with no data, or if 1 byte works, max(4096, page size)). Blocking; for
// Open. kInvalidArgument "Could not find working O_DIRECT alignment".
// `use_statx` = false skips statx (tests of the fallbacks).
absl::StatusOr<DioAlignment> ProbeDioAlignment(int fd, const std::string& path,
                                               bool block_device,
                                               bool use_statx = true);

// The longest request in bytes that the block device holding a file (or,
// for a block device, the device itself) takes without splitting it: its
// queue's max_sectors_kb in sysfs (/sys/dev/block/MAJOR:MINOR, the whole
// disk's queue for a partition). `st` is the file's fstat. 0 when unknown,
// e.g. on tmpfs, overlayfs or NFS, which have no such device. Reads sysfs
// (blocking); for Open.
uint64_t ProbeMaxRequestBytes(const struct stat& st);

// An engine that makes each syscall on the calling thread inside Poll(),
// for CreateFile (which has no engine) to share FileIo's code.
std::unique_ptr<io::Engine> NewInlineEngine();

class FileIo {
 public:
  struct Config {
    int fd = -1;  // not owned
    std::string path;
    bool direct = false;   // O_DIRECT: requests need `alignment`
    DioAlignment alignment;
    bool regular_file = true;  // false: block or character device
    uint64_t logical_block_size = 512;  // block devices: BLKSSZGET
    uint64_t size = 0;     // current length in bytes
    // O_DIRECT only: ProbeMaxRequestBytes; 0 = unknown. Longer reads and
    // writes are marked io::Op::may_block (see SplitByDevice).
    uint64_t max_request = 0;
    // Name of the extended attribute the file carries while it is longer
    // than its data because this FileIo grew it ahead (set before the
    // first growth, removed by CutToSize; a crash leaves it). Null: the
    // file is never grown ahead.
    const char* grown_ahead_marker = nullptr;
  };

  FileIo(io::Engine& engine, Config config);
  FileIo(const FileIo&) = delete;
  FileIo& operator=(const FileIo&) = delete;

  // Length as this node knows it: the length at open, grown by writes and
  // write zeroes past it, set by Truncate.
  uint64_t size() const { return size_; }

  // True if writing [offset, end) may have to allocate blocks: it ends past
  // size(), or it touches a hole this FileIo made (the gap a write past the
  // end left behind, the part a Truncate without preallocation added, a
  // discarded range) that no write has filled since. Holes the file had at
  // open are not known. The hint for io::Op::may_block.
  bool MayAllocate(uint64_t offset, uint64_t end) const;

  // True if the device must split an O_DIRECT request of `length` bytes
  // (longer than Config::max_request). The other hint for
  // io::Op::may_block: submitted inline to io_uring, such requests took
  // several times longer than from worker threads. Measured on XFS on a
  // loop device (max_sectors_kb 1280, kernel 6.18), copy-on-write reads
  // of the subcluster benchmark: 2 MiB reads median 123 ms inline, 30 ms
  // from threads (IOPS 0.66 of qemu-img's before, >= 1 after); 1 MiB
  // reads (not split) equally fast either way.
  bool SplitByDevice(uint64_t length) const {
    return config_.direct && config_.max_request != 0 &&
           length > config_.max_request;
  }
  // Op::merge_limit of its reads and writes: the device's largest request
  // for O_DIRECT, else none.
  uint64_t MergeLimit() const {
    return config_.direct ? config_.max_request : 0;
  }

  // Lets writes that end past the file's length grow it first with a plain
  // ftruncate to `step` bytes past their end (rounded up to 1 MiB, at most
  // the file size limit RLIMIT_FSIZE): a hole, no blocks, so the write
  // itself lands inside the file. 0 (the default) turns it off. size()
  // stays the end of the data; CutToSize and Truncate cut the file back to
  // it. Why: an O_DIRECT write starting past the
  // file's length makes XFS take the inode lock exclusively, wait for every
  // write in flight and zero the gap (xfs_file_write_checks), and ext4
  // serializes extending writes too, so writes at the end of a growing file
  // run one at a time. Only for files whose length this node owns (regular
  // file, no other writer or resizer) and whose users ignore a hole after
  // their data, such as qcow2: a crash leaves the file up to `step` + 1 MiB
  // longer than its data, and marked (Config::grown_ahead_marker; a file
  // that cannot be marked is not grown ahead).
  void set_growth_step(uint64_t step) {
    growth_step_ = step;
    grows_ahead_ = step != 0;
  }

  // Takes the end of the file past `used_end` (bytes) that holds no data
  // (SEEK_DATA/SEEK_HOLE: holes and never written preallocation) as length
  // grown ahead, as if this FileIo had grown it: size() then ends at the
  // last data past `used_end` (or at `used_end`), and CutToSize cuts the
  // rest. For the hole a killed writer that grew ahead left after its
  // data; the caller vouches that nothing past `used_end` is in use (qcow2:
  // the end of its last cluster with a nonzero refcount). Never below a
  // write made or in flight. Only while growing ahead (set_growth_step) on
  // a regular file that carries the grown-ahead marker (a tail another
  // program left stays); nothing if lseek fails or data reaches the end. The
  // length before counts on for Truncate's preallocation check until a
  // Truncate succeeds (QEMU sees the file that long; see Truncate).
  void AdoptHoleTail(uint64_t used_end);
  // Whether AdoptHoleTail may take a tail: growing ahead on a regular file
  // that carries the grown-ahead marker. Callers test it before working
  // out `used_end`. One fgetxattr(2) unless this FileIo marked the file.
  bool MayHaveTailGrownAhead() const;

  // False for a block or character device (Config::regular_file).
  bool regular_file() const { return config_.regular_file; }

  // Cuts the file back to size() if growing ahead left it longer, and
  // removes the grown-ahead marker. Errors name the path ("ftruncate").
  absl::Status CutToSize();
  const std::string& path() const { return config_.path; }
  uint64_t request_alignment() const {
    return config_.direct ? config_.alignment.request : 1;
  }

  // Reads buf.size() bytes at `offset`; bytes past EOF read as zeroes. Any
  // alignment (bounced under O_DIRECT). Short reads are retried.
  io::Task<absl::Status> Read(uint64_t offset, io::IoVec buf);

  // Writes `data` at `offset`, growing size() if it ends past it. Any
  // alignment (bounced with read-modify-write under O_DIRECT). Short writes
  // are retried.
  io::Task<absl::Status> Write(uint64_t offset, io::ConstIoVec data);

  // fallocate(fd, mode, offset, length): 0 or -errno. EOPNOTSUPP, ENOTSUP
  // and EINVAL mark the kind of `mode` (allocate, ZERO_RANGE, PUNCH_HOLE)
  // unsupported for this file; later calls of that kind return -EOPNOTSUPP
  // without a syscall.
  io::Task<int64_t> Fallocate(int mode, uint64_t offset, uint64_t length);

  // Makes the range read as zeroes with fallocate (file-posix.md §4):
  // punch hole first if `may_unmap`, else ZERO_RANGE, else PUNCH_HOLE then
  // allocate, else allocate past EOF. kUnimplemented when none works (the
  // caller writes zero buffers). A punched hole that cannot be allocated
  // counts as done, unless `allocate` (the range must end up allocated):
  // then it is kUnimplemented.
  io::Task<absl::Status> WriteZeroes(uint64_t offset, uint64_t length,
                                     bool may_unmap, bool allocate = false);

  // Punches a hole (PUNCH_HOLE|KEEP_SIZE). kUnimplemented if unsupported.
  io::Task<absl::Status> Discard(uint64_t offset, uint64_t length);

  // fdatasync (data_only) or fsync through the engine.
  io::Task<absl::Status> Sync(bool data_only);

  // Sets the length to `new_size` backing new bytes per `mode`
  // (file-posix.md §3): off = ftruncate + first-block write when growing an
  // empty file; falloc = fallocate from the old length (no ftruncate first),
  // falling back to zero writes of <= 1 MiB each (one write per filesystem
  // block at most, no reads); full = ftruncate, zero writes, fsync. On
  // failure the old length is restored. A preallocating Truncate below the
  // file's length is kInvalidArgument "Cannot use preallocation for
  // shrinking files"; that length is the one QEMU would see: without the
  // length grown ahead, with a tail taken by AdoptHoleTail. Block and
  // character devices keep
  // their length and take only kOff: `exact` (resize) accepts only the
  // current length (else kUnimplemented "Cannot resize device files"),
  // !exact (create) any length up to it (else kInvalidArgument "Cannot grow
  // device files"). Errors name the path.
  io::Task<absl::Status> Truncate(uint64_t new_size, io::PreallocMode mode,
                                  bool exact);

 private:
  // An O_DIRECT write in flight. Lives in the writing coroutine's frame
  // (no allocation per write) and is linked into inflight_ from BeginWrite
  // to EndWrite.
  struct InflightWrite {
    uint64_t start;        // range the syscall covers (aligned)
    uint64_t end;
    bool rmw;              // writes padding read before
    uint64_t wanted_end;   // end of the caller's data
    InflightWrite* prev = nullptr;
    InflightWrite* next = nullptr;
  };
  struct WaitForWrites;

  bool NeedsBounce(uint64_t offset, uint64_t length, const void* p) const;
  io::Task<absl::Status> ReadPlain(uint64_t offset, uint8_t* buf,
                                   uint64_t length);
  // `data_end`: where the caller's data ends when [offset, offset +
  // length) has padding after it (see written_end_).
  io::Task<absl::Status> WritePlain(uint64_t offset, const uint8_t* data,
                                    uint64_t length,
                                    uint64_t data_end = UINT64_MAX);
  io::Task<absl::Status> WriteDirect(uint64_t offset, const uint8_t* data,
                                     uint64_t length);
  io::Task<absl::Status> WriteZeroBuffers(uint64_t start, uint64_t end);
  io::Task<void> WriteFirstBlock(uint64_t new_size);
  // Whether [start, end) overlaps a write in flight that must not run
  // beside it: one of the two reads and writes padding (`rmw`). Without an
  // rmw write in flight, a plain write never conflicts (no scan).
  bool Conflicts(uint64_t start, uint64_t end, bool rmw) const;
  // Links `w` into inflight_ / unlinks it and wakes the writes waiting.
  void BeginWrite(InflightWrite& w);
  void EndWrite(InflightWrite& w);
  absl::Status ExtendTo(uint64_t end);
  // Grows the file ahead of a write ending at `end` (see set_growth_step),
  // never past RLIMIT_FSIZE (SIGXFSZ would kill the process). A failed
  // ftruncate is ignored: the write then grows the file itself.
  void GrowAhead(uint64_t end);
  // The furthest end a write syscall reached or a Write in flight will
  // reach (written_end_, issued_ends_): growing ahead is never cut below it.
  uint64_t WrittenOrIssuedEnd() const;
  // Bookkeeping after [offset, end) was written: a gap between size_ and
  // `offset` becomes a known hole, [offset, end) stops being one, and size_
  // grows to `end`.
  void NoteWritten(uint64_t offset, uint64_t end);
  void AddHole(uint64_t offset, uint64_t end);
  void RemoveHoles(uint64_t offset, uint64_t end);
  absl::Status TrimPadding(uint64_t written_end);
  // A syscall failure `st` as "<path>: <operation>: <strerror>" (QEMU's
  // wording for preallocation steps); other statuses unchanged.
  absl::Status Reword(const absl::Status& st,
                      absl::string_view operation) const;

  io::Engine& engine_;
  Config config_;
  uint64_t size_;
  // The file's length (st_size) as this FileIo left it: >= size_, more only
  // while growing ahead.
  uint64_t length_;
  uint64_t growth_step_ = 0;  // 0 also while Truncate runs
  // size_ before AdoptHoleTail took a tail (0: none), until a Truncate
  // succeeds: the length QEMU would see, for Truncate's check.
  uint64_t adopted_length_ = 0;
  // set_growth_step was given a step (Truncate's pause does not change it).
  bool grows_ahead_ = false;
  // The file carries the grown-ahead marker (set before growing ahead,
  // found by AdoptHoleTail; CutToSize removes it).
  bool marked_ = false;
  // Ends of the data of the Writes in flight (size_ grows only when one
  // completes), kept only when grows_ahead_ (a map node per write
  // otherwise, on every write of every file); CutToSize never cuts below
  // them.
  std::multiset<uint64_t> issued_ends_;
  // Furthest end of the data write syscalls reached, also of a write that
  // then failed: where the file would end without growing ahead (and where
  // QEMU leaves it); CutToSize never cuts below it.
  uint64_t written_end_ = 0;
  bool allocate_supported_ = true;
  bool zero_range_supported_ = true;
  bool punch_hole_supported_ = true;
  // Known holes below size_, start -> end, disjoint (see MayAllocate). At
  // most kMaxKnownHoles; more are not recorded (a hint only).
  std::map<uint64_t, uint64_t> holes_;
  // O_DIRECT writes in flight (intrusive, newest first), and how many of
  // them are rmw.
  InflightWrite* inflight_ = nullptr;
  uint64_t rmw_in_flight_ = 0;
  std::vector<std::coroutine_handle<>> waiters_;
};

}  // namespace imgtool::posix_file::internal

#endif  // IMGTOOL_POSIX_FILE_FILE_IO_H_
