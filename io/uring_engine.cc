#include "io/uring_engine.h"

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/coalesce.h"

namespace imgtool::io {
namespace {

// Completions copied out of the CQ ring per io_uring_peek_batch_cqe call.
constexpr unsigned kReapBatch = 256;

// user_data of the read of the side pool's eventfd (no Op has this address).
constexpr uint64_t kSideEvent = 0;

absl::Status EnterError(const char* operation, int error_number) {
  std::string message = absl::StrCat(operation, ": ", strerror(error_number));
  if (error_number == EAGAIN || error_number == EBUSY) {
    return absl::UnavailableError(message);
  }
  return absl::InternalError(message);
}

// One buffer whose length fits IORING_OP_READ/WRITE's 32-bit length.
bool SingleBuffer(const Op& op) {
  return op.iovcnt == 1 && op.iov[0].iov_len <= UINT32_MAX;
}

bool IsReadOrWrite(const Op& op) {
  return op.kind == OpKind::kRead || op.kind == OpKind::kWrite;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Engine>> UringEngine::Create(int queue_depth) {
  unsigned entries = std::bit_ceil(
      static_cast<unsigned>(std::clamp(queue_depth, 8, 4096)));
  auto ring = std::make_unique<io_uring>();
  // No setup flags: SUBMIT_ALL and COOP_TASKRUN/TASKRUN_FLAG measured no
  // difference for 4 KiB O_DIRECT writes at depth 64..256 and need 5.18+.
  int r = io_uring_queue_init(entries, ring.get(), 0);
  if (r < 0) {
    return absl::UnavailableError(
        absl::StrCat("io_uring_queue_init: ", strerror(-r)));
  }
  return std::unique_ptr<Engine>(
      new UringEngine(std::move(ring), std::clamp(queue_depth, 1, 64)));
}

UringEngine::UringEngine(std::unique_ptr<io_uring> ring, int side_threads)
    : ring_(std::move(ring)),
      ring_entries_(ring_->sq.ring_entries),
      // One CQE stays free for the read of side_event_fd_.
      max_in_kernel_(ring_->cq.ring_entries - 1),
      side_threads_(side_threads) {
  completed_.reserve(max_in_kernel_ + 1);
}

UringEngine::~UringEngine() {
  // The side pool first: it finishes its queued requests, and its last
  // additions to side_event_fd_ may complete the pending read, which
  // io_uring copies into side_event_count_ on this thread while the engine
  // still exists. After that nothing writes the eventfd, so the ring's
  // teardown only cancels the read (the ring holds its own reference to
  // the eventfd until then).
  side_.reset();
  io_uring_queue_exit(ring_.get());
  if (side_event_fd_ >= 0) close(side_event_fd_);
}

void UringEngine::Submit(Op* op) {
  ++in_flight_;
  queued_.push_back(op);
}

bool UringEngine::StartSidePool() {
  if (side_ != nullptr) return true;
  if (side_event_fd_ != -1) return false;  // eventfd failed before
  // No EFD_NONBLOCK: io_uring then waits for the count by polling instead
  // of failing the read with -EAGAIN.
  side_event_fd_ = eventfd(0, EFD_CLOEXEC);
  if (side_event_fd_ < 0) {
    side_event_fd_ = -2;  // the ring path serves from now on
    return false;
  }
  side_ = std::make_unique<ThreadPoolEngine>(
      side_threads_, [fd = side_event_fd_] {
        const uint64_t one = 1;
        // Cannot fail short of 2^64 - 2 unread additions.
        (void)!write(fd, &one, sizeof(one));
      });
  return true;
}

UringEngine::Request* UringEngine::NewRequest() {
  if (free_requests_.empty()) {
    requests_.push_back(std::make_unique<Request>());
    return requests_.back().get();
  }
  Request* request = free_requests_.back();
  free_requests_.pop_back();
  return request;
}

void UringEngine::SubmitToSidePool(Request* request) {
  const MergedRequest& run = request->run;
  const Op& first = *run.ops.front();
  request->carrier = Op{.kind = first.kind,
                        .fd = first.fd,
                        .iov = run.iovec_data(),
                        .iovcnt = run.iovec_count(),
                        .offset = first.offset,
                        .length = first.length,
                        .mode = first.mode};
  request->carrier.done = [this, request](Op& carrier) {
    SplitResult(request->run, carrier.result);
    // The request is not reused before it is freed, so its ops stay put
    // while their callbacks submit new requests.
    RunCallbacks(request->run.ops, in_flight_);
    free_requests_.push_back(request);
  };
  side_requests_ += run.ops.size();
  if (IsReadOrWrite(first)) ++requests_submitted_;
  side_->Submit(&request->carrier);
}

bool UringEngine::Prepare(Request* request) {
  if (in_kernel_ >= max_in_kernel_) return false;
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) {
    // The SQ is full: hand the queued entries to the kernel first. On
    // failure the request waits in user space and Poll() retries (and
    // reports).
    if (io_uring_submit(ring_.get()) < 0) return false;
    sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) return false;
  }
  const MergedRequest& run = request->run;
  const Op& op = *run.ops.front();
  // One buffer goes as IORING_OP_READ/WRITE, which skips importing the
  // iovec.
  const bool single = run.ops.size() == 1 && SingleBuffer(op);
  const auto iovcnt = static_cast<unsigned>(run.iovec_count());
  switch (op.kind) {
    case OpKind::kRead:
      if (single) {
        io_uring_prep_read(sqe, op.fd, op.iov[0].iov_base,
                           static_cast<unsigned>(op.iov[0].iov_len),
                           op.offset);
      } else {
        io_uring_prep_readv(sqe, op.fd, run.iovec_data(), iovcnt, op.offset);
      }
      break;
    case OpKind::kWrite:
      if (single) {
        io_uring_prep_write(sqe, op.fd, op.iov[0].iov_base,
                            static_cast<unsigned>(op.iov[0].iov_len),
                            op.offset);
      } else {
        io_uring_prep_writev(sqe, op.fd, run.iovec_data(), iovcnt, op.offset);
      }
      break;
    case OpKind::kFsync:
      io_uring_prep_fsync(sqe, op.fd, 0);
      break;
    case OpKind::kFdatasync:
      io_uring_prep_fsync(sqe, op.fd, IORING_FSYNC_DATASYNC);
      break;
    case OpKind::kFallocate:
      io_uring_prep_fallocate(sqe, op.fd, op.mode,
                              static_cast<off_t>(op.offset),
                              static_cast<off_t>(op.length));
      break;
    case OpKind::kPoll:
      io_uring_prep_poll_add(sqe, op.fd, static_cast<unsigned>(op.mode));
      break;
  }
  io_uring_sqe_set_data(sqe, request);
  ++in_kernel_;
  if (IsReadOrWrite(op)) ++requests_submitted_;
  return true;
}

bool UringEngine::ArmSideEvent() {
  if (side_event_armed_) return true;
  io_uring_sqe* sqe = io_uring_get_sqe(ring_.get());
  if (sqe == nullptr) {
    if (io_uring_submit(ring_.get()) < 0) return false;
    sqe = io_uring_get_sqe(ring_.get());
    if (sqe == nullptr) return false;
  }
  io_uring_prep_read(sqe, side_event_fd_, &side_event_count_,
                     sizeof(side_event_count_), 0);
  sqe->user_data = kSideEvent;
  side_event_armed_ = true;
  return true;
}

void UringEngine::DrainQueue() {
  while (!queued_.empty()) {
    // The ring is full: only a request marked may_block could leave now.
    if (in_kernel_ >= max_in_kernel_ && !queued_.front()->may_block) return;
    Request* request = NewRequest();
    MergedRequest& run = request->run;
    if (IsReadOrWrite(*queued_.front())) {
      TakeRun(queued_, kMaxMergedBytes, run);
    } else {
      run.ops.assign(1, queued_.front());
      run.iov.clear();
      run.bytes = 0;
      queued_.pop_front();
    }
    const bool may_block =
        std::any_of(run.ops.begin(), run.ops.end(),
                    [](const Op* op) { return op->may_block; });
    if (may_block && StartSidePool()) {
      SubmitToSidePool(request);
    } else if (!Prepare(request)) {
      // No room: the run goes back to the front of the queue, in order.
      queued_.insert(queued_.begin(), run.ops.begin(), run.ops.end());
      free_requests_.push_back(request);
      return;
    }
  }
}

absl::Status UringEngine::Poll(bool wait) {
  io_uring* ring = ring_.get();
  DrainQueue();
  // While the side pool has requests, a read of its eventfd sits in the
  // ring, so that waiting for a CQE also waits for the pool.
  const bool side_busy = side_ != nullptr && side_->in_flight() > 0;
  if (side_busy && !ArmSideEvent()) {
    return absl::InternalError("io_uring: no SQE for the side pool's eventfd");
  }

  // Submit everything queued, then, if asked to wait and no completion is
  // ready, wait in a second io_uring_enter (as fio's io_uring engine does).
  // One call doing both (io_uring_submit_and_wait) sleeps before the
  // completion work the submission started can post its CQE; 4 KiB O_DIRECT
  // random reads at depth 1 on a RAM-backed loop device made 34k IOPS that
  // way and 57k split (fio's io_uring 77k); depths 4-64 the same (README,
  // "Session 31").
  if (io_uring_sq_ready(ring) > 0) {
    int r;
    do {
      r = io_uring_submit(ring);
    } while (r == -EINTR);
    if (r < 0) {
      // -EAGAIN/-EBUSY: the kernel is short of resources. The entries stay
      // queued for the next Poll(); wait below for requests already in the
      // kernel if there are any, since their completion frees resources.
      const unsigned queued = io_uring_sq_ready(ring);
      const unsigned submitted =
          in_kernel_ + (side_event_armed_ ? 1 : 0) - queued;
      if ((r != -EAGAIN && r != -EBUSY) || submitted == 0) {
        return EnterError("io_uring_enter", -r);
      }
    }
  }
  if (wait && (in_kernel_ > 0 || side_busy) && io_uring_cq_ready(ring) == 0) {
    ++waits_;
    io_uring_cqe* cqe = nullptr;
    int r;
    do {
      r = io_uring_wait_cqe(ring, &cqe);
    } while (r == -EINTR);
    if (r < 0) return EnterError("io_uring_enter", -r);
  }

  // Reap every completion available, then run the callbacks: they may submit
  // new requests (queued for the next Poll, where adjacent ones merge) or
  // free their Op.
  std::vector<Op*> batch;
  batch.swap(completed_);  // nested Poll() from a callback gets a fresh one
  int side_event_error = 0;
  io_uring_cqe* cqes[kReapBatch];
  while (unsigned n = io_uring_peek_batch_cqe(ring, cqes, kReapBatch)) {
    unsigned ops = n;
    for (unsigned i = 0; i < n; ++i) {
      if (cqes[i]->user_data == kSideEvent) {
        side_event_armed_ = false;
        if (cqes[i]->res < 0) side_event_error = -cqes[i]->res;
        --ops;
        continue;
      }
      auto* request = static_cast<Request*>(io_uring_cqe_get_data(cqes[i]));
      SplitResult(request->run, cqes[i]->res);
      batch.insert(batch.end(), request->run.ops.begin(),
                   request->run.ops.end());
      free_requests_.push_back(request);
    }
    io_uring_cq_advance(ring, n);
    in_kernel_ -= ops;
  }
  DrainQueue();
  RunCallbacks(batch, in_flight_);
  batch.clear();
  if (completed_.capacity() < batch.capacity()) completed_.swap(batch);
  // The side pool's finished requests, whether or not its eventfd was read
  // yet (a count left behind only makes a later wait return early).
  if (side_ != nullptr && side_->in_flight() > 0) {
    absl::Status st = side_->Poll(/*wait=*/false);  // never fails
    if (!st.ok()) return st;
  }
  if (side_event_error != 0) {
    return EnterError("read of the side pool's eventfd", side_event_error);
  }
  return absl::OkStatus();
}

}  // namespace imgtool::io
