#include "io/aio_engine.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/thread_pool_engine.h"

namespace imgtool::io {
namespace {

// Side threads for fsync, fdatasync and fallocate.
constexpr int kSideThreads = 4;

// The completion ring io_setup maps into the process; the context id is its
// address. Layout of struct aio_ring in the kernel's fs/aio.c (stable ABI,
// also read by QEMU's linux-aio and libaio): a 32-byte header followed by
// `nr` io_events; the kernel advances `tail`, the consumer `head`.
struct AioRing {
  unsigned id;
  unsigned nr;
  unsigned head;
  unsigned tail;
  unsigned magic;
  unsigned compat_features;
  unsigned incompat_features;
  unsigned header_length;
};
constexpr unsigned kAioRingMagic = 0xa10a10a1;
static_assert(sizeof(AioRing) == 32 && sizeof(struct io_event) == 32);

// The ring of `context` if its layout is the one above, else null.
AioRing* MappedRing(io_context_t context) {
  auto* ring = reinterpret_cast<AioRing*>(context);
  if (ring == nullptr || ring->magic != kAioRingMagic ||
      ring->incompat_features != 0 || ring->header_length != sizeof(AioRing)) {
    return nullptr;
  }
  return ring;
}

// io_getevents(2) through libaio's io_pgetevents without a signal mask. Not
// io_getevents itself: libaio exports it under two symbol versions, and an
// unversioned reference (from a shared library linked without -laio, as
// Bazel's test builds make) binds to the old LIBAIO_0.1 one, which takes
// different arguments.
int GetEvents(io_context_t context, long min_nr, long nr,
              struct io_event* events, struct timespec* timeout) {
  return io_pgetevents(context, min_nr, nr, events, timeout, nullptr);
}

bool IsReadOrWrite(const Op& op) {
  return op.kind == OpKind::kRead || op.kind == OpKind::kWrite;
}

absl::Status SyscallError(const char* operation, int error_number) {
  return absl::InternalError(
      absl::StrCat(operation, ": ", strerror(error_number)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> AioEngine::Create(int queue_depth) {
  const unsigned max_in_kernel =
      static_cast<unsigned>(std::clamp(queue_depth, 8, 4096)) * 2;
  const int event_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (event_fd < 0) {
    return absl::UnavailableError(absl::StrCat(
        "failed to initialize event notifier: ", strerror(errno)));
  }
  io_context_t context = nullptr;
  const int r = io_setup(static_cast<int>(max_in_kernel), &context);
  if (r < 0) {
    close(event_fd);
    return absl::UnavailableError(
        absl::StrCat("failed to create linux AIO context: ", strerror(-r)));
  }
  return std::unique_ptr<Engine>(
      new AioEngine(context, event_fd, max_in_kernel));
}

AioEngine::AioEngine(io_context_t context, int event_fd,
                     unsigned max_in_kernel)
    : context_(context),
      event_fd_(event_fd),
      max_in_kernel_(max_in_kernel),
      iocbs_(max_in_kernel),
      runs_(max_in_kernel),
      events_(max_in_kernel) {
  free_iocbs_.reserve(max_in_kernel);
  for (struct iocb& cb : iocbs_) free_iocbs_.push_back(&cb);
  batch_.reserve(max_in_kernel);
  completed_.reserve(max_in_kernel);
}

AioEngine::~AioEngine() {
  side_.reset();
  io_destroy(context_);
  close(event_fd_);
}

uint64_t AioEngine::in_flight() const {
  return rw_in_flight_ + (side_ != nullptr ? side_->in_flight() : 0);
}

void AioEngine::Submit(Op* op) {
  if (IsReadOrWrite(*op)) {
    ++rw_in_flight_;
    // A request that does not continue the last queued one closes the runs
    // queued before it: they go to the kernel now rather than after every
    // callback of this Poll() has run (header comment).
    if (!queued_.empty() && !ContinuesRun(*queued_.back(), *op)) {
      // A request refused at once or a stuck queue is reported by the next
      // Poll(), as for Flush().
      [[maybe_unused]] absl::Status st = SubmitQueued(completed_);
    }
    queued_.push_back(op);
    return;
  }
  if (op->kind == OpKind::kPoll) {
    ++rw_in_flight_;
    polls_.push_back(op);
    return;
  }
  if (side_ == nullptr) {
    side_ = std::make_unique<ThreadPoolEngine>(kSideThreads, [fd = event_fd_] {
      const uint64_t one = 1;
      // Fails only once 2^64-2 completions are unread: never in practice.
      [[maybe_unused]] ssize_t n = write(fd, &one, sizeof(one));
    });
  }
  side_->Submit(op);
}

void AioEngine::Flush() {
  // Only for an idle device: with requests of ours in the kernel, the
  // queued run goes with the next Poll() (a Flush per refill of the NBD
  // server's buffer cost its depth-16 reads one io_submit per request or
  // two, before Submit() handed closed runs on by itself).
  if (queued_.empty() || free_iocbs_.empty() || in_kernel_ > 0) return;
  // Requests the kernel refuses at once finish in the next Poll(), which
  // starts from completed_; a stuck queue is reported there as well.
  [[maybe_unused]] absl::Status st = SubmitQueued(completed_);
}

absl::Status AioEngine::SubmitQueued(std::vector<Op*>& done) {
  batch_.clear();
  while (!queued_.empty() && !free_iocbs_.empty()) {
    struct iocb* cb = free_iocbs_.back();
    free_iocbs_.pop_back();
    MergedRequest& run = runs_[static_cast<size_t>(cb - iocbs_.data())];
    TakeRun(queued_, kMaxMergedBytes, run);
    const Op& first = *run.ops.front();
    auto* iov = const_cast<struct iovec*>(run.iovec_data());
    const int iovcnt = run.iovec_count();
    const auto offset = static_cast<long long>(first.offset);
    if (first.kind == OpKind::kRead) {
      if (iovcnt == 1) {
        io_prep_pread(cb, first.fd, iov[0].iov_base, iov[0].iov_len, offset);
      } else {
        io_prep_preadv(cb, first.fd, iov, iovcnt, offset);
      }
    } else if (iovcnt == 1) {
      io_prep_pwrite(cb, first.fd, iov[0].iov_base, iov[0].iov_len, offset);
    } else {
      io_prep_pwritev(cb, first.fd, iov, iovcnt, offset);
    }
    io_set_eventfd(cb, event_fd_);
    cb->data = &run;
    batch_.push_back(cb);
  }
  size_t next = 0;
  while (next < batch_.size()) {
    const int r = io_submit(context_, static_cast<long>(batch_.size() - next),
                            batch_.data() + next);
    if (r > 0) {
      in_kernel_ += static_cast<unsigned>(r);
      requests_submitted_ += static_cast<uint64_t>(r);
      next += static_cast<size_t>(r);
    } else if (r == -EAGAIN || r == 0) {
      // The kernel is short of request slots: the rest goes back to the
      // front of the queue, in order, until requests complete.
      for (size_t i = batch_.size(); i-- > next;) {
        const auto& ops = static_cast<MergedRequest*>(batch_[i]->data)->ops;
        queued_.insert(queued_.begin(), ops.begin(), ops.end());
        free_iocbs_.push_back(batch_[i]);
      }
      break;
    } else if (r != -EINTR) {
      // io_submit refused the first request of the batch on its own (a bad
      // fd, an fd not open for this direction, a file without AIO
      // support): it completes with that error.
      Finish(batch_[next], r, done);
      ++next;
    }
  }
  if (!queued_.empty() && !free_iocbs_.empty() && in_kernel_ == 0 &&
      !side_busy() && polls_.empty() && done.empty()) {
    return absl::UnavailableError(
        absl::StrCat("io_submit: ", strerror(EAGAIN)));
  }
  return absl::OkStatus();
}

void AioEngine::Finish(struct iocb* cb, int64_t result,
                       std::vector<Op*>& done) {
  const auto& run = *static_cast<MergedRequest*>(cb->data);
  SplitResult(run, result);
  done.insert(done.end(), run.ops.begin(), run.ops.end());
  free_iocbs_.push_back(cb);
}

void AioEngine::TakeEvents(const struct io_event* events, long count,
                           std::vector<Op*>& done) {
  for (long i = 0; i < count; ++i) {
    // res is bytes or -errno in an unsigned long.
    Finish(events[i].obj, static_cast<long>(events[i].res), done);
  }
  in_kernel_ -= static_cast<unsigned>(count);
}

void AioEngine::Reap(std::vector<Op*>& done) {
  if (in_kernel_ == 0) return;
  AioRing* ring = MappedRing(context_);
  if (ring == nullptr) {
    struct timespec zero = {0, 0};
    const int n = GetEvents(context_, 0, static_cast<long>(events_.size()),
                            events_.data(), &zero);
    if (n > 0) TakeEvents(events_.data(), n, done);
    NoteTaken(n > 0);
    return;
  }
  // Single consumer (this thread): read the events between head and tail,
  // then publish the new head so the kernel can reuse the slots.
  const auto* events = reinterpret_cast<const struct io_event*>(ring + 1);
  unsigned head = ring->head;
  const unsigned tail = __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE);
  NoteTaken(head != tail);
  if (head == tail) return;
  if (head > tail) {  // wrapped: head..nr first
    TakeEvents(events + head, ring->nr - head, done);
    head = 0;
  }
  TakeEvents(events + head, tail - head, done);
  __atomic_store_n(&ring->head, tail, __ATOMIC_RELEASE);
}

void AioEngine::NoteTaken(bool took) {
  // Events taken right after the eventfd was read were (but for a race
  // that costs one early wakeup) counted by that read.
  if (took && !eventfd_just_read_) eventfd_stale_ = true;
  eventfd_just_read_ = false;
}

absl::Status AioEngine::ReadEventFd() {
  uint64_t count;
  if (read(event_fd_, &count, sizeof(count)) < 0 && errno != EAGAIN) {
    return SyscallError("read eventfd", errno);
  }
  eventfd_stale_ = false;
  eventfd_just_read_ = true;
  return absl::OkStatus();
}

absl::Status AioEngine::CheckPolls(int timeout_ms, bool with_eventfd,
                                   std::vector<Op*>& done) {
  pollfds_.clear();
  for (const Op* op : polls_) {
    pollfds_.push_back({.fd = op->fd, .events = static_cast<short>(op->mode),
                        .revents = 0});
  }
  if (with_eventfd) {
    pollfds_.push_back({.fd = event_fd_, .events = POLLIN, .revents = 0});
  }
  int r;
  do {
    r = poll(pollfds_.data(), pollfds_.size(), timeout_ms);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return SyscallError("poll", errno);
  if (r == 0) return absl::OkStatus();
  if (with_eventfd && pollfds_.back().revents != 0) {
    absl::Status st = ReadEventFd();
    if (!st.ok()) return st;
  }
  size_t kept = 0;
  for (size_t i = 0; i < polls_.size(); ++i) {
    if (pollfds_[i].revents != 0) {
      polls_[i]->result = pollfds_[i].revents;
      done.push_back(polls_[i]);
    } else {
      polls_[kept++] = polls_[i];
    }
  }
  polls_.resize(kept);
  return absl::OkStatus();
}

uint64_t AioEngine::NextSpinNs(uint64_t spin_ns, uint64_t slept_ns) {
  if (slept_ns > kMaxSpinNs) return 0;
  return spin_ns == 0 ? kFirstSpinNs : std::min(spin_ns * 2, kMaxSpinNs);
}

bool AioEngine::Spin(std::vector<Op*>& done) {
  if (in_kernel_ == 0 || spin_ns_ == 0 || MappedRing(context_) == nullptr) {
    return false;
  }
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::nanoseconds(spin_ns_);
  do {
    Reap(done);
    if (!done.empty()) return true;
    __builtin_ia32_pause();
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

absl::Status AioEngine::Wait(std::vector<Op*>& done) {
  if (Spin(done)) return absl::OkStatus();
  // Only a sleep with requests in the kernel says how long they take.
  const bool timed = in_kernel_ > 0;
  const auto start = timed ? std::chrono::steady_clock::now()
                           : std::chrono::steady_clock::time_point();
  absl::Status st = Sleep(done);
  if (timed) {
    const auto slept = std::chrono::duration_cast<std::chrono::nanoseconds>(
        std::chrono::steady_clock::now() - start);
    spin_ns_ = NextSpinNs(spin_ns_, static_cast<uint64_t>(slept.count()));
  }
  return st;
}

absl::Status AioEngine::Sleep(std::vector<Op*>& done) {
  if (!polls_.empty()) {
    if (eventfd_stale_) {
      // The eventfd still counts events Reap took from the ring: the poll
      // below would return at once for them. Read the count now, then look
      // at the ring once more for events the read also counted.
      absl::Status st = ReadEventFd();
      if (!st.ok()) return st;
      Reap(done);
      if (!done.empty() || (side_busy() && side_->HasFinished())) {
        return absl::OkStatus();
      }
    }
    return CheckPolls(-1, /*with_eventfd=*/true, done);
  }
  if (!side_busy()) {
    // Only AIO requests: sleep in io_getevents, which returns their events.
    int n;
    do {
      n = GetEvents(context_, 1, static_cast<long>(events_.size()),
                    events_.data(), nullptr);
    } while (n == -EINTR);
    if (n < 0) return SyscallError("io_getevents", -n);
    TakeEvents(events_.data(), n, done);
    NoteTaken(n > 0);
    return absl::OkStatus();
  }
  // Requests in the side pool: every completion signals the eventfd. A
  // count left from earlier completions only makes this return early; the
  // caller looks and waits again.
  struct pollfd p = {.fd = event_fd_, .events = POLLIN, .revents = 0};
  int r;
  do {
    r = poll(&p, 1, -1);
  } while (r < 0 && errno == EINTR);
  if (r < 0) return SyscallError("poll", errno);
  return ReadEventFd();
}

absl::Status AioEngine::Poll(bool wait) {
  std::vector<Op*> done;
  done.swap(completed_);  // nested Poll() from a callback gets a fresh one
  absl::Status st = SubmitQueued(done);
  if (st.ok()) {
    Reap(done);
    bool side_ready = side_busy() && side_->HasFinished();
    // A look at the polled fds without sleeping, unless this call is about
    // to sleep: Wait's poll(2) looks at them too.
    const bool will_sleep = wait && done.empty() && !side_ready;
    if (!polls_.empty() && !will_sleep) {
      st = CheckPolls(0, /*with_eventfd=*/false, done);
    }
    while (st.ok() && wait && done.empty() && !side_ready &&
           (in_kernel_ > 0 || side_busy() || !polls_.empty())) {
      st = Wait(done);
      if (!st.ok()) break;
      Reap(done);
      side_ready = side_busy() && side_->HasFinished();
    }
    // Room freed: hand waiting requests to the kernel before the callbacks
    // run (those submit theirs in the next Poll).
    if (st.ok() && !queued_.empty() && !free_iocbs_.empty() &&
        !done.empty()) {
      st = SubmitQueued(done);
    }
  }
  RunCallbacks(done, rw_in_flight_);
  done.clear();
  // Keep the larger buffer, unless a Flush() from a callback left requests
  // in completed_ for the next Poll().
  if (completed_.empty() && completed_.capacity() < done.capacity()) {
    completed_.swap(done);
  }
  if (side_busy()) {
    absl::Status side = side_->Poll(/*wait=*/false);
    if (st.ok()) st = side;
  }
  return st;
}

}  // namespace imgtool::io
