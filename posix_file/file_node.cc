#include "posix_file/file_node.h"

#include <fcntl.h>
#include <linux/fiemap.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "posix_file/file_io.h"
#include "posix_file/file_lock.h"

namespace imgtool::posix_file {
namespace {

constexpr uint64_t kDefaultExtentSizeHint = uint64_t{1} << 20;
constexpr uint64_t kMaxExtentSizeHint = 0xffffffffULL;
// Longest node QEMU accepts: INT64_MAX rounded down to 1 GiB (its largest
// request alignment), BDRV_MAX_LENGTH.
constexpr uint64_t kMaxLength = (uint64_t{1} << 63) - (uint64_t{1} << 30);

struct CacheMode {
  int open_flags = 0;
  bool no_flush = false;
};

absl::StatusOr<CacheMode> ParseCacheMode(const std::string& name) {
  if (name.empty() || name == "writeback") return CacheMode{};
  if (name == "none") return CacheMode{O_DIRECT, false};
  if (name == "writethrough") return CacheMode{O_DSYNC, false};
  if (name == "directsync") return CacheMode{O_DIRECT | O_DSYNC, false};
  if (name == "unsafe") return CacheMode{0, true};
  return absl::InvalidArgumentError(
      absl::StrCat("Invalid cache option: ", name));
}

absl::StatusOr<io::PreallocMode> ParseCreatePrealloc(const std::string& path,
                                                     const std::string& name) {
  if (name.empty() || name == "off") return io::PreallocMode::kOff;
  if (name == "falloc") return io::PreallocMode::kFalloc;
  if (name == "full") return io::PreallocMode::kFull;
  if (name == "metadata") {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": Unsupported preallocation mode: metadata"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": invalid parameter value: ", name));
}

// Sets FS_NOCOW_FL (btrfs); failures are ignored (file-posix.md §1).
void SetNoCow(int fd) {
  int attr = 0;
  if (ioctl(fd, FS_IOC_GETFLAGS, &attr) == 0) {
    attr |= FS_NOCOW_FL;
    (void)ioctl(fd, FS_IOC_SETFLAGS, &attr);
  }
}

// Sets the XFS extent size hint; returns 0 or the errno of the failed ioctl.
int SetExtentSizeHint(int fd, uint64_t hint) {
  struct fsxattr attr = {};
  if (ioctl(fd, FS_IOC_FSGETXATTR, &attr) != 0) return errno;
  attr.fsx_xflags |= FS_XFLAG_EXTSIZE;
  attr.fsx_extsize = static_cast<uint32_t>(hint);
  if (ioctl(fd, FS_IOC_FSSETXATTR, &attr) != 0) return errno;
  return 0;
}

// Closes `fd` and, if `created`, removes `path` (a failed create leaves no
// new file behind). Only for a file whose locks we hold: `path` is removed
// only while it still names the file `fd` is open on.
void AbandonCreate(int fd, const std::string& path, bool created) {
  struct stat ours, now;
  if (created && fstat(fd, &ours) == 0 && stat(path.c_str(), &now) == 0 &&
      ours.st_dev == now.st_dev && ours.st_ino == now.st_ino) {
    unlink(path.c_str());
  }
  close(fd);
}

// Create on a block or character device (QEMU's host_device create): the
// length stays, `size` may not exceed it ("Cannot grow device files"), and
// the first sector is zeroed so no old image header is found there again.
absl::Status CreateOnDevice(int fd, const std::string& path, uint64_t size) {
  const off_t end = lseek(fd, 0, SEEK_END);
  if (end < 0) return ErrnoStatus(path, "lseek", errno);
  internal::FileIo::Config config{.fd = fd,
                                  .path = path,
                                  .regular_file = false,
                                  .size = static_cast<uint64_t>(end)};
  int sector = 0;
  if (ioctl(fd, BLKSSZGET, &sector) == 0 && sector > 0) {
    config.logical_block_size = static_cast<uint64_t>(sector);
  }
  std::unique_ptr<io::Engine> engine = internal::NewInlineEngine();
  internal::FileIo file_io(*engine, std::move(config));
  RETURN_IF_ERROR(io::RunSync(
      *engine, file_io.Truncate(size, io::PreallocMode::kOff, /*exact=*/false)));
  const uint64_t clear = std::min<uint64_t>(static_cast<uint64_t>(end), 512);
  if (clear == 0) return absl::OkStatus();
  absl::Status st =
      io::RunSync(*engine, file_io.WriteZeroes(0, clear, /*may_unmap=*/true));
  if (absl::IsUnimplemented(st)) {
    const std::vector<uint8_t> zeroes(clear, 0);
    st = io::RunSync(*engine,
                     file_io.Write(0, io::ConstIoVec(zeroes.data(), clear)));
  }
  if (const int error_number = StatusErrno(st); error_number != 0) {
    return ErrnoStatus(path, "Failed to clear the new image's first sector",
                       error_number);
  }
  return st;
}

std::function<void(const std::string&)>& BeforeCreateLockHook() {
  static auto* hook = new std::function<void(const std::string&)>();
  return *hook;
}

}  // namespace

