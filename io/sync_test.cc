#include "io/sync.h"

#include <memory>
#include <string>
#include <vector>

#include "base/testing/small_stack.h"
#include "gtest/gtest.h"
#include "io/task.h"

namespace imgtool::io {
namespace {

Task<void> Worker(Mutex& mu, Event& gate, std::vector<std::string>& log,
                  std::string name) {
  auto lock = co_await ScopedLock::Take(mu);
  log.push_back(name + " in");
  co_await gate.Wait();
  log.push_back(name + " out");
}

TEST(MutexTest, WaitersRunOneAtATimeInFifoOrder) {
  Mutex mu;
  Event gate;
  std::vector<std::string> log;
  Spawn(Worker(mu, gate, log, "a"));
  Spawn(Worker(mu, gate, log, "b"));
  Spawn(Worker(mu, gate, log, "c"));
  EXPECT_EQ(log, std::vector<std::string>({"a in"}));
  EXPECT_TRUE(mu.locked());
  gate.Set();  // a leaves, then b and c pass the set gate one after another
  EXPECT_EQ(log, std::vector<std::string>(
                     {"a in", "a out", "b in", "b out", "c in", "c out"}));
  EXPECT_FALSE(mu.locked());
}

TEST(EventTest, WaitAfterSetDoesNotSuspend) {
  Event e;
  e.Set();
  int ran = 0;
  Spawn([](Event& e, int& ran) -> Task<void> {
    co_await e.Wait();
    ++ran;
  }(e, ran));
  EXPECT_EQ(ran, 1);
}

// A chain of wakeups as deep as a queue of requests: every waiter, once
// woken, unlocks the mutex for the next. Each Unlock() used to resume the
// next waiter inside its own stack frame, 100000 frames deep: on a 256 KiB
// stack this crashed (SIGSEGV); ASan builds crashed on the 8 MiB main stack
// with a few thousand queued requests.
constexpr int kChain = 100000;
constexpr size_t kSmallStack = 256 << 10;

Task<void> TakeAndLog(Mutex& mu, std::vector<int>& order, int i) {
  auto lock = co_await ScopedLock::Take(mu);
  order.push_back(i);
}

TEST(MutexTest, ChainOfWaitersRunsInFifoOrderOnASmallStack) {
  testing::RunWithStack(kSmallStack, [] {
    Mutex mu;
    Event gate;
    std::vector<int> order;
    Spawn([](Mutex& mu, Event& gate) -> Task<void> {
      auto lock = co_await ScopedLock::Take(mu);
      co_await gate.Wait();
    }(mu, gate));
    for (int i = 0; i < kChain; ++i) Spawn(TakeAndLog(mu, order, i));
    EXPECT_TRUE(order.empty());
    gate.Set();  // releases the lock: every waiter runs before Set returns
    ASSERT_EQ(order.size(), kChain);
    for (int i = 0; i < kChain; ++i) ASSERT_EQ(order[i], i);
    EXPECT_FALSE(mu.locked());
  });
}

TEST(EventTest, ChainOfEventsRunsInOrderOnASmallStack) {
  testing::RunWithStack(kSmallStack, [] {
    // Waiter i waits for event i, then sets event i + 1.
    std::vector<std::unique_ptr<Event>> events;
    for (int i = 0; i <= kChain; ++i) events.push_back(std::make_unique<Event>());
    std::vector<int> order;
    for (int i = 0; i < kChain; ++i) {
      Spawn([](Event& mine, Event& next, std::vector<int>& order,
               int i) -> Task<void> {
        co_await mine.Wait();
        order.push_back(i);
        next.Set();
      }(*events[i], *events[i + 1], order, i));
    }
    events[0]->Set();
    EXPECT_TRUE(events[kChain]->is_set());
    ASSERT_EQ(order.size(), kChain);
    for (int i = 0; i < kChain; ++i) ASSERT_EQ(order[i], i);
  });
}

// Set() wakes its waiters in the order they waited, also when the wakeup is
// deferred past kMaxResumeDepth: then they all run, in order, after the
// coroutine that set the event has suspended or finished.
TEST(EventTest, DeepSetWakesWaitersInOrderAfterTheSetter) {
  Event deep;
  std::vector<std::string> log;
  for (const char* name : {"a", "b", "c"}) {
    Spawn([](Event& e, std::vector<std::string>& log,
             std::string name) -> Task<void> {
      co_await e.Wait();
      log.push_back(name);
    }(deep, log, name));
  }
  // A chain of kMaxResumeDepth events, the last of which sets `deep`.
  std::vector<std::unique_ptr<Event>> chain;
  for (int i = 0; i < kMaxResumeDepth; ++i) {
    chain.push_back(std::make_unique<Event>());
  }
  for (int i = 0; i < kMaxResumeDepth; ++i) {
    Spawn([](Event& mine, Event* next, Event& deep,
             std::vector<std::string>& log) -> Task<void> {
      co_await mine.Wait();
      if (next != nullptr) {
        next->Set();
        co_return;
      }
      deep.Set();  // kMaxResumeDepth Resume() calls deep: deferred
      log.push_back("setter");
    }(*chain[i], i + 1 < kMaxResumeDepth ? chain[i + 1].get() : nullptr,
      deep, log));
  }
  // From the test's frame (no Resume() running), Set() resumes chain[0]
  // through Resume() at depth 1, chain[i] at depth i + 1.
  chain[0]->Set();
  EXPECT_EQ(log, std::vector<std::string>({"setter", "a", "b", "c"}));
}

}  // namespace
}  // namespace imgtool::io
