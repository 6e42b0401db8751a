// Thread-pool backend of io::Engine: worker threads make the blocking
// syscalls (preadv, pwritev, fsync, fdatasync, fallocate) and hand finished
// requests back to the engine's thread, which runs their callbacks in Poll().
// Workers start on demand, when a request is queued and no worker is idle,
// up to the limit given to the constructor, and live until destruction.
// The fallback when io_uring cannot be set up (see CreateEngine), and the
// side pool of AioEngine for the requests Linux AIO cannot do and of
// UringEngine for requests marked Op::may_block.
#ifndef IMGTOOL_IO_THREAD_POOL_ENGINE_H_
#define IMGTOOL_IO_THREAD_POOL_ENGINE_H_

#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"
#include "io/engine.h"

namespace imgtool::io {

class ThreadPoolEngine : public Engine {
 public:
  // Allows up to `threads` workers (clamped to 1..256). `on_finished`, if
  // set, runs on the worker thread after each request has finished and is
  // ready for Poll(): a way to wake up a thread waiting on something else
  // (AioEngine and UringEngine write an eventfd). It must be thread-safe and
  // must not call into the engine.
  explicit ThreadPoolEngine(int threads,
                            absl::AnyInvocable<void()> on_finished = nullptr);
  // Waits for the requests already queued to finish; their callbacks never
  // run.
  ~ThreadPoolEngine() override;

  void Submit(Op* op) override;
  absl::Status Poll(bool wait) override;
  uint64_t in_flight() const override { return in_flight_; }
  const char* name() const override { return "threads"; }

  // True if a request has finished whose callback the next Poll() runs.
  // Engine thread only.
  bool HasFinished();

  // Workers started so far (for tests).
  int threads_started() const { return static_cast<int>(workers_.size()); }

 private:
  void WorkerLoop();

  const int max_threads_;
  absl::Mutex mu_;
  std::deque<Op*> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<Op*> finished_ ABSL_GUARDED_BY(mu_);
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // workers waiting for a request
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::AnyInvocable<void()> on_finished_;
  uint64_t in_flight_ = 0;  // engine thread only
  std::vector<std::thread> workers_;  // engine thread only
};

// Performs `op`'s syscall synchronously and stores the result (bytes or
// -errno) in op->result. Reads and writes on a pipe or socket ignore the
// offset, as io_uring's do. Shared by the backends' fallbacks.
void ExecuteOpBlocking(Op* op);

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_THREAD_POOL_ENGINE_H_
