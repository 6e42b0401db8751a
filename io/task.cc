#include "io/task.h"

#include <coroutine>
#include <cstddef>
#include <deque>
#include <new>

namespace imgtool::io::internal {
namespace {

std::deque<std::coroutine_handle<>>& Deferred() {
  thread_local std::deque<std::coroutine_handle<>> deferred;
  return deferred;
}

}  // namespace

namespace {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kPoolFrames = false;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || \
    __has_feature(memory_sanitizer)
constexpr bool kPoolFrames = false;
#else
constexpr bool kPoolFrames = true;
#endif
#else
constexpr bool kPoolFrames = true;
#endif

constexpr std::size_t kFrameStep = 64;
constexpr std::size_t kFrameClasses = kMaxPooledFrame / kFrameStep;

struct FreeFrameNode {
  FreeFrameNode* next;
};

// One thread's free lists; the frames go back to the allocator when the
// thread exits.
struct FramePool {
  FreeFrameNode* lists[kFrameClasses] = {};
  std::size_t counts[kFrameClasses] = {};
  std::size_t total = 0;
  ~FramePool() {
    for (FreeFrameNode*& head : lists) {
      while (head != nullptr) {
        FreeFrameNode* next = head->next;
        ::operator delete(head);
        head = next;
      }
    }
  }
};

FramePool& Pool() {
  thread_local FramePool pool;
  return pool;
}

}  // namespace

void* AllocateFrame(std::size_t bytes) {
  if (!kPoolFrames || bytes > kMaxPooledFrame || bytes == 0) {
    return ::operator new(bytes);
  }
  const std::size_t index = (bytes - 1) / kFrameStep;
  FramePool& pool = Pool();
  if (FreeFrameNode* frame = pool.lists[index]; frame != nullptr) {
    pool.lists[index] = frame->next;
    --pool.counts[index];
    --pool.total;
    return frame;
  }
  return ::operator new((index + 1) * kFrameStep);
}

void FreeFrame(void* frame, std::size_t bytes) noexcept {
  if (!kPoolFrames || bytes > kMaxPooledFrame || bytes == 0) {
    ::operator delete(frame);
    return;
  }
  const std::size_t index = (bytes - 1) / kFrameStep;
  FramePool& pool = Pool();
  if (pool.counts[index] >= kMaxPooledPerClass) {
    ::operator delete(frame);
    return;
  }
  auto* node = static_cast<FreeFrameNode*>(frame);
  node->next = pool.lists[index];
  pool.lists[index] = node;
  ++pool.counts[index];
  ++pool.total;
}

std::size_t PooledFrames() { return Pool().total; }

bool FramePoolingEnabled() { return kPoolFrames; }

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
