#include "io/engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "io/thread_pool_engine.h"

namespace imgtool::io {
namespace {

Task<int64_t> WriteThenRead(Engine& engine, int fd, uint64_t offset) {
  std::string data = "hello " + std::to_string(offset);
  struct iovec wv = {data.data(), data.size()};
  Op w{.kind = OpKind::kWrite, .fd = fd, .iov = &wv, .iovcnt = 1, .offset = offset};
  int64_t written = co_await engine.Run(w);
  if (written != static_cast<int64_t>(data.size())) co_return -1;
  std::string back(data.size(), '\0');
  struct iovec rv = {back.data(), back.size()};
  Op r{.kind = OpKind::kRead, .fd = fd, .iov = &rv, .iovcnt = 1, .offset = offset};
  int64_t n = co_await engine.Run(r);
  co_return back == data ? n : -2;
}

Task<int64_t> ManyInFlight(Engine& engine, int fd, int count) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) total += co_await WriteThenRead(engine, fd, i * 4096);
  co_return total;
}

TEST(ThreadPoolEngineTest, WritesAndReadsBackThroughCoroutines) {
  char path[] = "/tmp/engine_testXXXXXX";
  int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ThreadPoolEngine engine(4);
  EXPECT_EQ(RunSync(engine, WriteThenRead(engine, fd, 8192)), 10);
  int64_t expected = 0;
  for (int i = 0; i < 100; ++i) expected += 6 + std::to_string(i * 4096).size();
  EXPECT_EQ(RunSync(engine, ManyInFlight(engine, fd, 100)), expected);
  close(fd);
  unlink(path);
}

}  // namespace
}  // namespace imgtool::io