namespace internal {
void SetBeforeCreateLockHookForTesting(
    std::function<void(const std::string& path)> hook) {
  BeforeCreateLockHook() = std::move(hook);
}
}  // namespace internal

absl::Status CreateFile(const std::string& path,
                        const FileCreateOptions& options,
                        std::ostream* warnings) {
  ASSIGN_OR_RETURN(io::PreallocMode prealloc,
                   ParseCreatePrealloc(path, options.preallocation()));
  const bool explicit_hint = options.has_extent_size_hint();
  const uint64_t hint =
      explicit_hint ? options.extent_size_hint() : kDefaultExtentSizeHint;
  if (hint > kMaxExtentSizeHint) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": Extent size hint is too large"));
  }
  if (options.size() > (uint64_t{1} << 63) - 512) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: Image size %u is too large", path, options.size()));
  }
  const uint64_t size = (options.size() + 511) / 512 * 512;

  // O_EXCL first to know whether a failure must remove the file.
  bool created = true;
  int fd = open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0 && errno == EEXIST) {
    created = false;
    fd = open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  }
  if (fd < 0) return ErrnoStatus(path, "Could not create", errno);
  struct stat file_stat;
  if (fstat(fd, &file_stat) != 0) {
    absl::Status st = ErrnoStatus(path, "fstat", errno);
    AbandonCreate(fd, path, created);
    return st;
  }
  const bool regular_file = S_ISREG(file_stat.st_mode);
  if (!regular_file && prealloc != io::PreallocMode::kOff) {
    close(fd);
    return absl::UnimplementedError(
        absl::StrFormat("%s: Unsupported preallocation mode '%s'", path,
                        io::PreallocModeName(prealloc)));
  }

  if (BeforeCreateLockHook()) BeforeCreateLockHook()(path);
  // Locks before touching the content: an image in use stays intact. A file
  // whose locks we cannot take is never removed, even one we created just
  // now: another process has opened it since and owns it.
  absl::StatusOr<bool> locked =
      internal::LockImage(fd, path, internal::kCreatePerms,
                          internal::LockingMode::kAuto, warnings);
  if (!locked.ok()) {
    close(fd);
    return locked.status();
  }
  if (!regular_file) {
    absl::Status st = CreateOnDevice(fd, path, size);
    if (close(fd) != 0 && st.ok()) st = ErrnoStatus(path, "close", errno);
    return st;
  }
  if (ftruncate(fd, 0) != 0) {
    absl::Status st = ErrnoStatus(path, "Could not resize file", errno);
    AbandonCreate(fd, path, created);
    return st;
  }
  // A new image has no tail grown ahead (a killed writer's marker goes).
  if (!created) fremovexattr(fd, kGrownAheadMarker);
  if (options.nocow()) SetNoCow(fd);
  // extent_size_hint=0 still clears any hint; only an explicit non-zero
  // hint warns on failure.
  if (int err = SetExtentSizeHint(fd, hint);
      err != 0 && explicit_hint && hint != 0 && warnings != nullptr) {
    *warnings << "Failed to set extent size hint: " << std::strerror(err)
              << "\n";
  }

  std::unique_ptr<io::Engine> engine = internal::NewInlineEngine();
  internal::FileIo file_io(*engine, internal::FileIo::Config{
                                        .fd = fd, .path = path, .size = 0});
  absl::Status st = io::RunSync(
      *engine, file_io.Truncate(size, prealloc, /*exact=*/false));
  if (!st.ok()) {
    AbandonCreate(fd, path, created);
    return st;
  }
  // A failed close released the locks already: the file is left as it is.
  if (close(fd) != 0) return ErrnoStatus(path, "close", errno);
  return absl::OkStatus();
}

