// Asynchronous I/O engine: many read/write/fsync/fallocate requests in flight
// on file descriptors, completed on the thread that polls the engine.
//
// Backends: io_uring through liburing (kIoUring, the default), Linux AIO
// through libaio (kNative, qemu-img's aio=native; io/aio_engine.h) and a
// pool of worker threads making blocking syscalls (kThreads).
// CreateEngine(kAuto) tries io_uring and falls back to threads with a
// one-line notice.
//
// Thread model: Submit(), Poll() and the awaitables are used from one thread
// (the engine's thread); completion callbacks and resumed coroutines run on
// that thread inside Poll(). Only posix_file talks to the engine.
#ifndef IMGTOOL_IO_ENGINE_H_
#define IMGTOOL_IO_ENGINE_H_

#include <sys/uio.h>

#include <coroutine>
#include <cstdint>
#include <memory>
#include <optional>
#include <ostream>
#include <string>

#include "absl/functional/any_invocable.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/task.h"

namespace imgtool::io {

enum class OpKind {
  kRead,       // preadv(fd, iov, iovcnt, offset)
  kWrite,      // pwritev(fd, iov, iovcnt, offset)
  kFsync,      // fsync(fd)
  kFdatasync,  // fdatasync(fd)
  kFallocate,  // fallocate(fd, mode, offset, length)
  // poll(fd, events = `mode`): waits until the fd is ready for one of the
  // poll(2) events in `mode` (POLLIN, POLLOUT); result = the revents mask
  // (> 0, may include POLLERR/POLLHUP) or -errno. io_uring: IORING_OP_POLL_ADD;
  // the thread-pool and native engines make a blocking poll(2) in a worker
  // thread. Never merged with other requests. Used by nbd_block to wait on
  // libnbd's socket.
  kPoll,
};

// One request. The caller owns it and keeps it (and the memory iov points
// to) alive until `done` has run.
struct Op {
  OpKind kind = OpKind::kRead;
  int fd = -1;
  const struct iovec* iov = nullptr;  // kRead/kWrite
  int iovcnt = 0;                     // kRead/kWrite
  uint64_t offset = 0;                // bytes
  uint64_t length = 0;                // bytes, kFallocate only
  int mode = 0;                       // fallocate mode flags
  // Hint from the caller: the request is expected to block in the file
  // system instead of finishing without a wait, e.g. a write that ends past
  // the file's length or into a hole as far as the caller knows (the file
  // system must allocate blocks and maybe extend the file, which XFS and
  // ext4 refuse to do for a non-blocking O_DIRECT attempt), or an O_DIRECT
  // request the device has to split. Engines may route such requests
  // differently (UringEngine hands them to worker threads); a wrong hint
  // costs speed only, never correctness. Results, in_flight() and Poll()
  // behave the same either way.
  bool may_block = false;
  // kRead/kWrite: the most bytes a request this one is merged into may
  // carry (0: the engine's limit, kMaxMergedBytes in io/coalesce.h).
  // posix_file sets the largest request its device takes without splitting
  // (sysfs max_sectors_kb) for O_DIRECT files: merging never makes a request
  // the device must split, which io_uring would run inline.
  uint64_t merge_limit = 0;
  // Set before `done` runs: bytes transferred (>= 0; a short count is
  // possible and not retried by the engine) or -errno. The io_uring and
  // native engines merge adjacent reads or writes in flight together into
  // one request (io/coalesce.h); when that request transfers fewer bytes
  // than the whole run, the ops after the one the count ends in get
  // -EAGAIN: retry them (posix_file's FileIo does).
  int64_t result = 0;
  // Runs on the engine's thread, inside Poll(). May submit new requests.
  absl::AnyInvocable<void(Op&)> done;
};

enum class EngineKind { kAuto, kIoUring, kNative, kThreads };

// Parses qemu-img's `-i` names (and the `aio` option's values): "io_uring",
// "native" (Linux AIO), "threads". kInvalidArgument otherwise, with the
// message "Invalid aio option: <name>".
absl::StatusOr<EngineKind> ParseEngineKind(const std::string& name);

class Engine {
 public:
  virtual ~Engine() = default;

  // Queues `op`; it is handed to the kernel at the latest in the next Poll().
  virtual void Submit(Op* op) = 0;

  // Runs the callbacks of finished requests. With `wait` it blocks until at
  // least one request has finished (returns at once if none is in flight).
  // Errors only for an engine failure (io_uring_enter failing), never for a
  // failed request, which reports -errno in Op::result.
  virtual absl::Status Poll(bool wait) = 0;

  // Hands the requests Submit() queued to the kernel now instead of in the
  // next Poll(), without waiting and without running callbacks (those run
  // in Poll(), also for a request the kernel refuses at once). For a caller
  // that has queued requests and is about to do slower work of its own
  // first: the NBD server before it reads the next request from a socket.
  // A hint: an engine may keep them for the next Poll()'s batch (AioEngine
  // does while it has requests in the kernel). Default: nothing.
  virtual void Flush() {}

  // Requests submitted whose `done` has not run yet.
  virtual uint64_t in_flight() const = 0;

  // "io_uring", "native" or "threads" (the `-i` name).
  virtual const char* name() const = 0;

  // co_await engine.Run(op) submits `op` and resumes the coroutine (through
  // io::Resume()) with op.result when it completes. op.done is overwritten.
  auto Run(Op& op) {
    struct Awaiter {
      Engine& engine;
      Op& op;
      bool await_ready() const noexcept { return false; }
      void await_suspend(std::coroutine_handle<> h) {
        op.done = [h](Op&) { Resume(h); };
        engine.Submit(&op);
      }
      int64_t await_resume() const noexcept { return op.result; }
    };
    return Awaiter{*this, op};
  }

 protected:
  // For Poll(): runs the `done` callbacks of `finished` (Op* in completion
  // order), each after counting its request out of `in_flight`, since a
  // callback may look at in_flight() or submit new requests. The callback
  // is moved out of the Op first: it may reuse the Op for a new request.
  template <typename OpPointers>
  static void RunCallbacks(const OpPointers& finished, uint64_t& in_flight) {
    for (Op* op : finished) {
      --in_flight;
      auto callback = std::move(op->done);
      if (callback) callback(*op);
    }
  }
};

// `queue_depth` is the most requests the caller keeps in flight (1..4096);
// more are accepted but queue in user space. With kAuto, failure to set up
// io_uring writes "imgtool: io_uring unavailable (<cause>), using threads"
// to `notice` (if not null) and returns the thread-pool engine. Errors
// (kUnavailable): kIoUring when io_uring cannot be set up (the cause, e.g.
// "io_uring_queue_init: Operation not permitted"); kNative when Linux AIO
// cannot, in QEMU's words: "Unable to use native AIO: failed to create
// linux AIO context: <strerror>".
absl::StatusOr<std::unique_ptr<Engine>> CreateEngine(EngineKind kind,
                                                     int queue_depth,
                                                     std::ostream* notice);

// Drives `engine` until `task` has finished and returns its result. Used at
// the top of a command: RunSync(engine, node->Close()).
template <typename T>
T RunSync(Engine& engine, Task<T> task) {
  std::optional<T> result;
  Spawn(std::move(task), [&](T v) { result.emplace(std::move(v)); });
  while (!result.has_value()) {
    absl::Status st = engine.Poll(/*wait=*/true);
    if (!st.ok() || (engine.in_flight() == 0 && !result.has_value())) {
      // An engine failure, or a task waiting on nothing: cannot progress.
      std::abort();
    }
  }
  return std::move(*result);
}

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_ENGINE_H_
