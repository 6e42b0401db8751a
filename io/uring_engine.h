// io_uring backend of io::Engine, through liburing.
//
// Submit() only fills a submission queue entry (SQE) whose user_data points
// at the Op; the kernel sees the queued entries at the next Poll(), which
// makes one io_uring_enter call for the whole batch (submit, and with `wait`
// also wait for a completion) and then reaps every available completion
// (CQE) in batches. Only when the submission queue is full does Submit()
// hand the queued entries to the kernel itself.
//
// At most cq_entries (twice the ring size) requests are in the kernel at a
// time, so the completion queue can never overflow; requests beyond that wait
// in a user-space FIFO and go to the kernel as earlier ones complete.
//
// Registered files and buffers are not used: requests carry arbitrary fds and
// caller-owned iovecs, so registering would need a registration API in
// io::Engine and a buffer pool in every caller, for a gain that only shows at
// much higher IOPS than imgtool's 4 KiB..2 MiB requests reach.
//
// Thread model: like every engine, used from one thread (see io/engine.h).
#ifndef IMGTOOL_IO_URING_ENGINE_H_
#define IMGTOOL_IO_URING_ENGINE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/engine.h"

struct io_uring;

namespace imgtool::io {

class UringEngine : public Engine {
 public:
  // Sets up a ring with room for `queue_depth` requests (clamped to 1..4096,
  // rounded up to a power of two, at least 8). kUnavailable (with the cause,
  // e.g. "io_uring_queue_init: Operation not permitted") if the kernel
  // refuses io_uring.
  static absl::StatusOr<std::unique_ptr<Engine>> Create(int queue_depth);

  // Requests still in flight are cancelled by the kernel; their callbacks
  // never run. Callers finish their requests first.
  ~UringEngine() override;

  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  void Submit(Op* op) override;
  // Errors: the io_uring_enter failure (kInternal, or kUnavailable when the
  // kernel is short of resources and nothing is in flight to wait for).
  absl::Status Poll(bool wait) override;
  uint64_t in_flight() const override { return in_flight_; }
  const char* name() const override { return "io_uring"; }

  // Number of submission queue entries of the ring (a power of two).
  unsigned ring_entries() const { return ring_entries_; }

 private:
  explicit UringEngine(std::unique_ptr<io_uring> ring);

  // Fills an SQE for `op`. False if the kernel already holds the most
  // requests allowed or no SQE can be had; the caller then queues `op`.
  bool Prepare(Op* op);
  // Moves queued requests from overflow_ into SQEs while there is room.
  void DrainOverflow();

  std::unique_ptr<io_uring> ring_;
  unsigned ring_entries_ = 0;
  unsigned max_in_kernel_ = 0;  // the completion queue's size
  unsigned in_kernel_ = 0;      // SQEs filled whose CQE is not reaped yet
  uint64_t in_flight_ = 0;      // submitted, `done` not run yet
  std::deque<Op*> overflow_;    // submitted, no SQE yet (FIFO)
  std::vector<Op*> completed_;  // scratch for Poll(), kept for its capacity
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_URING_ENGINE_H_
