// Thread-pool backend of io::Engine: worker threads make the blocking
// syscalls (preadv, pwritev, fsync, fdatasync, fallocate) and hand finished
// requests back to the engine's thread, which runs their callbacks in Poll().
// Workers start on demand, when a request is queued and no worker is idle,
// up to the limit given to the constructor, and live until destruction.
// The fallback when io_uring cannot be set up (see CreateEngine), and the
// side pool of AioEngine for the requests Linux AIO cannot do and of
// UringEngine for requests marked Op::may_block.
//
// Synchronization is std::mutex and std::condition_variable rather than
// absl::Mutex: Debian's Abseil is built without ThreadSanitizer
// annotations, so TSan (--config=tsan) cannot see absl::Mutex's
// happens-before edges and reports races on every request handed through
// the queues.
#ifndef IMGTOOL_IO_THREAD_POOL_ENGINE_H_
#define IMGTOOL_IO_THREAD_POOL_ENGINE_H_

#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/functional/any_invocable.h"
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
  // Guards pending_, finished_, idle_ and stopping_.
  std::mutex mu_;
  // Signalled when pending_ grows or stopping_ is set (workers wait).
  std::condition_variable work_cv_;
  // Signalled when finished_ grows (Poll(true) waits).
  std::condition_variable finished_cv_;
  std::deque<Op*> pending_;
  std::deque<Op*> finished_;
  int idle_ = 0;  // workers waiting for a request
  bool stopping_ = false;
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
