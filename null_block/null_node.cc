#include "null_block/null_node.h"

#include <sys/timerfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace imgtool::null_block {
namespace {

constexpr int64_t kNanosPerSecond = 1000000000;

int64_t MonotonicNanos() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * kNanosPerSecond + ts.tv_nsec;
}

void SleepUntil(int64_t deadline) {
  const int64_t now = MonotonicNanos();
  if (now >= deadline) return;
  const int64_t left = deadline - now;
  timespec ts{static_cast<time_t>(left / kNanosPerSecond),
              static_cast<long>(left % kNanosPerSecond)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

}  // namespace

absl::Status ParseNullFilename(absl::string_view driver,
                               absl::string_view filename) {
  const std::string allowed = absl::StrCat(driver, "://");
  if (filename != allowed) {
    return absl::InvalidArgumentError(absl::StrCat(
        "The only allowed filename for this driver is '", allowed, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NullNode>> NullNode::Open(
    std::string driver, const NullOptions& options, io::Engine* engine,
    bool read_only) {
  const int64_t latency = options.has_latency_ns() ? options.latency_ns() : 0;
  if (latency < 0) {
    return absl::InvalidArgumentError("latency-ns is invalid");
  }
  // QEMU counts a node's length in whole 512-byte sectors (its
  // total_sectors), so a null node of 1000 bytes is 1024 bytes long.
  const uint64_t requested =
      options.has_size() ? options.size() : kDefaultNullSize;
  const uint64_t size = requested > UINT64_MAX - 511
                            ? UINT64_MAX / 512 * 512
                            : (requested + 511) / 512 * 512;
  return std::unique_ptr<NullNode>(new NullNode(std::move(driver), size,
                                                latency,
                                                options.read_zeroes(), engine,
                                                read_only));
}

NullNode::NullNode(std::string driver, uint64_t size, int64_t latency_ns,
                   bool read_zeroes, io::Engine* engine, bool read_only)
    : io::BlockNode(absl::StrCat(driver, "://"), read_only),
      driver_(std::move(driver)),
      size_(size),
      latency_ns_(latency_ns),
      read_zeroes_(read_zeroes),
      engine_(engine) {}

io::Task<void> NullNode::Delay() {
  if (latency_ns_ == 0) co_return;
  const int64_t deadline = MonotonicNanos() + latency_ns_;
  if (engine_ != nullptr) {
    const int fd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
    if (fd >= 0) {
      itimerspec when{};
      when.it_value.tv_sec = static_cast<time_t>(deadline / kNanosPerSecond);
      when.it_value.tv_nsec = static_cast<long>(deadline % kNanosPerSecond);
      if (timerfd_settime(fd, TFD_TIMER_ABSTIME, &when, nullptr) == 0) {
        uint64_t expirations = 0;
        iovec iov{&expirations, sizeof(expirations)};
        io::Op op;
        op.kind = io::OpKind::kRead;
        op.fd = fd;
        op.iov = &iov;
        op.iovcnt = 1;
        op.may_block = true;
        co_await engine_->Run(op);  // a refused read sleeps below
      }
      close(fd);
    }
  }
  SleepUntil(deadline);
}

io::Task<absl::Status> NullNode::DoRead(uint64_t, io::IoVec buf) {
  if (read_zeroes_) std::memset(buf.data(), 0, buf.size());
  co_await Delay();
  co_return absl::OkStatus();
}

io::Task<absl::Status> NullNode::DoWrite(uint64_t, io::ConstIoVec) {
  co_await Delay();
  co_return absl::OkStatus();
}

io::Task<absl::Status> NullNode::DoWriteZeroes(uint64_t, uint64_t,
                                               io::WriteZeroesFlags) {
  co_await Delay();
  co_return absl::OkStatus();
}

io::Task<absl::Status> NullNode::DoDiscard(uint64_t, uint64_t) {
  co_await Delay();
  co_return absl::OkStatus();
}

io::Task<absl::Status> NullNode::DoFlush() {
  co_await Delay();
  co_return absl::OkStatus();
}

io::Task<absl::Status> NullNode::DoTruncate(uint64_t, io::PreallocMode) {
  co_return absl::UnimplementedError(
      "Image format driver does not support resize");
}

io::Task<absl::StatusOr<io::BlockStatus>> NullNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  io::BlockStatus status;
  status.length = max_length;
  status.zero = read_zeroes_;
  status.offset_valid = true;
  status.host_offset = offset;
  status.file = this;
  co_return status;
}

io::Task<absl::Status> NullNode::Close() { co_return absl::OkStatus(); }

}  // namespace imgtool::null_block
