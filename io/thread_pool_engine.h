// Thread-pool backend of io::Engine: worker threads make the blocking
// syscalls (preadv, pwritev, fsync, fdatasync, fallocate) and hand finished
// requests back to the engine's thread, which runs their callbacks in Poll().
// The fallback when io_uring cannot be set up (see CreateEngine).
#ifndef IMGTOOL_IO_THREAD_POOL_ENGINE_H_
#define IMGTOOL_IO_THREAD_POOL_ENGINE_H_

#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "io/engine.h"

namespace imgtool::io {

class ThreadPoolEngine : public Engine {
 public:
  // Starts `threads` workers (1..256).
  explicit ThreadPoolEngine(int threads);
  ~ThreadPoolEngine() override;

  void Submit(Op* op) override;
  absl::Status Poll(bool wait) override;
  uint64_t in_flight() const override { return in_flight_; }
  const char* name() const override { return "threads"; }

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<Op*> pending_ ABSL_GUARDED_BY(mu_);
  std::deque<Op*> finished_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t in_flight_ = 0;  // engine thread only
  std::vector<std::thread> workers_;
};

// Performs `op`'s syscall synchronously and stores the result (bytes or
// -errno) in op->result. Shared by the backends' fallbacks.
void ExecuteOpBlocking(Op* op);

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_THREAD_POOL_ENGINE_H_
