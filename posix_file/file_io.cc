#include "posix_file/file_io.h"

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/uio.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <new>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/thread_pool_engine.h"

namespace imgtool::posix_file::internal {
namespace {

// Largest single syscall transfer (Linux caps one at 0x7ffff000 bytes).
constexpr uint64_t kMaxTransfer = uint64_t{1} << 30;
// Largest bounce buffer for one piece of an unaligned O_DIRECT request.
constexpr uint64_t kMaxBounce = uint64_t{1} << 20;
// Zero buffer size for preallocation and the zero-write fallback.
constexpr uint64_t kZeroChunk = uint64_t{1} << 20;
// Growing ahead rounds the new length up to this.
constexpr uint64_t kGrowthAlign = uint64_t{1} << 20;
// Most holes FileIo keeps track of for MayAllocate (a map node of about 64
// bytes each, so at most about 4 MiB).
constexpr size_t kMaxKnownHoles = size_t{1} << 16;

// Alignments here need not be powers of two.
constexpr uint64_t RoundDownTo(uint64_t v, uint64_t a) { return v - v % a; }
constexpr uint64_t RoundUpTo(uint64_t v, uint64_t a) {
  return RoundDownTo(v + a - 1, a);
}

uint64_t PageSize() {
  long page = sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<uint64_t>(page) : 4096;
}

bool IsUnsupportedErrno(int err) {
  return err == EOPNOTSUPP || err == ENOTSUP || err == EINVAL;
}

// The kernel's struct statx (include/uapi/linux/stat.h), declared here so
// that older C library headers without stx_dio_* still build.
struct KernelStatx {
  uint32_t mask;
  uint32_t blksize;
  uint64_t attributes;
  uint32_t nlink, uid, gid;
  uint16_t mode, spare0;
  uint64_t ino, size, blocks, attributes_mask;
  uint8_t times[4][16];
  uint32_t rdev_major, rdev_minor, dev_major, dev_minor;
  uint64_t mnt_id;
  uint32_t dio_mem_align;
  uint32_t dio_offset_align;
  uint64_t spare3[12];
};
static_assert(sizeof(KernelStatx) == 256);
static_assert(offsetof(KernelStatx, dio_mem_align) == 152);
constexpr uint32_t kStatxDioAlign = 0x2000;  // STATX_DIOALIGN

// XFS_IOC_DIOINFO (xfs/xfs_fs.h), declared here so that the build does not
// need xfslibs-dev.
struct XfsDioAttr {
  uint32_t d_mem;      // buffer address alignment
  uint32_t d_miniosz;  // smallest I/O size and offset alignment
  uint32_t d_maxiosz;
};
constexpr unsigned long kXfsIocDioInfo = _IOR('X', 30, XfsDioAttr);

// True if `fd` accepts an O_DIRECT read of `length` bytes at `offset` into
// `buf` (only EINVAL means misaligned, as QEMU does).
bool DirectReadWorks(int fd, uint8_t* buf, uint64_t length, uint64_t offset) {
  ssize_t r;
  do {
    r = pread(fd, buf, length, static_cast<off_t>(offset));
  } while (r < 0 && errno == EINTR);
  return r >= 0 || errno != EINVAL;
}

class InlineEngine : public io::Engine {
 public:
  void Submit(io::Op* op) override { queue_.push_back(op); }
  absl::Status Poll(bool) override {
    while (!queue_.empty()) {
      io::Op* op = queue_.front();
      queue_.pop_front();
      io::ExecuteOpBlocking(op);
      auto done = std::move(op->done);
      if (done) done(*op);
    }
    return absl::OkStatus();
  }
  uint64_t in_flight() const override { return queue_.size(); }
  const char* name() const override { return "inline"; }

