// io_uring backend of io::Engine, through liburing.
//
// Submit() only queues the Op in a user-space FIFO. Poll() takes the queue
// in order, merges each run of adjacent reads or writes (same fd and kind,
// consecutive byte ranges, up to IOV_MAX buffers and 1 MiB;
// io/coalesce.h) into one request, fills a submission queue entry (SQE)
// per request (user_data points at it), makes one io_uring_enter call to
// submit the whole batch and, with `wait` and no completion ready after it,
// a second one to wait (why two: uring_engine.cc, Poll), and then reaps
// every available completion (CQE) in batches, handing each merged result
// back to its Ops (a short count: -EAGAIN to the Ops it did not reach,
// which posix_file retries). When the submission queue fills
// while Poll() prepares entries, it hands them to the kernel on the way.
// Merging happens among requests queued between two Polls, i.e. in flight
// together, whose order among themselves no caller can rely on. Why: an
// O_DIRECT sequential stream at queue depth costs XFS and ext4 one
// unwritten-extent conversion or one exclusive-lock sub-block write per
// request (fio, XFS on a loop device: 16 KiB writes at depth 64 into a
// fallocated file 1212 MiB/s, 1 MiB writes 3699 MiB/s).
//
// At most cq_entries (twice the ring size) requests are in the kernel at a
// time, so the completion queue can never overflow; requests beyond that wait
// in the FIFO and go to the kernel as earlier ones complete.
//
// Requests marked Op::may_block (posix_file marks the writes that end past
// the file's length or fill a hole it knows of, and O_DIRECT requests
// longer than the device takes unsplit; a merged run if any of its Ops is
// marked) bypass the ring: a side pool of worker threads (a
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
// the ring, so the wait in io_uring_enter covers both paths, and Poll()
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
#include "io/coalesce.h"
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
  uint64_t in_flight() const override { return in_flight_; }
  const char* name() const override { return "io_uring"; }

  // Number of submission queue entries of the ring (a power of two).
  unsigned ring_entries() const { return ring_entries_; }

  // Ops handed to the side pool so far: those marked Op::may_block and
  // those merged with one (for tests and benchmarks).
  uint64_t side_requests() const { return side_requests_; }

  // Read and write requests handed on so far (an SQE filled, or a side-pool
  // request), a run of adjacent ones merged into one request counting once;
  // for tests and benchmarks. Ops submitted minus this is what merging
  // saved.
  uint64_t requests_submitted() const { return requests_submitted_; }

  // Poll() calls that slept in io_uring_enter for a completion (none was
  // ready after their submission); for tests.
  uint64_t waits() const { return waits_; }

 private:
  // One request handed on: an SQE's (user_data points here) or a side-pool
  // request's.
  struct Request {
    MergedRequest run;  // the Ops it carries; one for fsync and fallocate
    Op carrier;         // side pool only: the request the pool runs
  };

  UringEngine(std::unique_ptr<io_uring> ring, int side_threads);

  // A Request from free_requests_, or a new one.
  Request* NewRequest();
  // Fills an SQE for `request`. False if the kernel already holds the most
  // requests allowed or no SQE can be had; the caller then queues its Ops
  // again.
  bool Prepare(Request* request);
  // Starts the side pool and its eventfd unless running; false if the
  // eventfd cannot be had (then may_block requests take the ring path).
  bool StartSidePool();
  // Hands `request` to the side pool; its completion runs the callbacks of
  // its Ops and frees it.
  void SubmitToSidePool(Request* request);
  // Moves queued_ into requests (merging runs) for the ring while there is
  // room, and to the side pool when marked may_block.
  void DrainQueue();
  // Queues a read of side_event_fd_ (user_data kSideEvent) unless one is in
  // the kernel already. False if no SQE can be had.
  bool ArmSideEvent();

  std::unique_ptr<io_uring> ring_;
  unsigned ring_entries_ = 0;
  unsigned max_in_kernel_ = 0;  // the completion queue's size
  unsigned in_kernel_ = 0;      // SQEs filled whose CQE is not reaped yet
  // Submitted, `done` not run yet (in the queue, the ring or the side pool).
  uint64_t in_flight_ = 0;
  std::deque<Op*> queued_;      // submitted, not handed on yet (FIFO)
  // Every Request made (stable addresses), and those not in use.
  std::vector<std::unique_ptr<Request>> requests_;
  std::vector<Request*> free_requests_;
  uint64_t requests_submitted_ = 0;
  uint64_t waits_ = 0;
  std::vector<Op*> completed_;  // scratch for Poll(), kept for its capacity
  // Side pool for Op::may_block requests, started by the first one; its
  // workers signal side_event_fd_, which the ring reads.
  int side_threads_ = 0;
  int side_event_fd_ = -1;  // -2: eventfd() failed, no side pool
  std::unique_ptr<ThreadPoolEngine> side_;
  bool side_event_armed_ = false;  // a read of side_event_fd_ is in the kernel
  uint64_t side_event_count_ = 0;  // its buffer
  uint64_t side_requests_ = 0;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_URING_ENGINE_H_