struct FileNode::State {
  State(io::Engine& engine, internal::FileIo::Config config)
      : engine(engine), fd(config.fd), io(engine, std::move(config)) {}
  ~State() {
    if (fd >= 0) internal::UnlockAndClose(fd);
  }

  io::Engine& engine;
  int fd;
  internal::FileIo io;
  bool direct = false;
  bool no_flush = false;
  bool locked = false;  // image locks are held on fd
  internal::LockingMode locking = internal::LockingMode::kAuto;
  uint8_t held = 0;  // internal::Perm bits locked on bytes 100 + bit
  bool share_all = false;  // others may write and resize (no 2xx bytes)
  int flush_errno = 0;       // sticky fdatasync failure (without O_DIRECT)
  uint64_t write_gen = 0;    // bumped when a change ends
  uint64_t flushed_gen = 0;  // write_gen covered by the last good flush
  // The last data extent found by block status ([start, end)); valid until
  // something may turn data into a hole (discard, zeroes, truncate).
  bool extent_valid = false;
  uint64_t extent_start = 0;
  uint64_t extent_end = 0;
  // Where the last hole found by block status ended: SEEK_DATA's answer, so
  // the byte there is data (same validity). A walk asks there next and
  // needs only SEEK_HOLE then: measure on a raw file of 100,000 extents
  // made 175,000 lseek calls, 2 per data extent.
  bool data_at_valid = false;
  uint64_t data_at = 0;

  void ForgetExtent(uint64_t offset, uint64_t length) {
    if (extent_valid && offset < extent_end && extent_start < offset + length) {
      extent_valid = false;
    }
    if (data_at_valid && offset <= data_at && data_at - offset < length) {
      data_at_valid = false;
    }
  }
};

