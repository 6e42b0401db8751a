#include "io/thread_pool_engine.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <utility>

namespace imgtool::io {

void ExecuteOpBlocking(Op* op) {
  ssize_t r = 0;
  switch (op->kind) {
    case OpKind::kRead:
      r = preadv(op->fd, op->iov, op->iovcnt, static_cast<off_t>(op->offset));
      // A pipe or socket: at the current position, as io_uring does.
      if (r < 0 && errno == ESPIPE) r = readv(op->fd, op->iov, op->iovcnt);
      break;
    case OpKind::kWrite:
      r = pwritev(op->fd, op->iov, op->iovcnt, static_cast<off_t>(op->offset));
      if (r < 0 && errno == ESPIPE) r = writev(op->fd, op->iov, op->iovcnt);
      break;
    case OpKind::kFsync:
      r = fsync(op->fd);
      break;
    case OpKind::kFdatasync:
      r = fdatasync(op->fd);
      break;
    case OpKind::kFallocate:
      r = fallocate(op->fd, op->mode, static_cast<off_t>(op->offset),
                    static_cast<off_t>(op->length));
      break;
    case OpKind::kPoll: {
      struct pollfd p = {.fd = op->fd,
                         .events = static_cast<short>(op->mode),
                         .revents = 0};
      do {
        r = poll(&p, 1, -1);
      } while (r < 0 && errno == EINTR);
      if (r > 0) r = p.revents;
      break;
    }
  }
  op->result = r < 0 ? -errno : r;
}

ThreadPoolEngine::ThreadPoolEngine(int threads,
                                   absl::AnyInvocable<void()> on_finished)
    : max_threads_(std::clamp(threads, 1, 256)),
      on_finished_(std::move(on_finished)) {}

ThreadPoolEngine::~ThreadPoolEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPoolEngine::Submit(Op* op) {
  ++in_flight_;
  bool start_worker;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(op);
    start_worker = pending_.size() > static_cast<size_t>(idle_) &&
                   workers_.size() < static_cast<size_t>(max_threads_);
  }
  work_cv_.notify_one();
  if (start_worker) workers_.emplace_back([this] { WorkerLoop(); });
}

void ThreadPoolEngine::WorkerLoop() {
  while (true) {
    Op* op = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu_);
      ++idle_;
      work_cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
      --idle_;
      if (pending_.empty()) return;  // stopping
      op = pending_.front();
      pending_.pop_front();
    }
    ExecuteOpBlocking(op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_.push_back(op);
    }
    finished_cv_.notify_one();
    if (on_finished_) on_finished_();
  }
}

bool ThreadPoolEngine::HasFinished() {
  std::lock_guard<std::mutex> lock(mu_);
  return !finished_.empty();
}

absl::Status ThreadPoolEngine::Poll(bool wait) {
  std::deque<Op*> done;
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (wait && in_flight_ > 0) {
      finished_cv_.wait(lock, [this] { return !finished_.empty(); });
    }
    done.swap(finished_);
  }
  RunCallbacks(done, in_flight_);
  return absl::OkStatus();
}

}  // namespace imgtool::io
