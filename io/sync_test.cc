#include "io/sync.h"

#include <string>
#include <vector>

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

}  // namespace
}  // namespace imgtool::io
