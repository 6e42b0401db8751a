// Task<T>: a lazily started C++20 coroutine returning T, awaited with
// co_await. Driver code is written as straight-line coroutines over it:
//
//   Task<absl::Status> Node::DoWrite(uint64_t offset, ConstIoVec data) {
//     CO_RETURN_IF_ERROR(co_await file().Write(offset, data));
//     co_return absl::OkStatus();
//   }
//
// Thread model: a task runs on the thread that resumes it, which is always
// the engine's polling thread (see io/engine.h). Tasks are move-only and own
// their coroutine frame; destroying an unfinished, suspended task is a bug.
//
// Stack depth: nothing here nests stack frames without bound. A task that
// finishes without suspending (e.g. a cache hit) hands control back to its
// awaiter without a nested call, so a loop awaiting a million such tasks
// runs in constant stack in every build mode (-O0 and ASan builds do not
// turn the compiler's symmetric transfer into a tail call). Code that wakes
// suspended coroutines (io/sync.h, engine callbacks) resumes them through
// Resume(), which bounds how deep wakeups that cause more wakeups nest.
#ifndef IMGTOOL_IO_TASK_H_
#define IMGTOOL_IO_TASK_H_

#include <coroutine>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <optional>
#include <type_traits>
#include <utility>

namespace imgtool::io {

template <typename T>
class Task;

// The most Resume() calls that run nested in each other on one thread; a
// Resume() at this depth defers its coroutine instead (see Resume()).
inline constexpr int kMaxResumeDepth = 32;

namespace internal {

// Resume() calls running on this thread's stack.
inline constinit thread_local int resume_depth = 0;
// Whether DeferResume() queued a coroutine that has not run yet.
inline constinit thread_local bool resume_deferred = false;

// Queues `h` to run once the outermost Resume() on this thread is done with
// its own coroutine (sets resume_deferred).
void DeferResume(std::coroutine_handle<> h);
// Runs the queued coroutines in the order they were queued, including the
// ones they queue in turn, until none is left. Called by the outermost
// Resume() only.
void RunDeferred();

}  // namespace internal

// Resumes the suspended coroutine `h` on this (the engine's) thread, like
// h.resume(), but bounds the stack: when kMaxResumeDepth Resume() calls are
// already running nested on this thread (a woken coroutine wakes another,
// which wakes another, ... as a chain of thousands of queued requests
// does), `h` is queued instead and Resume() returns before it has run. The
// outermost Resume() runs the queued coroutines, in the order they were
// queued, before it returns. So every coroutine woken through Resume() has
// run (until its next suspension) by the time the outermost Resume() on the
// stack returns, and coroutines woken from a shallow stack run before
// Resume() returns, as with h.resume(). Cost when not deferring: one
// thread-local increment and decrement. Each thread has its own depth and
// queue; `h` must be resumed on the thread it runs on (the engine's).
inline void Resume(std::coroutine_handle<> h) {
  int& depth = internal::resume_depth;
  if (depth >= kMaxResumeDepth) {
    internal::DeferResume(h);
    return;
  }
  ++depth;
  h.resume();
  if (depth == 1 && internal::resume_deferred) internal::RunDeferred();
  --depth;
}

namespace internal {

// Coroutine frames of Task and Detached (one or more per request on every
// I/O path: a raw image's write is eight nested tasks) come from per-thread
// free lists by size class (64-byte steps up to kMaxPooledFrame bytes, at
// most kMaxPooledPerClass kept per class) instead of malloc and free on each
// request. A frame freed on another thread goes to that thread's lists.
// Larger frames, and every frame in sanitizer builds (so that ASan still
// sees a use after free), go to operator new and delete.
inline constexpr std::size_t kMaxPooledFrame = 2048;
inline constexpr std::size_t kMaxPooledPerClass = 4096;
void* AllocateFrame(std::size_t bytes);
void FreeFrame(void* frame, std::size_t bytes) noexcept;
// Frames this thread holds in its free lists, and whether frames are
// pooled in this build (for tests).
std::size_t PooledFrames();
bool FramePoolingEnabled();

// Allocation of coroutine frames through AllocateFrame/FreeFrame; promise
// types derive from it.
struct PooledFrame {
  static void* operator new(std::size_t bytes) { return AllocateFrame(bytes); }
  static void operator delete(void* frame, std::size_t bytes) noexcept {
    FreeFrame(frame, bytes);
  }
};

struct PromiseBase : PooledFrame {
  // The coroutine awaiting this task (none for a task that was never
  // awaited).
  std::coroutine_handle<> continuation;
  // kStartedInline while Task::await_suspend runs the task on its stack;
  // kFinishedInline if the task finished before that returned; kSuspended
  // once the task suspended and its awaiter too.
  enum class State { kNotStarted, kStartedInline, kFinishedInline, kSuspended };
  State state = State::kNotStarted;