absl::StatusOr<std::unique_ptr<FileNode>> FileNode::Open(
    io::Engine& engine, const FileOpenOptions& options,
    std::ostream* warnings) {
  const std::string& path = options.filename();
  if (path.empty()) {
    return absl::InvalidArgumentError(
        "The 'file' block driver requires a file name");
  }
  ASSIGN_OR_RETURN(CacheMode cache, ParseCacheMode(options.cache()));
  ASSIGN_OR_RETURN(internal::LockingMode locking,
                   internal::ParseLockingMode(options.locking()));
  if (options.force_share() && !options.read_only()) {
    // QEMU's words, without the file name (the caller names the image).
    return absl::InvalidArgumentError(
        "force-share=on can only be used with read-only images");
  }
  const std::string driver =
      options.driver().empty() ? "file" : options.driver();
  if (driver != "file" && driver != "host_device" && driver != "host_cdrom") {
    return absl::InvalidArgumentError(
        absl::StrCat("Unknown driver '", driver, "'"));
  }
  const bool device_driver = driver != "file";
  const bool read_only = options.read_only();
  int fd = open(path.c_str(),
                (read_only ? O_RDONLY : O_RDWR) | O_CLOEXEC | cache.open_flags |
                    (driver == "host_cdrom" ? O_NONBLOCK : 0));
  if (fd < 0) return ErrnoStatus(path, "Could not open", errno);

  internal::FileIo::Config config{.fd = fd, .path = path};
  config.grown_ahead_marker = kGrownAheadMarker;
  auto fail = [fd](absl::Status st) {
    close(fd);
    return st;
  };
  struct stat st;
  if (fstat(fd, &st) != 0) {
    return fail(ErrnoStatus("", "Could not stat file", errno));
  }
  // QEMU's check_hdev_writable, right after the open: a block device set
  // read-only (blockdev --setro) opens O_RDWR but fails every write.
  if (!read_only && S_ISBLK(st.st_mode)) {
    int device_read_only = 0;
    if (ioctl(fd, BLKROGET, &device_read_only) != 0) {
      return fail(ErrnoStatus("", "The device is not writable", errno));
    }
    if (device_read_only != 0) {
      return fail(ErrnoStatus("", "The device is not writable", EACCES));
    }
  }
  // A read-write open(2) of a directory failed with EISDIR already.
  if (!device_driver && !S_ISREG(st.st_mode)) {
    return fail(absl::InvalidArgumentError(absl::StrCat(
        "'", driver, "' driver requires '", path, "' to be a regular file")));
  }
  if (device_driver && !S_ISCHR(st.st_mode) && !S_ISBLK(st.st_mode)) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("'", driver, "' driver requires '", path,
                     "' to be either a character or block device")));
  }
  config.regular_file = S_ISREG(st.st_mode);
  const bool block_device = S_ISBLK(st.st_mode);
  if (config.regular_file) {
    config.size = static_cast<uint64_t>(st.st_size);
  } else {
    off_t end = lseek(fd, 0, SEEK_END);
    if (end < 0) return fail(ErrnoStatus(path, "lseek", errno));
    config.size = static_cast<uint64_t>(end);
  }
  // QEMU's block layer refuses nodes longer than BDRV_MAX_LENGTH once the
  // length is rounded up to sectors (XFS files can be up to 2^63 - 1).
  if ((config.size + 511) / 512 * 512 > kMaxLength) {
    return fail(ErrnoStatus("", "Could not refresh total sector count", EFBIG));
  }
  if (block_device) {
    int sector = 0;
    if (ioctl(fd, BLKSSZGET, &sector) == 0 && sector > 0) {
      config.logical_block_size = static_cast<uint64_t>(sector);
    }
  }

  const bool share_all = options.force_share() || options.share_all_with_others();
  internal::LockPerms perms;
  if (read_only) {
    perms = share_all ? internal::kForceSharePerms : internal::kReadOnlyPerms;
  } else {
    perms = share_all ? internal::kShareAllReadWritePerms
                      : internal::kReadWritePerms;
  }
  absl::StatusOr<bool> locked =
      internal::LockImage(fd, path, perms, locking, warnings);
  if (!locked.ok()) return fail(locked.status());

  config.direct = (cache.open_flags & O_DIRECT) != 0;
  if (config.direct) {
    absl::StatusOr<internal::DioAlignment> alignment =
        internal::ProbeDioAlignment(fd, path, block_device);
    if (!alignment.ok()) return fail(alignment.status());
    config.alignment = *alignment;
    config.max_request = internal::ProbeMaxRequestBytes(st);
  }

  auto state = std::make_unique<State>(engine, std::move(config));
  state->direct = (cache.open_flags & O_DIRECT) != 0;
  state->no_flush = cache.no_flush;
  state->locked = *locked;
  state->locking = locking;
  state->held = perms.held;
  state->share_all = share_all;
  return std::unique_ptr<FileNode>(
      new FileNode(path, read_only, std::move(state)));
}

FileNode::FileNode(std::string filename, bool read_only,
                   std::unique_ptr<State> state)
    : io::BlockNode(std::move(filename), read_only), state_(std::move(state)) {}

FileNode::~FileNode() {
  // A node dropped without Close (an open that failed half way) still
  // gives back the length it grew ahead; best effort, as Close reports.
  if (state_->fd >= 0 && !read_only()) state_->io.CutToSize().IgnoreError();
}

uint64_t FileNode::size() const { return state_->io.size(); }

