// Linux AIO backend of io::Engine (qemu-img's aio=native), through libaio.
//
// Reads and writes are Linux AIO requests (IOCB_CMD_PREAD/PWRITE for one
// buffer, PREADV/PWRITEV for several): io_submit does the filesystem's work
// that cannot wait (block allocation of a write that extends the file or
// hits unwritten extents) inline on the engine's thread, and the data
// transfer completes asynchronously. io_uring instead punts such O_DIRECT
// writes to its io-wq worker threads, one context switch pair per request.
// Linux AIO is only asynchronous for files opened with O_DIRECT; on other
// files io_submit performs the whole request before returning (QEMU refuses
// aio=native without cache.direct=on for that reason; this engine does not
// check).
//
// Submit() queues a read or write; one that does not continue the last one
// queued (io/coalesce.h ContinuesRun) first hands the queued ones to the
// kernel with one io_submit call. So a run of adjacent requests is
// submitted (merged) as soon as it is closed, and requests at random offsets
// go to the kernel one io_submit each as their callers make them, as fio's
// libaio engine and QEMU's linux-aio outside a plugged section submit. Poll()
// hands what is still queued to the kernel, then reaps completions (and, if
// requests still wait for room, submits again before the callbacks).
// Submitting only in Poll(), one io_submit for everything a round of
// callbacks made, left each request waiting for the callbacks after its own
// and for the whole batch in io_submit's block plug: 4 KiB random O_DIRECT
// writes at depth 64 on a RAM-backed XFS loop mount ran at 0.74-0.94 of
// fio's libaio rate in the same minutes, with idle CPU (README, "Session
// 30: requests go to the kernel as their runs close"). At most
// max_in_kernel() requests are in the kernel at a time; the others wait in
// a user-space FIFO and go to the kernel as earlier ones complete. A request
// io_submit refuses on its own (EBADF for a bad fd, or an fd not open for
// reading/writing; EINVAL) completes with that -errno in the same Poll().
// Completions are read from the AIO completion ring the kernel maps into
// the process (no syscall) and, when Poll must wait, with io_getevents.
//
// fsync, fdatasync and fallocate, which Linux AIO cannot do asynchronously
// (fallocate not at all; IOCB_CMD_FSYNC runs in a kernel workqueue), run on
// a side pool (a ThreadPoolEngine of 4 threads, started at the first such
// request), as QEMU's file-posix does with its thread pool. kPoll requests
// (a socket's readiness: the NBD server's epoll fd, libnbd's socket) are
// waited for on the engine's thread, as QEMU's event loop waits for its
// sockets beside the AIO eventfd: Poll() checks them with poll(2) (no
// timeout) while any is pending, and a waiting Poll sleeps in one poll(2)
// on them and the eventfd (a side thread per poll cost two thread switches
// and an eventfd wakeup per socket wait: the NBD server's depth-1 writes
// used 190-316 us of CPU per request against 84-90 us with io_uring).
// Every AIO request and every side completion signals one eventfd. A
// Poll(wait) with only reads and writes in flight sleeps in io_getevents,
// which returns their completions (no eventfd read); with side requests or
// polls in flight it sleeps in poll(2) on the eventfd (and the polled fds)
// until either kind finishes.
//
// Before it sleeps with reads or writes in the kernel, a Poll(wait) spins
// on the mapped completion ring (no syscall) for up to spin_ns(), adapted
// as QEMU adapts its event loop's polling time (util/aio-posix.c,
// adjust_polling_time; poll-max-ns, 32 us by default for its iothreads):
// it grows (doubling from 4 us up to kMaxSpinNs) while the sleeps that
// follow a fruitless spin are short, and drops to 0 after a sleep longer
// than kMaxSpinNs, so slow storage and an idle engine do not spin. A
// completion found while spinning keeps it. Sockets (kPoll) are not looked
// at while spinning: a request arriving then waits at most spin_ns(). At
// depth 1 this saves the sleep and the wakeup of every request (the NBD
// server's depth-1 writes over TCP: 1.13-1.17x the IOPS, the server's CPU
// per request unchanged; README, "Serving images over NBD"). The spin is
// CPU where the engine would have slept: a depth-1 workload on storage
// faster than kMaxSpinNs keeps its core busy while it waits.
//
// Thread model: like every engine, used from one thread (see io/engine.h);
// the side threads only run the blocking syscalls and never callbacks.
#ifndef IMGTOOL_IO_AIO_ENGINE_H_
#define IMGTOOL_IO_AIO_ENGINE_H_

#include <libaio.h>
#include <poll.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/coalesce.h"
#include "io/engine.h"
#include "io/thread_pool_engine.h"

namespace imgtool::io {

class AioEngine : public Engine {
 public:
  // Sets up an AIO context for max_in_kernel() = clamp(2 * queue_depth, 16,
  // 8192) requests and the eventfd. kUnavailable if the kernel refuses,
  // with QEMU's wording and the cause: "failed to create linux AIO context:
  // Resource temporarily unavailable" (the system-wide limit
  // /proc/sys/fs/aio-max-nr is reached) or "failed to initialize event
  // notifier: <strerror>".
  static absl::StatusOr<std::unique_ptr<Engine>> Create(int queue_depth);

  // Waits for the requests still in the kernel (io_destroy) and the side
  // pool's; callbacks of unfinished requests never run.
  // Callers finish their requests first.
  ~AioEngine() override;

