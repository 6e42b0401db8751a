#include "io/task.h"

#include <coroutine>
#include <deque>

namespace imgtool::io::internal {
namespace {

std::deque<std::coroutine_handle<>>& Deferred() {
  thread_local std::deque<std::coroutine_handle<>> deferred;
  return deferred;
}

}  // namespace

void DeferResume(std::coroutine_handle<> h) {
  Deferred().push_back(h);
  resume_deferred = true;
}

void RunDeferred() {
  std::deque<std::coroutine_handle<>>& deferred = Deferred();
  while (!deferred.empty()) {
    std::coroutine_handle<> h = deferred.front();
    deferred.pop_front();
    h.resume();  // at depth 1: its own wakeups nest up to the limit again
  }
  resume_deferred = false;
}

}  // namespace imgtool::io::internal