absl::StatusOr<uint64_t> FileNode::AllocatedSize() const {
  struct stat st;
  if (fstat(state_->fd, &st) != 0) return ErrnoStatus(filename(), "fstat", errno);
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

io::Task<absl::Status> FileNode::Close() {
  if (state_->fd < 0) co_return absl::OkStatus();
  absl::Status result;
  if (!read_only()) result = state_->io.CutToSize();
  if (!read_only() && state_->write_gen != state_->flushed_gen) {
    absl::Status flushed = co_await DoFlush();
    if (result.ok()) result = flushed;
  }
  if (internal::UnlockAndClose(state_->fd) != 0 && result.ok()) {
    result = ErrnoStatus(filename(), "close", errno);
  }
  state_->fd = -1;
  co_return result;
}

uint64_t FileNode::request_alignment() const {
  return state_->io.request_alignment();
}

std::optional<uint64_t> FileNode::ExtentSizeHint() const {
  struct fsxattr attr = {};
  if (ioctl(state_->fd, FS_IOC_FSGETXATTR, &attr) != 0) return std::nullopt;
  if ((attr.fsx_xflags & FS_XFLAG_EXTSIZE) == 0 || attr.fsx_extsize == 0) {
    return std::nullopt;
  }
  return attr.fsx_extsize;
}

absl::StatusOr<uint64_t> FiemapExtentCount(int fd, const std::string& name) {
  struct fiemap fm = {};
  fm.fm_start = 0;
  fm.fm_length = FIEMAP_MAX_OFFSET;
  fm.fm_flags = FIEMAP_FLAG_SYNC;
  fm.fm_extent_count = 0;  // count only
  if (ioctl(fd, FS_IOC_FIEMAP, &fm) != 0) {
    return ErrnoStatus(name, "FIEMAP", errno);
  }
  return fm.fm_mapped_extents;
}

absl::StatusOr<uint64_t> FileNode::ExtentCount() const {
  return FiemapExtentCount(state_->fd, filename());
}

int FileNode::fd() const { return state_->fd; }

bool FileNode::shares_write_or_resize() const { return state_->share_all; }

void FileNode::GrowLengthAhead(uint64_t step) {
  if (read_only() || state_->share_all || state_->fd < 0) return;
  state_->io.set_growth_step(step);
}

void FileNode::AdoptHoleTail(uint64_t used_end) {
  if (state_->fd < 0) return;
  state_->io.AdoptHoleTail(used_end);
}

bool FileNode::MayHaveTailGrownAhead() const {
  return state_->fd >= 0 && state_->io.MayHaveTailGrownAhead();
}

io::Task<absl::Status> FileNode::DoRead(uint64_t offset, io::IoVec buf) {
  co_return co_await state_->io.Read(offset, buf);
}

io::Task<absl::Status> FileNode::DoWrite(uint64_t offset, io::ConstIoVec data) {
  // Counted when it ends, with any outcome (QEMU's bdrv_co_write_req_finish):
  // a flush that started while it was in flight does not cover it.
  absl::Status st = co_await state_->io.Write(offset, data);
  ++state_->write_gen;
  co_return st;
}

io::Task<absl::Status> FileNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                               io::WriteZeroesFlags flags) {
  state_->ForgetExtent(offset, length);
  absl::Status st =
      co_await state_->io.WriteZeroes(offset, length, flags.may_unmap);
  // Only a zero write that succeeded counts (as a truncate, see DoTruncate).
  if (st.ok()) ++state_->write_gen;
  co_return st;
}

io::Task<absl::Status> FileNode::WriteZeroesAllocated(uint64_t offset,
                                                      uint64_t length) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  if (length == 0) co_return absl::OkStatus();
  state_->ForgetExtent(offset, length);
  absl::Status st = co_await state_->io.WriteZeroes(
      offset, length, /*may_unmap=*/false, /*allocate=*/true);
  if (st.ok()) ++state_->write_gen;
  co_return st;
}

io::Task<absl::Status> FileNode::DoDiscard(uint64_t offset, uint64_t length) {
  state_->ForgetExtent(offset, length);
  absl::Status st = co_await state_->io.Discard(offset, length);
  if (st.ok()) ++state_->write_gen;
  co_return st;
}

