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
#ifndef IMGTOOL_IO_TASK_H_
#define IMGTOOL_IO_TASK_H_

#include <coroutine>
#include <cstdlib>
#include <exception>
#include <optional>
#include <utility>

namespace imgtool::io {

template <typename T>
class Task;

namespace internal {

struct PromiseBase {
  std::coroutine_handle<> continuation;

  std::suspend_always initial_suspend() noexcept { return {}; }
  struct FinalAwaiter {
    bool await_ready() noexcept { return false; }
    template <typename P>
    std::coroutine_handle<> await_suspend(std::coroutine_handle<P> h) noexcept {
      std::coroutine_handle<> next = h.promise().continuation;
      return next ? next : std::noop_coroutine();
    }
    void await_resume() noexcept {}
  };
  FinalAwaiter final_suspend() noexcept { return {}; }
  void unhandled_exception() noexcept { std::abort(); }
};

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
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiting) noexcept {
    handle_.promise().continuation = awaiting;
    return handle_;
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
  std::coroutine_handle<> await_suspend(std::coroutine_handle<> awaiting) noexcept {
    handle_.promise().continuation = awaiting;
    return handle_;
  }
  void await_resume() {}

 private:
  explicit Task(std::coroutine_handle<promise_type> h) : handle_(h) {}
  std::coroutine_handle<promise_type> handle_;
};

// A fire-and-forget coroutine that starts at once and frees itself when it
// finishes. Use through Spawn().
struct Detached {
  struct promise_type {
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
