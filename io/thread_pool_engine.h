// Thread-pool backend of io::Engine: worker threads make the blocking
// syscalls (preadv, pwritev, fsync, fdatasync, fallocate) and hand finished
// requests back to the engine's thread, which runs their callbacks in Poll().
// The fallback when io_uring cannot be set up (see CreateEngine), and the
// side pool of AioEngine for the requests Linux AIO cannot do.
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
  // Starts `threads` workers (1..256). `on_finished`, if set, runs on the
  // worker thread after each request has finished and is ready for Poll():
  // a way to wake up a thread waiting on something else (AioEngine writes
  // its eventfd). It must be thread-safe and must not call into the engine.
  explicit ThreadPoolEngine(int threads,
                            absl::AnyInvocable<void()> on_finished = nullptr);
  ~ThreadPoolEngine() override;

  void Submit(Op* op) override;
  absl::Status Poll(bool wait) override;
  uint64_t in_flight() const override { return in_flight_; }
  const char* name() const override { return "threads"; }

  // True if a request has finished whose callback the next Poll() runs.
  // Engine thread only.
  bool HasFinished();

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<Op*> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<Op*> finished_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::AnyInvocable<void()> on_finished_;
  uint64_t in_flight_ = 0;  // engine thread only
  std::vector<std::thread> workers_;
};

// Performs `op`'s syscall synchronously and stores the result (bytes or
// -errno) in op->result. Shared by the backends' fallbacks.
void ExecuteOpBlocking(Op* op);

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_THREAD_POOL_ENGINE_H_