 private:
  std::deque<io::Op*> queue_;
};

}  // namespace

AlignedBuffer::AlignedBuffer(uint64_t size, uint64_t alignment)
    : size_(size) {
  alignment = std::max<uint64_t>(alignment, sizeof(void*));
  void* p = nullptr;
  if (posix_memalign(&p, alignment, std::max<uint64_t>(size, 1)) != 0) {
    throw std::bad_alloc();
  }
  std::memset(p, 0, size);
  data_.reset(static_cast<uint8_t*>(p));
}

absl::StatusOr<DioAlignment> ProbeDioAlignment(int fd, const std::string& path,
                                               bool block_device,
                                               bool use_statx) {
  // QEMU asks XFS first (file-posix.md §6: XFS_IOC_DIOINFO, 512 on a
  // 512-byte-sector device). Newer kernels' statx says 4096 (the block
  // size) for XFS, which would bounce every sub-block write through a
  // read-modify-write that QEMU does not do.
  XfsDioAttr dio = {};
  if (!block_device && ioctl(fd, kXfsIocDioInfo, &dio) == 0 &&
      dio.d_miniosz != 0) {
    return DioAlignment{dio.d_miniosz, std::max<uint64_t>(dio.d_mem, 1)};
  }
  KernelStatx stx = {};
  if (use_statx &&
      syscall(SYS_statx, fd, "", AT_EMPTY_PATH, kStatxDioAlign, &stx) == 0 &&
      (stx.mask & kStatxDioAlign) != 0 && stx.dio_offset_align != 0) {
    return DioAlignment{stx.dio_offset_align,
                        std::max<uint64_t>(stx.dio_mem_align, 1)};
  }
  if (block_device) {
    int sector = 0;
    if (ioctl(fd, BLKSSZGET, &sector) == 0 && sector > 0) {
      return DioAlignment{static_cast<uint64_t>(sector),
                          static_cast<uint64_t>(sector)};
    }
  }
  const uint64_t fallback = std::max<uint64_t>(4096, PageSize());
  off_t data = lseek(fd, 0, SEEK_DATA);
  if (data < 0) return DioAlignment{fallback, fallback};  // no data to probe
  AlignedBuffer buf(2 * fallback, fallback);
  static constexpr uint64_t kSizes[] = {1, 512, 1024, 2048, 4096};
  uint64_t request = 0;
  for (uint64_t len : kSizes) {
    if (DirectReadWorks(fd, buf.data(), len, data)) {
      request = len == 1 ? fallback : len;
      break;
    }
  }
  uint64_t memory = 0;
  if (request != 0) {
    for (uint64_t shift : kSizes) {
      if (DirectReadWorks(fd, buf.data() + shift, request, data)) {
        memory = shift == 1 ? request : shift;
        break;
      }
    }
  }
  if (request == 0 || memory == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        path, ": Could not find working O_DIRECT alignment\n"
              "Try cache.direct=off"));
  }
  return DioAlignment{request, memory};
}

uint64_t ProbeMaxRequestBytes(const struct stat& st) {
  const dev_t dev = S_ISBLK(st.st_mode) ? st.st_rdev : st.st_dev;
  const std::string device =
      absl::StrFormat("/sys/dev/block/%u:%u", major(dev), minor(dev));
  // A partition has no queue of its own: its disk is the parent directory.
  for (const char* queue : {"/queue", "/../queue"}) {
    std::ifstream in(device + queue + "/max_sectors_kb");
    uint64_t kib = 0;
    if (in >> kib && kib > 0) return kib << 10;
  }
  return 0;
}

std::unique_ptr<io::Engine> NewInlineEngine() {
  return std::make_unique<InlineEngine>();
}

// Suspends until some tracked write ends.
struct FileIo::WaitForWrites {
  FileIo& io;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) { io.waiters_.push_back(h); }
  void await_resume() const noexcept {}
};

FileIo::FileIo(io::Engine& engine, Config config)
    : engine_(engine),
      config_(std::move(config)),
      size_(config_.size),
      length_(config_.size) {
  if (!config_.direct) config_.alignment = DioAlignment{};
}

bool FileIo::NeedsBounce(uint64_t offset, uint64_t length,
                         const void* p) const {
  if (!config_.direct) return false;
  const uint64_t ra = config_.alignment.request;
  const uint64_t ma = config_.alignment.memory;
  return offset % ra != 0 || length % ra != 0 ||
         reinterpret_cast<uintptr_t>(p) % ma != 0;
}

