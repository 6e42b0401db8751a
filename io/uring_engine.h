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
// Requests marked Op::may_block (posix_file marks the writes that end past
// the file's length or fill a hole it knows of, and O_DIRECT requests
// longer than the device takes unsplit) bypass the ring: a side pool of worker threads (a
// ThreadPoolEngine, started by the first such request, up to
// min(queue_depth, 64) threads) makes their blocking syscalls, as qemu-img's
// aio=threads does for every request. XFS and ext4 refuse to extend a file
// or allocate blocks in a non-blocking O_DIRECT write, so io_uring would
// make the attempt, get -EAGAIN and punt the write to an io-wq worker, of
// which a ring has at most 4 per CPU for regular files: in the qcow2
// subcluster benchmark (benchmarks/subcluster_side_by_side.sh: 4 KiB
// writes each allocating a cluster at the end of the image, depth 64) every
// data write went that way, and imgtool reached 0.72..0.93 of qemu-img's
// IOPS at 256k..2M clusters. The side pool's workers add 1 to an eventfd
// after each request; while the pool is busy a read of that eventfd sits in
// the ring, so one io_uring_enter still waits for both paths, and Poll()
// collects the pool's finished requests on every call. Alternatives
// measured on the same cells (2 CPUs, kernel 6.18, XFS on a loop device):
// IOSQE_ASYNC on the marked writes (skips the failing attempt, still io-wq)
// and io_uring_register_iowq_max_workers(64) (more io-wq workers) were each
// better than plain io_uring in some cells but not steadily above qemu-img;
// see benchmarks/README.md for the figures.
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
#include "io/thread_pool_engine.h"

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
  uint64_t in_flight() const override {
    return in_flight_ + (side_ != nullptr ? side_->in_flight() : 0);
  }
  const char* name() const override { return "io_uring"; }

  // Number of submission queue entries of the ring (a power of two).
  unsigned ring_entries() const { return ring_entries_; }

  // Requests marked Op::may_block handed to the side pool so far (for
  // tests and benchmarks).
  uint64_t side_requests() const { return side_requests_; }

 private:
  UringEngine(std::unique_ptr<io_uring> ring, int side_threads);

  // Fills an SQE for `op`. False if the kernel already holds the most
  // requests allowed or no SQE can be had; the caller then queues `op`.
  bool Prepare(Op* op);
  // Moves queued requests from overflow_ into SQEs while there is room.
  void DrainOverflow();
  // Queues a read of side_event_fd_ (user_data kSideEvent) unless one is in
  // the kernel already. False if no SQE can be had.
  bool ArmSideEvent();

  std::unique_ptr<io_uring> ring_;
  unsigned ring_entries_ = 0;
  unsigned max_in_kernel_ = 0;  // the completion queue's size
  unsigned in_kernel_ = 0;      // SQEs filled whose CQE is not reaped yet
  uint64_t in_flight_ = 0;      // submitted, `done` not run yet
  std::deque<Op*> overflow_;    // submitted, no SQE yet (FIFO)
  std::vector<Op*> completed_;  // scratch for Poll(), kept for its capacity
  // Side pool for Op::may_block requests, started by the first one; its
  // workers signal side_event_fd_, which the ring reads.
  int side_threads_ = 0;
  int side_event_fd_ = -1;
  std::unique_ptr<ThreadPoolEngine> side_;
  bool side_event_armed_ = false;  // a read of side_event_fd_ is in the kernel
  uint64_t side_event_count_ = 0;  // its buffer
  uint64_t side_requests_ = 0;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_URING_ENGINE_H_
