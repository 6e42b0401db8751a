// Coroutine synchronisation for node code running on one engine thread:
// a Mutex whose Lock() is awaited (waiters are resumed in FIFO order) and an
// Event that coroutines can await until it is set. Neither is thread-safe:
// like every node, they are used from the engine's thread only.
//
// Waking: Unlock() and Set() wake waiters through io::Resume() (io/task.h).
// From a shallow stack a woken waiter runs (until it next suspends) before
// Unlock()/Set() returns. When kMaxResumeDepth wakeups are already nested on
// the stack (a woken coroutine unlocks or sets something, whose waiter does
// the same, ... along a chain of thousands of queued requests), the waiter
// is queued instead and runs, in FIFO order with other queued ones, before
// the outermost Resume() on the stack returns. Either way a waiter that is
// woken is already chosen when Unlock()/Set() returns (the lock is its), and
// neither the Mutex nor the Event is touched when it runs: both may be
// destroyed right after Unlock()/Set().
#ifndef IMGTOOL_IO_SYNC_H_
#define IMGTOOL_IO_SYNC_H_

#include <coroutine>
#include <cstdint>
#include <deque>
#include <list>
#include <utility>

#include "io/task.h"

namespace imgtool::io {

class Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  // co_await mutex.Lock(); ... mutex.Unlock();  Prefer ScopedLock.
  auto Lock() {
    struct Awaiter {
      Mutex& m;
      bool await_ready() {
        if (m.locked_) return false;
        m.locked_ = true;
        return true;
      }
      // Ownership passes directly to the waiter in Unlock().
      void await_suspend(std::coroutine_handle<> h) { m.waiters_.push_back(h); }
      void await_resume() {}
    };
    return Awaiter{*this};
  }

  // Releases the mutex; the longest waiter (if any) now holds it and is
  // woken through io::Resume(): it runs before Unlock returns unless the
  // stack is already kMaxResumeDepth wakeups deep (see the file comment).
  void Unlock() {
    if (waiters_.empty()) {
      locked_ = false;
      return;
    }
    std::coroutine_handle<> next = waiters_.front();
    waiters_.pop_front();
    Resume(next);
  }

  bool locked() const { return locked_; }

 private:
  bool locked_ = false;
  std::deque<std::coroutine_handle<>> waiters_;
};

// Holds a Mutex until destroyed: `auto lock = co_await ScopedLock::Take(mu);`
class ScopedLock {
 public:
  ScopedLock(ScopedLock&& other) noexcept : mu_(std::exchange(other.mu_, nullptr)) {}
  ScopedLock& operator=(ScopedLock&&) = delete;
  ~ScopedLock() { Release(); }

  static auto Take(Mutex& mu) {
    struct Awaiter {
      Mutex& mu;
      decltype(mu.Lock()) inner;
      bool await_ready() { return inner.await_ready(); }
      void await_suspend(std::coroutine_handle<> h) { inner.await_suspend(h); }
      ScopedLock await_resume() { return ScopedLock(&mu); }
    };
    return Awaiter{mu, mu.Lock()};
  }

  // Unlocks early; the destructor then does nothing.
  void Release() {
    if (mu_ != nullptr) std::exchange(mu_, nullptr)->Unlock();
  }

 private:
  explicit ScopedLock(Mutex* mu) : mu_(mu) {}
  Mutex* mu_;
};

// A one-shot event: Wait() suspends until Set(); after Set() it never
// suspends. Set() wakes every waiter, in the order they waited, through
// io::Resume(): they run before Set returns unless the stack is already
// kMaxResumeDepth wakeups deep (see the file comment).
class Event {
 public:
  auto Wait() {
    struct Awaiter {
      Event& e;
      bool await_ready() const { return e.set_; }
      void await_suspend(std::coroutine_handle<> h) { e.waiters_.push_back(h); }
      void await_resume() {}
    };
    return Awaiter{*this};
  }

  void Set() {
    set_ = true;
    std::deque<std::coroutine_handle<>> waiters;
    waiters.swap(waiters_);
    for (std::coroutine_handle<> h : waiters) Resume(h);
  }

  bool is_set() const { return set_; }

 private:
  bool set_ = false;
  std::deque<std::coroutine_handle<>> waiters_;
};

// Requests in flight over byte ranges of one node, as QEMU's tracked
// requests (BdrvTrackedRequest and bdrv_wait_serialising_requests in
// block/io.c): a request waits while another one overlaps it, either of
// the two is serialising and the other is not itself waiting (so that two
// never wait for each other). Ranges are [start, end) in bytes. Requests
// are owned by their callers (usually a local of the coroutine) and must
// be ended before they are destroyed. Not thread-safe, as Mutex and Event.
class TrackedRequests {
 public:
  struct Request {
    uint64_t start = 0;
    uint64_t end = 0;
    bool serialising = false;
    Request* waiting_for = nullptr;
    Event done;  // set by End()
  };

  // Starts tracking `r` (before its first wait).
  void Begin(Request& r) { requests_.push_back(&r); }

  // Returns once no conflicting request overlaps `self` (see above).
  Task<void> WaitForConflicts(Request& self) {
    for (;;) {
      Request* conflict = nullptr;
      for (Request* other : requests_) {
        if (other == &self || (!other->serialising && !self.serialising)) {
          continue;
        }
        if (other->start < self.end && self.start < other->end &&
            other->waiting_for == nullptr) {
          conflict = other;
          break;
        }
      }
      if (conflict == nullptr) co_return;
      self.waiting_for = conflict;
      co_await conflict->done.Wait();
      self.waiting_for = nullptr;
    }
  }

  // Ends `r`'s tracking and wakes the requests waiting for it.
  void End(Request& r) {
    requests_.remove(&r);
    r.done.Set();
  }

 private:
  std::list<Request*> requests_;  // not owned
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_SYNC_H_