io::Task<absl::Status> FileIo::ReadPlain(uint64_t offset, uint8_t* buf,
                                         uint64_t length) {
  uint64_t done = 0;
  while (done < length) {
    struct iovec iov = {buf + done, std::min(length - done, kMaxTransfer)};
    io::Op op{.kind = io::OpKind::kRead,
              .fd = config_.fd,
              .iov = &iov,
              .iovcnt = 1,
              .offset = offset + done,
              .may_block = SplitByDevice(iov.iov_len),
              .merge_limit = MergeLimit()};
    int64_t r = co_await engine_.Run(op);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) co_return ErrnoStatus(config_.path, "preadv", static_cast<int>(-r));
    if (r == 0) break;  // end of file
    done += static_cast<uint64_t>(r);
    // A short O_DIRECT read ending unaligned is the end of the file.
    if (config_.direct && (offset + done) % config_.alignment.request != 0) {
      break;
    }
  }
  if (done < length) std::memset(buf + done, 0, length - done);
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileIo::WritePlain(uint64_t offset, const uint8_t* data,
                                          uint64_t length, uint64_t data_end) {
  GrowAhead(offset + length);
  uint64_t done = 0;
  while (done < length) {
    struct iovec iov = {const_cast<uint8_t*>(data) + done,
                        std::min(length - done, kMaxTransfer)};
    // A write that extends the file or fills a hole makes the file system
    // allocate (and update the length), which it does not do without
    // blocking.
    io::Op op{.kind = io::OpKind::kWrite,
              .fd = config_.fd,
              .iov = &iov,
              .iovcnt = 1,
              .offset = offset + done,
              .may_block = MayAllocate(offset + done, offset + done + iov.iov_len) ||
                           SplitByDevice(iov.iov_len),
              .merge_limit = MergeLimit()};
    int64_t r = co_await engine_.Run(op);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) co_return ErrnoStatus(config_.path, "pwritev", static_cast<int>(-r));
    if (r == 0) co_return ErrnoStatus(config_.path, "pwritev", EIO);
    done += static_cast<uint64_t>(r);
    length_ = std::max(length_, offset + done);
    written_end_ = std::max(written_end_, std::min(offset + done, data_end));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileIo::Read(uint64_t offset, io::IoVec buf) {
  if (!NeedsBounce(offset, buf.size(), buf.data())) {
    co_return co_await ReadPlain(offset, buf.data(), buf.size());
  }
  const uint64_t ra = config_.alignment.request;
  const uint64_t end = offset + buf.size();
  const uint64_t piece = RoundUpTo(kMaxBounce, ra);
  AlignedBuffer bounce(
      std::min(piece, RoundUpTo(end, ra) - RoundDownTo(offset, ra)),
      std::max(config_.alignment.memory, ra));
  uint64_t cur = offset;
  while (cur < end) {
    const uint64_t start = RoundDownTo(cur, ra);
    const uint64_t stop = std::min(RoundUpTo(end, ra), start + piece);
    CO_RETURN_IF_ERROR(co_await ReadPlain(start, bounce.data(), stop - start));
    const uint64_t n = std::min(stop, end) - cur;
    std::memcpy(buf.data() + (cur - offset), bounce.data() + (cur - start), n);
    cur += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileIo::Write(uint64_t offset, io::ConstIoVec data) {
  // Only a file grown ahead can be longer than what write syscalls reached,
  // so only there can cutting it back reach a write in flight.
  std::optional<std::multiset<uint64_t>::iterator> issued;
  if (grows_ahead_) issued = issued_ends_.insert(offset + data.size());
  // Not `cond ? co_await a : co_await b`: GCC 12 destroys the result of
  // such a conditional twice (a use-after-free of the Status).
  absl::Status st;
  if (config_.direct) {
    st = co_await WriteDirect(offset, data.data(), data.size());
  } else {
    st = co_await WritePlain(offset, data.data(), data.size());
  }
  if (issued.has_value()) issued_ends_.erase(*issued);
  if (st.ok()) NoteWritten(offset, offset + data.size());
  co_return st;
}

bool FileIo::MayAllocate(uint64_t offset, uint64_t end) const {
  if (end > size_) return true;
  auto it = holes_.upper_bound(offset);  // first hole starting after offset
  if (it != holes_.end() && it->first < end) return true;
  return it != holes_.begin() && std::prev(it)->second > offset;
}

void FileIo::AddHole(uint64_t offset, uint64_t end) {
  if (offset >= end || holes_.size() >= kMaxKnownHoles) return;
  RemoveHoles(offset, end);  // keeps the map disjoint
  holes_.emplace(offset, end);
}

void FileIo::RemoveHoles(uint64_t offset, uint64_t end) {
  auto it = holes_.upper_bound(offset);
  if (it != holes_.begin()) --it;
  while (it != holes_.end() && it->first < end) {
    const uint64_t start = it->first, stop = it->second;
    if (stop <= offset) {
      ++it;
      continue;
    }
    it = holes_.erase(it);
    if (start < offset) holes_.emplace(start, offset);
    if (stop > end) holes_.emplace(end, stop);
  }
}

void FileIo::NoteWritten(uint64_t offset, uint64_t end) {
  if (offset > size_) AddHole(size_, offset);
  RemoveHoles(offset, end);
  size_ = std::max(size_, end);
}

void FileIo::GrowAhead(uint64_t end) {
  if (growth_step_ == 0 || !config_.regular_file || end <= length_) return;
  uint64_t target = RoundUpTo(end, kGrowthAlign) + growth_step_;
  // Not past the file size limit (RLIMIT_FSIZE, `ulimit -f`): ftruncate
  // beyond it raises SIGXFSZ, which kills the process, where the write
  // alone may fit. A write that does not fit meets the limit itself.
  struct rlimit limit;
  if (getrlimit(RLIMIT_FSIZE, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY) {
    target = std::min<uint64_t>(target, limit.rlim_cur);
  }
  if (target <= end) return;
  // Marked first, so that a crash never leaves an unmarked hole tail; a
  // file that cannot be marked is not grown ahead.
  if (!marked_) {
    if (config_.grown_ahead_marker == nullptr ||
        fsetxattr(config_.fd, config_.grown_ahead_marker, "1", 1, 0) != 0) {
      return;
    }
    marked_ = true;
  }
  if (ftruncate(config_.fd, static_cast<off_t>(target)) == 0) length_ = target;
}

bool FileIo::MayHaveTailGrownAhead() const {
  if (!grows_ahead_ || !config_.regular_file) return false;
  if (marked_) return true;
  char value[8];
  return config_.grown_ahead_marker != nullptr &&
         fgetxattr(config_.fd, config_.grown_ahead_marker, value,
                   sizeof(value)) >= 0;
}

void FileIo::AdoptHoleTail(uint64_t used_end) {
  // Only a tail this code grew ahead and did not cut back (the marker is
  // left): a hole tail another program left, such as the discarded last
  // clusters QEMU keeps, stays as QEMU keeps it.
  if (!MayHaveTailGrownAhead()) return;
  const uint64_t keep = std::max(used_end, WrittenOrIssuedEnd());
  if (keep >= size_) {
    marked_ = true;  // nothing to take: the marker goes at the next cut
    return;
  }
  // The end of the last data in [keep, size_).
  uint64_t data_end = keep;
  for (uint64_t pos = keep;;) {
    const off_t d = lseek(config_.fd, static_cast<off_t>(pos), SEEK_DATA);
    if (d < 0 && errno == ENXIO) break;  // no data from pos on
    if (d < 0) return;  // unknown: the marker stays for a later open
    if (static_cast<uint64_t>(d) >= size_) break;
    const off_t h = lseek(config_.fd, d, SEEK_HOLE);
    if (h < 0) return;
    if (static_cast<uint64_t>(h) >= size_) {
      marked_ = true;  // data to the end: no tail; the marker goes
      return;
    }
    data_end = std::max(data_end, static_cast<uint64_t>(h));
    pos = static_cast<uint64_t>(h);
  }
  marked_ = true;
  if (data_end >= size_) return;
  adopted_length_ = std::max(adopted_length_, size_);
  RemoveHoles(data_end, UINT64_MAX);
  size_ = data_end;
}

uint64_t FileIo::WrittenOrIssuedEnd() const {
  return issued_ends_.empty() ? written_end_
                              : std::max(written_end_, *issued_ends_.rbegin());
}

absl::Status FileIo::CutToSize() {
  // Never below a write still in flight (a Truncate racing with writes),
  // nor below what a failed write reached.
  const uint64_t end = std::max(size_, WrittenOrIssuedEnd());
  if (length_ > end) {
    if (ftruncate(config_.fd, static_cast<off_t>(end)) != 0) {
      return ErrnoStatus(config_.path, "ftruncate", errno);
    }
    length_ = end;
  }
  // The file ends at its data again: no tail left to take.
  if (marked_ && (fremovexattr(config_.fd, config_.grown_ahead_marker) == 0 ||
                  errno == ENODATA)) {
    marked_ = false;
  }
  return absl::OkStatus();
}

bool FileIo::Conflicts(uint64_t start, uint64_t end, bool rmw) const {
  if (!rmw && rmw_in_flight_ == 0) return false;
  for (const InflightWrite* w = inflight_; w != nullptr; w = w->next) {
    if (w->start < end && start < w->end && (rmw || w->rmw)) return true;
  }
  return false;
}

void FileIo::BeginWrite(InflightWrite& w) {
  w.prev = nullptr;
  w.next = inflight_;
  if (inflight_ != nullptr) inflight_->prev = &w;
  inflight_ = &w;
  if (w.rmw) ++rmw_in_flight_;
}

void FileIo::EndWrite(InflightWrite& w) {
  if (w.prev != nullptr) {
    w.prev->next = w.next;
  } else {
    inflight_ = w.next;
  }
  if (w.next != nullptr) w.next->prev = w.prev;
  if (w.rmw) --rmw_in_flight_;
  if (waiters_.empty()) return;
  std::vector<std::coroutine_handle<>> waiters;
  waiters.swap(waiters_);
  for (std::coroutine_handle<> h : waiters) io::Resume(h);
}

absl::Status FileIo::TrimPadding(uint64_t written_end) {
  // An aligned write may have grown the file past the caller's data: cut it
  // back to the furthest end any finished or pending write wants.
  uint64_t wanted = size_;
  for (const InflightWrite* w = inflight_; w != nullptr; w = w->next) {
    wanted = std::max(wanted, w->wanted_end);
  }
  if (written_end <= wanted) return absl::OkStatus();
  // Padding inside the length grown ahead: CutToSize removes it.
  if (growth_step_ != 0 && length_ > written_end) {
    return absl::OkStatus();
  }
  struct stat st;
  if (fstat(config_.fd, &st) != 0) return ErrnoStatus(config_.path, "fstat", errno);
  if (!S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) <= wanted) {
    return absl::OkStatus();
  }
  if (ftruncate(config_.fd, static_cast<off_t>(wanted)) != 0) {
    return ErrnoStatus(config_.path, "ftruncate", errno);
  }
  length_ = wanted;
  return absl::OkStatus();
}

io::Task<absl::Status> FileIo::WriteDirect(uint64_t offset, const uint8_t* data,
                                           uint64_t length) {
  const uint64_t end = offset + length;
  if (!NeedsBounce(offset, length, data)) {
    while (Conflicts(offset, end, /*rmw=*/false)) co_await WaitForWrites{*this};
    InflightWrite w{offset, end, false, end};
    BeginWrite(w);
    absl::Status st = co_await WritePlain(offset, data, length);
    EndWrite(w);
    co_return st;
  }
  const uint64_t ra = config_.alignment.request;
  const uint64_t piece = RoundUpTo(kMaxBounce, ra);
  AlignedBuffer bounce(
      std::min(piece, RoundUpTo(end, ra) - RoundDownTo(offset, ra)),
      std::max(config_.alignment.memory, ra));
  uint64_t cur = offset;
  while (cur < end) {
    const uint64_t start = RoundDownTo(cur, ra);
    const uint64_t stop = std::min(RoundUpTo(end, ra), start + piece);
    const uint64_t data_end = std::min(stop, end);
    const bool rmw = cur != start || data_end != stop;
    while (Conflicts(start, stop, rmw)) co_await WaitForWrites{*this};
    InflightWrite w{start, stop, rmw, data_end};
    BeginWrite(w);
    absl::Status st;
    if (cur != start) {  // head padding
      st = co_await ReadPlain(start, bounce.data(), ra);
    }
    if (st.ok() && data_end != stop && (stop - ra != start || cur == start)) {
      st = co_await ReadPlain(stop - ra, bounce.data() + (stop - ra - start), ra);
    }
    if (st.ok()) {
      std::memcpy(bounce.data() + (cur - start), data + (cur - offset),
                  data_end - cur);
      st = co_await WritePlain(start, bounce.data(), stop - start, data_end);
    }
    if (st.ok()) {
      NoteWritten(cur, data_end);
      if (stop != data_end) {
        w.wanted_end = 0;  // our own padding does not count
        st = TrimPadding(stop);
      }
    }
    EndWrite(w);
    CO_RETURN_IF_ERROR(st);
    cur = data_end;
  }
  co_return absl::OkStatus();
}

io::Task<int64_t> FileIo::Fallocate(int mode, uint64_t offset, uint64_t length) {
  bool* supported = (mode & FALLOC_FL_PUNCH_HOLE)   ? &punch_hole_supported_
                    : (mode & FALLOC_FL_ZERO_RANGE) ? &zero_range_supported_
                                                    : &allocate_supported_;
  if (!*supported) co_return -EOPNOTSUPP;
  io::Op op{.kind = io::OpKind::kFallocate,
            .fd = config_.fd,
            .offset = offset,
            .length = length,
            .mode = mode};
  int64_t r;
  do {
    r = co_await engine_.Run(op);
  } while (r == -EINTR);
  if (r < 0 && IsUnsupportedErrno(static_cast<int>(-r))) {
    *supported = false;
    co_return -EOPNOTSUPP;
  }
  co_return r < 0 ? r : 0;
}

absl::Status FileIo::ExtendTo(uint64_t end) {
  if (config_.regular_file) {
    struct stat st;
    if (fstat(config_.fd, &st) != 0) return ErrnoStatus(config_.path, "fstat", errno);
    if (static_cast<uint64_t>(st.st_size) < end &&
        ftruncate(config_.fd, static_cast<off_t>(end)) != 0) {
      return ErrnoStatus(config_.path, "ftruncate", errno);
    }
    length_ = std::max(length_, end);
  }
  size_ = std::max(size_, end);
  return absl::OkStatus();
}

io::Task<absl::Status> FileIo::WriteZeroes(uint64_t offset, uint64_t length,
                                           bool may_unmap, bool allocate) {
  const uint64_t end = offset + length;
  if (!config_.regular_file) {
    // Block devices take fallocate only on whole logical blocks and never
    // change size.
    const uint64_t bs = config_.logical_block_size;
    if (offset % bs != 0 || length % bs != 0 || end > size_) {
      co_return absl::UnimplementedError("write zeroes");
    }
  }
  const int keep_size = config_.regular_file ? 0 : FALLOC_FL_KEEP_SIZE;
  if (may_unmap) {
    int64_t r = co_await Fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                   offset, length);
    if (r == 0) co_return ExtendTo(end);
    if (r != -EOPNOTSUPP && r != -EBUSY) {
      co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
    }
  }
  int64_t r = co_await Fallocate(FALLOC_FL_ZERO_RANGE | keep_size, offset, length);
  if (r == 0) co_return ExtendTo(end);
  if (r != -EOPNOTSUPP) {
    co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
  }
  if (config_.regular_file) {
    r = co_await Fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset,
                           length);
    if (r == 0) {
      r = co_await Fallocate(0, offset, length);
      if (r == 0 || (r == -EOPNOTSUPP && !allocate)) co_return ExtendTo(end);
      if (r == -EOPNOTSUPP) co_return absl::UnimplementedError("write zeroes");
      co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
    }
    if (r != -EOPNOTSUPP) {
      co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
    }
    if (offset >= size_) {  // past EOF everything reads as zeroes already
      r = co_await Fallocate(0, offset, length);
      if (r == 0) co_return ExtendTo(end);
      if (r != -EOPNOTSUPP) {
        co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
      }
    }
  }
  co_return absl::UnimplementedError("write zeroes");
}

io::Task<absl::Status> FileIo::Discard(uint64_t offset, uint64_t length) {
  if (!config_.regular_file) {
    const uint64_t bs = config_.logical_block_size;
    if (offset % bs != 0 || length % bs != 0) {
      co_return absl::UnimplementedError("discard");
    }
  }
  int64_t r = co_await Fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
                                 offset, length);
  if (r == -EOPNOTSUPP) co_return absl::UnimplementedError("discard");
  if (r < 0) co_return ErrnoStatus(config_.path, "fallocate", static_cast<int>(-r));
  if (config_.regular_file) AddHole(offset, std::min(offset + length, size_));
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileIo::Sync(bool data_only) {
  io::Op op{.kind = data_only ? io::OpKind::kFdatasync : io::OpKind::kFsync,
            .fd = config_.fd};
  int64_t r = co_await engine_.Run(op);
  if (r < 0) {
    co_return ErrnoStatus(config_.path, data_only ? "fdatasync" : "fsync",
                          static_cast<int>(-r));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> FileIo::WriteZeroBuffers(uint64_t start, uint64_t end) {
  if (start >= end) co_return absl::OkStatus();
  const uint64_t ra = request_alignment();
  AlignedBuffer zeroes(std::min(kZeroChunk, end - start),
                       std::max<uint64_t>(config_.alignment.memory, 4096));
  uint64_t cur = start;
  while (cur < end) {
    uint64_t n = std::min(end - cur, zeroes.size());
    if (cur % ra != 0) n = std::min(n, RoundUpTo(cur, ra) - cur);
    CO_RETURN_IF_ERROR(co_await Write(cur, io::ConstIoVec(zeroes.data(), n)));
    cur += n;
  }
  co_return absl::OkStatus();
}

io::Task<void> FileIo::WriteFirstBlock(uint64_t new_size) {
  // Allocating the first block helps later O_DIRECT alignment probing;
  // failures are ignored (file-posix.md §3).
  const uint64_t n = std::min<uint64_t>(new_size < 4096 ? 512 : 4096, new_size);
  AlignedBuffer zeroes(4096, std::max<uint64_t>(config_.alignment.memory, 4096));
  (void)co_await Write(0, io::ConstIoVec(zeroes.data(), n));
}

absl::Status FileIo::Reword(const absl::Status& st,
                            absl::string_view operation) const {
  const int error_number = StatusErrno(st);
  if (error_number == 0) return st;
  return ErrnoStatus(config_.path, operation, error_number);
}

io::Task<absl::Status> FileIo::Truncate(uint64_t new_size, io::PreallocMode mode,
                                        bool exact) {
  // Every mode starts from the length of the data, not from the hole grown
  // ahead after it, and ends at exactly new_size: no growing ahead of the
  // zero writes of full or falloc's fallback.
  if (config_.regular_file) CO_RETURN_IF_ERROR(CutToSize());
  struct NoGrowth {
    uint64_t& step;
    uint64_t saved = std::exchange(step, 0);
    ~NoGrowth() { step = saved; }
  } no_growth{growth_step_};
  struct stat st;
  if (fstat(config_.fd, &st) != 0) {
    co_return ErrnoStatus(config_.path, "fstat", errno);
  }
  if (!S_ISREG(st.st_mode)) {
    // QEMU's order: preallocation, then device length, then other types.
    if (mode != io::PreallocMode::kOff) {
      co_return absl::UnimplementedError(absl::StrFormat(
          "%s: Preallocation mode '%s' unsupported for this non-regular file",
          config_.path, io::PreallocModeName(mode)));
    }
    if (!S_ISBLK(st.st_mode) && !S_ISCHR(st.st_mode)) {
      co_return absl::UnimplementedError(
          absl::StrCat(config_.path, ": Resizing this file is not supported"));
    }
    if (exact && new_size != size_) {
      co_return absl::UnimplementedError(
          absl::StrCat(config_.path, ": Cannot resize device files"));
    }
    if (new_size > size_) {
      co_return absl::InvalidArgumentError(
          absl::StrCat(config_.path, ": Cannot grow device files"));
    }
    co_return absl::OkStatus();
  }
  const uint64_t old_size = static_cast<uint64_t>(st.st_size);
  if (mode == io::PreallocMode::kMetadata) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        config_.path, ": Unsupported preallocation mode: metadata"));
  }
  if (new_size < std::max(old_size, adopted_length_) &&
      mode != io::PreallocMode::kOff) {
    co_return absl::InvalidArgumentError(absl::StrCat(
        config_.path, ": Cannot use preallocation for shrinking files"));
  }
  absl::Status result;
  switch (mode) {
    case io::PreallocMode::kOff:
      if (ftruncate(config_.fd, static_cast<off_t>(new_size)) != 0) {
        co_return ErrnoStatus(config_.path, "Could not resize file", errno);
      }
      RemoveHoles(new_size, UINT64_MAX);
      AddHole(old_size, new_size);  // ftruncate adds a hole
      size_ = new_size;
      length_ = new_size;
      adopted_length_ = 0;
      written_end_ = std::min(written_end_, new_size);
      if (old_size == 0 && new_size > 0) co_await WriteFirstBlock(new_size);
      co_return absl::OkStatus();
    case io::PreallocMode::kFalloc:
      if (new_size > old_size) {
        // No ftruncate first: the zero-write fallback then never has to
        // look at blocks that already exist.
        int64_t r = co_await Fallocate(0, old_size, new_size - old_size);
        if (r == -EOPNOTSUPP) {
          result = co_await WriteZeroBuffers(old_size, new_size);
          result = Reword(result, "Could not preallocate new data");
        } else if (r < 0) {
          result = ErrnoStatus(config_.path, "Could not preallocate new data",
                               static_cast<int>(-r));
        }
      }
      break;
    case io::PreallocMode::kFull:
      if (ftruncate(config_.fd, static_cast<off_t>(new_size)) != 0) {
        result = ErrnoStatus(config_.path, "Could not resize file", errno);
      } else {
        result = co_await WriteZeroBuffers(old_size, new_size);
        result = Reword(result, "Could not write zeros for preallocation");
        if (result.ok()) {
          result = co_await Sync(/*data_only=*/false);
          result = Reword(result, "Could not flush file to disk");
        }
      }
      break;
    case io::PreallocMode::kMetadata:
      break;
  }
  if (!result.ok()) {
    if (ftruncate(config_.fd, static_cast<off_t>(old_size)) != 0) {
      result = absl::Status(
          result.code(),
          absl::StrCat(result.message(), "\nFailed to restore old file length: ",
                       std::strerror(errno)));
    }
    size_ = old_size;
    length_ = old_size;
    written_end_ = std::min(written_end_, old_size);
    co_return result;
  }
  RemoveHoles(new_size, UINT64_MAX);
  size_ = new_size;
  length_ = new_size;
  adopted_length_ = 0;
  written_end_ = std::min(written_end_, new_size);
  if (mode == io::PreallocMode::kFalloc && old_size == 0 && new_size > 0) {
    co_await WriteFirstBlock(new_size);
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::posix_file::internal