io::Task<absl::Status> FileNode::DoFlush() {
  if (state_->no_flush) co_return absl::OkStatus();
  if (state_->flush_errno != 0) {
    co_return ErrnoStatus(filename(), "fdatasync", state_->flush_errno);
  }
  // Nothing ended since the last good flush started: no fdatasync (QEMU's
  // bdrv_co_flush skips the driver when flushed_gen == write_gen). A kill
  // keeps the page cache, so only a power loss could tell the difference,
  // and the earlier flush already covered every change.
  const uint64_t gen = state_->write_gen;
  if (gen == state_->flushed_gen) co_return absl::OkStatus();
  absl::Status st = co_await state_->io.Sync(/*data_only=*/true);
  if (!st.ok()) {
    // Without O_DIRECT the page cache state is unknown after a failed
    // fdatasync: every later flush fails the same way.
    if (!state_->direct) state_->flush_errno = StatusErrno(st);
    co_return st;
  }
  state_->flushed_gen = gen;
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileNode::DoTruncate(uint64_t size,
                                            io::PreallocMode prealloc) {
  // A node that shares everything takes the resize permission only now,
  // as QEMU does when a raw image is first truncated.
  if (state_->locked && (state_->held & internal::kPermResize) == 0) {
    const internal::LockPerms resize = {internal::kPermResize, 0};
    absl::StatusOr<bool> locked = internal::LockImage(
        state_->fd, filename(), resize, state_->locking, nullptr);
    if (!locked.ok()) {
      internal::UnlockImage(state_->fd, resize);
      co_return locked.status();
    }
    state_->held |= internal::kPermResize;
  }
  state_->extent_valid = false;
  state_->data_at_valid = false;
  absl::Status st =
      co_await state_->io.Truncate(size, prealloc, /*exact=*/true);
  // As QEMU's bdrv_co_truncate: only a truncate that succeeded counts as a
  // write, so a refused one (a device) leaves close nothing to flush.
  if (st.ok()) ++state_->write_gen;
  co_return st;
}

io::Task<absl::StatusOr<io::BlockStatus>> FileNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  io::BlockStatus status;
  status.offset_valid = true;
  status.host_offset = offset;
  status.file = this;
  const uint64_t end = size();
  State& s = *state_;
  auto data = [&](uint64_t length) {
    status.data = true;
    status.zero = false;
    status.length = length;
    return status;
  };
  // QEMU's host_device has no block status: the block layer answers data,
  // with its offset, for the whole range.
  if (!state_->io.regular_file()) co_return data(max_length);
  auto hole = [&](uint64_t length) {
    status.data = false;
    status.zero = true;
    status.length = length;
    return status;
  };
  if (s.extent_valid && s.extent_start <= offset && offset < s.extent_end) {
    co_return data(s.extent_end - offset);
  }
  // file-posix.md §5: SEEK_DATA then SEEK_HOLE; anything unexpected is data.
  // SEEK_DATA is skipped where the last hole ended (data there).
  if (!s.data_at_valid || s.data_at != offset) {
    off_t d = lseek(s.fd, static_cast<off_t>(offset), SEEK_DATA);
    if (d < 0) {
      if (errno == ENXIO) {
        co_return hole(end > offset ? end - offset : max_length);
      }
      co_return data(max_length);
    }
    if (static_cast<uint64_t>(d) > offset) {
      s.data_at_valid = true;
      s.data_at = static_cast<uint64_t>(d);
      co_return hole(d - offset);
    }
    if (static_cast<uint64_t>(d) < offset) co_return data(max_length);
  }
  off_t h = lseek(s.fd, static_cast<off_t>(offset), SEEK_HOLE);
  if (h < 0 || static_cast<uint64_t>(h) <= offset) co_return data(max_length);
  s.extent_valid = true;
  s.extent_start = offset;
  s.extent_end = static_cast<uint64_t>(h);
  co_return data(s.extent_end - offset);
}

}  // namespace imgtool::posix_file