  AioEngine(const AioEngine&) = delete;
  AioEngine& operator=(const AioEngine&) = delete;

  void Submit(Op* op) override;
  // Errors: kInternal for an io_submit/io_getevents/poll failure other than
  // a per-request one; kUnavailable when io_submit reports EAGAIN (kernel
  // short of resources) with nothing in flight to wait for.
  absl::Status Poll(bool wait) override;
  void Flush() override;
  uint64_t in_flight() const override;
  const char* name() const override { return "native"; }

  // Most reads and writes in the kernel at once (the AIO context's size).
  unsigned max_in_kernel() const { return max_in_kernel_; }

  // Read and write requests io_submit has accepted so far, a run of
  // adjacent ones merged into one request (io/coalesce.h) counting once;
  // for tests and benchmarks. Ops submitted minus this is what merging
  // saved.
  uint64_t requests_submitted() const { return requests_submitted_; }
  // The current spin time in nanoseconds (0..kMaxSpinNs).
  uint64_t spin_ns() const { return spin_ns_; }

  // The longest spin, and the first one after a drop to 0 (nanoseconds).
  static constexpr uint64_t kMaxSpinNs = 50'000;
  static constexpr uint64_t kFirstSpinNs = 4'000;
  // The spin time after a spin of `spin_ns` found nothing and the sleep
  // that followed took `slept_ns`: doubled (kFirstSpinNs from 0, at most
  // kMaxSpinNs) if slept_ns <= kMaxSpinNs, else 0.
  static uint64_t NextSpinNs(uint64_t spin_ns, uint64_t slept_ns);

 private:
  AioEngine(io_context_t context, int event_fd, unsigned max_in_kernel);

  // Hands queued_ to the kernel while there is room: one io_submit per
  // call in the usual case. Requests refused individually go to `done`.
  absl::Status SubmitQueued(std::vector<Op*>& done);
  // Moves finished AIO requests (from the mapped completion ring, or from
  // io_getevents if the ring's layout is unknown) to `done`; frees their
  // iocbs.
  void Reap(std::vector<Op*>& done);
  // Sets the results of the requests `cb` carried from `result`, moves
  // them to `done` and frees `cb`.
  void Finish(struct iocb* cb, int64_t result, std::vector<Op*>& done);
  // Takes the kernel's events (from either source) into `done`.
  void TakeEvents(const struct io_event* events, long count,
                  std::vector<Op*>& done);
  // Spin(), then Sleep() if that found nothing; adapts spin_ns_.
  absl::Status Wait(std::vector<Op*>& done);
  // Sleeps until a request in the kernel or in the side pool may have
  // finished, or a polled fd is ready; events io_getevents returns and
  // finished polls go to `done`.
  absl::Status Sleep(std::vector<Op*>& done);
  // poll(2) on the pending kPoll requests (and the eventfd when
  // `with_eventfd`, which is then drained) for up to `timeout_ms`; those
  // ready finish (result: revents) into `done`.
  absl::Status CheckPolls(int timeout_ms, bool with_eventfd,
                          std::vector<Op*>& done);
  bool side_busy() const { return side_ != nullptr && side_->in_flight() > 0; }
  // Spins on the mapped ring for up to spin_ns_ while requests are in the
  // kernel; true if that moved completions to `done`.
  bool Spin(std::vector<Op*>& done);
  // Reads (drains) the eventfd; EAGAIN (nothing counted) is no error.
  absl::Status ReadEventFd();
  // Called by Reap: `took` events from the kernel.
  void NoteTaken(bool took);

  io_context_t context_ = nullptr;
  int event_fd_ = -1;
  unsigned max_in_kernel_ = 0;

  // Reads, writes and polls submitted whose `done` has not run yet.
  uint64_t rw_in_flight_ = 0;
  std::vector<Op*> polls_;         // kPoll requests not ready yet
  std::vector<struct pollfd> pollfds_;  // scratch for CheckPolls
  unsigned in_kernel_ = 0;         // io_submit accepted, not reaped yet
  uint64_t requests_submitted_ = 0;
  std::deque<Op*> queued_;         // reads/writes not in the kernel (FIFO)
  std::vector<struct iocb> iocbs_;       // max_in_kernel_ slots
  std::vector<struct iocb*> free_iocbs_;
  // What iocbs_[i] carries: one request or a run merged (io/coalesce.h).
  std::vector<MergedRequest> runs_;
  std::vector<struct iocb*> batch_;      // scratch for io_submit
  std::vector<struct io_event> events_;  // scratch for io_getevents
  std::vector<Op*> completed_;           // scratch for Poll()
  // Every iocb signals the eventfd, which only Wait's poll(2) needs (with
  // kPoll requests pending). Events Reap takes from the mapped ring leave
  // their counts behind: eventfd_stale_ says so, and Wait reads them before
  // it polls (one read(2) instead of a poll(2) that returns at once and a
  // read). eventfd_just_read_: the last thing done was reading the
  // eventfd, so the events Reap takes next were counted by that read.
  bool eventfd_stale_ = false;
  bool eventfd_just_read_ = false;
  uint64_t spin_ns_ = 0;  // see the file comment
  // fsync, fdatasync, fallocate; null until the first one.
  std::unique_ptr<ThreadPoolEngine> side_;
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_AIO_ENGINE_H_
