#include "io/task.h"

#include <coroutine>
#include <cstdint>
#include <vector>

#include "base/testing/small_stack.h"
#include "gtest/gtest.h"

namespace imgtool::io {
namespace {

constexpr size_t kSmallStack = 256 << 10;

Task<int> Identity(int i) { co_return i; }

Task<int64_t> SumOfFinishedTasks(int n) {
  int64_t sum = 0;
  for (int i = 0; i < n; ++i) sum += co_await Identity(i);
  co_return sum;
}

// Tasks that finish without suspending hand control back without a nested
// call. Before, awaiting one nested two frames per iteration in -O0 and ASan
// builds, where GCC does not make symmetric transfer a tail call: a million
// iterations crashed there (optimised builds were fine).
TEST(TaskTest, LoopOverFinishedTasksRunsOnASmallStack) {
  testing::RunWithStack(kSmallStack, [] {
    int64_t sum = -1;
    Spawn(SumOfFinishedTasks(1000000), [&](int64_t s) { sum = s; });
    EXPECT_EQ(sum, int64_t{1000000} * 999999 / 2);
  });
}

// Stores the address of the coroutine frame that awaits it.
struct RecordFrame {
  void** out;
  bool await_ready() const { return false; }
  bool await_suspend(std::coroutine_handle<> h) {
    *out = h.address();
    return false;  // go on at once
  }
  void await_resume() {}
};

Task<void> FrameOf(void** out) { co_await RecordFrame{out}; }

Task<void> TwoTasksInTurn(void** first, void** second) {
  co_await FrameOf(first);
  co_await FrameOf(second);
}

// The second task's frame is the first's, taken back from this thread's
// free list instead of from malloc (not in sanitizer builds, which use
// operator new and delete for every frame).
TEST(TaskTest, FrameOfAFinishedTaskIsReused) {
  if (!internal::FramePoolingEnabled()) GTEST_SKIP() << "sanitizer build";
  void* first = nullptr;
  void* second = nullptr;
  bool done = false;
  Spawn(TwoTasksInTurn(&first, &second), [&] { done = true; });
  ASSERT_TRUE(done);
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first, second);
  EXPECT_GE(internal::PooledFrames(), 2u);  // TwoTasksInTurn's and Spawn's
}

// A coroutine suspended on a handle the test resumes. (Await a local
// reference to it: GCC 12 copies an awaiter that `co_await v[i]` names.)
struct Parked {
  std::coroutine_handle<> handle;
  bool await_ready() const { return false; }
  void await_suspend(std::coroutine_handle<> h) { handle = h; }
  void await_resume() {}
};

Task<int> SuspendThenReturn(Parked& parked, int v) {
  co_await parked;
  co_return v;
}

Task<int> AwaitSuspending(Parked& parked, std::vector<int>& log) {
  log.push_back(1);
  const int v = co_await SuspendThenReturn(parked, 7);
  log.push_back(v);
  const int w = co_await Identity(8);  // finishes at once
  log.push_back(w);
  co_return v + w;
}

TEST(TaskTest, AwaiterContinuesWhenASuspendedTaskFinishes) {
  Parked parked;
  std::vector<int> log;
  int result = 0;
  Spawn(AwaitSuspending(parked, log), [&](int r) { result = r; });
  EXPECT_EQ(log, std::vector<int>({1}));
  ASSERT_TRUE(parked.handle);
  Resume(parked.handle);
  EXPECT_EQ(log, std::vector<int>({1, 7, 8}));
  EXPECT_EQ(result, 15);
}

// Resume() past kMaxResumeDepth nested calls defers the coroutine; the
// outermost Resume() runs the deferred ones in order before returning.
TEST(ResumeTest, DeepResumesAreDeferredToTheOutermostInOrder) {
  std::vector<Parked> parked(kMaxResumeDepth + 3);
  std::vector<int> log;
  // Coroutine i logs i, then resumes coroutine i + 1; the deepest also
  // resumes the three after it, which Resume() must defer.
  for (size_t i = 0; i < parked.size(); ++i) {
    Spawn([](std::vector<Parked>& parked, std::vector<int>& log,
             int i) -> Task<void> {
      Parked& mine = parked[i];
      co_await mine;
      log.push_back(i);
      if (i + 1 < kMaxResumeDepth) {
        Resume(parked[i + 1].handle);
      } else if (i + 1 == kMaxResumeDepth) {
        for (int j = i + 1; j < kMaxResumeDepth + 3; ++j) {
          Resume(parked[j].handle);
        }
        log.push_back(-1);  // the three have not run yet
      }
    }(parked, log, i));
  }
  Resume(parked[0].handle);
  std::vector<int> expected;
  for (int i = 0; i < kMaxResumeDepth; ++i) expected.push_back(i);
  expected.push_back(-1);
  for (int i = kMaxResumeDepth; i < kMaxResumeDepth + 3; ++i) {
    expected.push_back(i);
  }
  EXPECT_EQ(log, expected);
}

}  // namespace
}  // namespace imgtool::io