  std::suspend_always initial_suspend() noexcept { return {}; }
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <typename P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      PromiseBase& p = h.promise();
      if (p.state == State::kStartedInline) {
        // Back to Task::await_suspend, which continues the awaiter in place.
        p.state = State::kFinishedInline;
        return std::noop_coroutine();
      }
      std::coroutine_handle<> next = p.continuation;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { std::abort(); }
};

// Task::await_suspend: runs `task` until it suspends or finishes, with
// `awaiting` as its continuation; false (the awaiter goes on at once,
// without a nested call) if it finished.
template <typename Handle>
bool StartAwaited(Handle task, std::coroutine_handle<> awaiting) noexcept {
  PromiseBase& p = task.promise();
  p.continuation = awaiting;
  p.state = PromiseBase::State::kStartedInline;
  task.resume();
  if (p.state == PromiseBase::State::kFinishedInline) return false;
  p.state = PromiseBase::State::kSuspended;
  return true;
}

}  // namespace internal

template <typename T>
class [[nodiscard]] Task {
 public:
  struct promise_type : internal::PromiseBase {
    std::optional<T> value;
    Task get_return_object() {
      return Task(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    template <typename U>
    void return_value(U&& v) {
      value.emplace(std::forward<U>(v));
    }
  };

  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
    return internal::StartAwaited(handle_, awaiting);
  }
  T await_resume() { return std::move(*handle_.promise().value); }

 private:
  explicit Task(std::coroutine_handle<promise_type> h) : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

template <>
class [[nodiscard]] Task<void> {
 public:
  struct promise_type : internal::PromiseBase {
    Task get_return_object() {
      return Task(std::coroutine_handle<promise_type>::from_promise(*this));
    }
    void return_void() {}
  };

  Task(Task&& other) noexcept : handle_(std::exchange(other.handle_, {})) {}
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      if (handle_) handle_.destroy();
      handle_ = std::exchange(other.handle_, {});
    }
    return *this;
  }
  Task(const Task&) = delete;
  Task& operator=(const Task&) = delete;
  ~Task() {
    if (handle_) handle_.destroy();
  }

  bool await_ready() const noexcept { return false; }
  bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
    return internal::StartAwaited(handle_, awaiting);
  }
  void await_resume() {}

 private:
  explicit Task(std::coroutine_handle<promise_type> h) : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

// A fire-and-forget coroutine that starts at once and frees itself when it
// finishes. Use through Spawn().
struct Detached {
  struct promise_type : internal::PooledFrame {
    Detached get_return_object() { return {}; }
    std::suspend_never initial_suspend() noexcept { return {}; }
    std::suspend_never final_suspend() noexcept { return {}; }
    void return_void() {}
    void unhandled_exception() noexcept { std::abort(); }
  };
};

// Starts `task` now; `on_done` (if any) is called with its result when it
// finishes. The task runs until its first suspension before Spawn returns.
template <typename T, typename F>
Detached Spawn(Task<T> task, F on_done) {
  if constexpr (std::is_void_v<T>) {
    co_await std::move(task);
    on_done();
  } else {
    on_done(co_await std::move(task));
  }
}

inline Detached Spawn(Task<void> task) { co_await std::move(task); }

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_TASK_H_
