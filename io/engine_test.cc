#include "io/engine.h"

#include <fcntl.h>
#include <poll.h>
#include <linux/magic.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/aio_engine.h"
#include "io/aligned_buffer.h"
#include "io/task.h"
#include "io/thread_pool_engine.h"
#include "io/uring_engine.h"

namespace imgtool::io {
namespace {

constexpr uint64_t kBlock = 4096;

std::string TestDir() {
  const char* dir = std::getenv("TEST_TMPDIR");
  return dir != nullptr ? dir : "/tmp";
}

// A directory on a disk file system for O_DIRECT files: /var/tmp (tmpfs, a
// usual /tmp, refuses O_DIRECT), or TEST_TMPDIR where Bazel's sandbox makes
// /var/tmp read-only, if that is not tmpfs. Empty if neither fits.
std::string DirectIoDir() {
  for (const std::string& dir : {std::string("/var/tmp"), TestDir()}) {
    struct statfs fs;
    if (access(dir.c_str(), W_OK) == 0 && statfs(dir.c_str(), &fs) == 0 &&
        fs.f_type != TMPFS_MAGIC) {
      return dir;
    }
  }
  return "";
}

// A temporary file, removed (and its fd closed) on destruction.
class TempFile {
 public:
  explicit TempFile(const std::string& dir, int extra_flags = 0)
      : path_(dir + "/engine_testXXXXXX") {
    fd_ = mkostemp(path_.data(), extra_flags);
  }
  ~TempFile() {
    if (fd_ >= 0) close(fd_);
    unlink(path_.c_str());
  }
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

std::string PRead(int fd, size_t length, off_t offset) {
  std::string out(length, '\0');
  ssize_t n = pread(fd, out.data(), length, offset);
  out.resize(n < 0 ? 0 : static_cast<size_t>(n));
  return out;
}

// Block `index` of the 256-request test: byte j is (index + j) mod 256, so
// every block differs from every other.
std::string Pattern(int index, size_t length) {
  std::string block(length, '\0');
  for (size_t j = 0; j < length; ++j) {
    block[j] = static_cast<char>((index + j) & 0xff);
  }
  return block;
}

Task<int64_t> RunOp(Engine& engine, Op op) {
  co_return co_await engine.Run(op);
}

// Writes `data` in three pieces with one request, reads it back in two and
// returns the bytes read, or -1000 if the content differs.
Task<int64_t> WriteThenRead(Engine& engine, int fd, uint64_t offset,
                            std::string data) {
  const size_t third = data.size() / 3;
  struct iovec wv[3] = {{data.data(), third},
                        {data.data() + third, third},
                        {data.data() + 2 * third, data.size() - 2 * third}};
  Op w{.kind = OpKind::kWrite, .fd = fd, .iov = wv, .iovcnt = 3,
       .offset = offset};
  int64_t written = co_await engine.Run(w);
  if (written != static_cast<int64_t>(data.size())) co_return written;
  std::string back(data.size(), '\0');
  struct iovec rv[2] = {{back.data(), 5}, {back.data() + 5, back.size() - 5}};
  Op r{.kind = OpKind::kRead, .fd = fd, .iov = rv, .iovcnt = 2,
       .offset = offset};
  int64_t n = co_await engine.Run(r);
  co_return back == data ? n : -1000;
}

Task<int64_t> WriteThenReadMany(Engine& engine, int fd, int count) {
  int64_t total = 0;
  for (int i = 0; i < count; ++i) {
    total += co_await WriteThenRead(engine, fd, i * kBlock,
                                    "hello " + std::to_string(i * kBlock));
  }
  co_return total;
}

Task<void> WriteBlock(Engine& engine, int fd, int index, int64_t* result) {
  std::string block = Pattern(index, kBlock);
  struct iovec iov = {block.data(), block.size()};
  Op op{.kind = OpKind::kWrite, .fd = fd, .iov = &iov, .iovcnt = 1,
        .offset = index * kBlock};
  *result = co_await engine.Run(op);
}

const char* KindName(EngineKind kind) {
  switch (kind) {
    case EngineKind::kIoUring:
      return "io_uring";
    case EngineKind::kNative:
      return "native";
    case EngineKind::kThreads:
      return "threads";
    case EngineKind::kAuto:
      break;
  }
  return "auto";
}

class EngineTest : public ::testing::TestWithParam<EngineKind> {
 protected:
  std::unique_ptr<Engine> MakeEngine(int queue_depth) {
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        CreateEngine(GetParam(), queue_depth, nullptr);
    EXPECT_TRUE(engine.ok()) << engine.status();
    if (!engine.ok()) return nullptr;
    EXPECT_STREQ((*engine)->name(), KindName(GetParam()));
    return *std::move(engine);
  }

  // Polls until nothing is in flight.
  static void Drain(Engine& engine) {
    while (engine.in_flight() > 0) {
      absl::Status st = engine.Poll(/*wait=*/true);
      ASSERT_TRUE(st.ok()) << st;
    }
  }
};

TEST_P(EngineTest, WritesAndReadsBackThroughCoroutines) {
  std::unique_ptr<Engine> engine = MakeEngine(16);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  EXPECT_EQ(RunSync(*engine, WriteThenRead(*engine, file.fd(), 8192,
                                           "hello world")),
            11);
  EXPECT_EQ(PRead(file.fd(), 11, 8192), "hello world");
  int64_t expected = 0;
  for (int i = 0; i < 100; ++i) expected += 6 + std::to_string(i * kBlock).size();
  EXPECT_EQ(RunSync(*engine, WriteThenReadMany(*engine, file.fd(), 100)),
            expected);
  EXPECT_EQ(engine->in_flight(), 0u);
}

TEST_P(EngineTest, PollWithNothingInFlightReturnsAtOnce) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  EXPECT_TRUE(engine->Poll(/*wait=*/true).ok());
  EXPECT_TRUE(engine->Poll(/*wait=*/false).ok());
  EXPECT_EQ(engine->in_flight(), 0u);
}

TEST_P(EngineTest, Keeps256RequestsInFlight) {
  std::unique_ptr<Engine> engine = MakeEngine(256);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr int kCount = 256;
  std::vector<int64_t> results(kCount, -1);
  for (int i = 0; i < kCount; ++i) {
    Spawn(WriteBlock(*engine, file.fd(), i, &results[i]));
  }
  // Each coroutine is suspended in its write: all 256 are in flight at once.
  EXPECT_EQ(engine->in_flight(), 256u);
  Drain(*engine);
  for (int i = 0; i < kCount; ++i) {
    EXPECT_EQ(results[i], static_cast<int64_t>(kBlock)) << "block " << i;
  }
  struct stat st;
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(kCount * kBlock));
  for (int i = 0; i < kCount; ++i) {
    ASSERT_EQ(PRead(file.fd(), kBlock, i * kBlock), Pattern(i, kBlock))
        << "block " << i;
  }
}

// Every third request is marked may_block (UringEngine's side pool): both
// paths together give the same results and counts as the ring alone.
TEST_P(EngineTest, QueuesMoreRequestsThanTheQueueDepth) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr int kCount = 1000;
  std::vector<std::string> data(kCount);
  std::vector<struct iovec> iovs(kCount);
  std::vector<Op> ops(kCount);
  int completed = 0;
  for (int i = 0; i < kCount; ++i) {
    data[i] = Pattern(i, 512);
    iovs[i] = {data[i].data(), data[i].size()};
    ops[i].kind = OpKind::kWrite;
    ops[i].fd = file.fd();
    ops[i].iov = &iovs[i];
    ops[i].iovcnt = 1;
    ops[i].offset = i * 512;
    ops[i].may_block = i % 3 == 0;
    ops[i].done = [&completed](Op& op) {
      EXPECT_EQ(op.result, 512);
      ++completed;
    };
    engine->Submit(&ops[i]);
  }
  EXPECT_EQ(engine->in_flight(), static_cast<uint64_t>(kCount));
  Drain(*engine);
  EXPECT_EQ(completed, kCount);
  for (int i = 0; i < kCount; ++i) {
    ASSERT_EQ(PRead(file.fd(), 512, i * 512), data[i]) << "request " << i;
  }
}

// kPoll (nbd_block waits on libnbd's socket with it): waits until the fd
// is ready and returns the revents mask; two polls of one fd are never
// merged.
TEST_P(EngineTest, PollWaitsForTheFdToBeReady) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
  Op readable{.kind = OpKind::kPoll, .fd = fds[0], .mode = POLLIN};
  Op writable{.kind = OpKind::kPoll, .fd = fds[1], .mode = POLLOUT};
  Op again{.kind = OpKind::kPoll, .fd = fds[0], .mode = POLLIN};
  int finished = 0;
  readable.done = [&](Op&) { ++finished; };
  writable.done = [&](Op&) { ++finished; };
  again.done = [&](Op&) { ++finished; };
  engine->Submit(&readable);
  engine->Submit(&again);
  engine->Submit(&writable);
  while (finished < 1) ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
  EXPECT_EQ(finished, 1);  // only the write end is ready
  EXPECT_EQ(writable.result, POLLOUT);
  ASSERT_EQ(write(fds[1], "x", 1), 1);
  while (finished < 3) ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
  EXPECT_EQ(readable.result & POLLIN, POLLIN);
  EXPECT_EQ(again.result & POLLIN, POLLIN);
  EXPECT_EQ(engine->in_flight(), 0u);
  close(fds[0]);
  close(fds[1]);
}

// A poll pending while O_DIRECT reads and writes come and go (the NBD
// server's epoll wait beside its image I/O; the native engine waits for
// both in one poll(2) on its thread): the I/O finishes without the poll,
// and the poll finishes once its fd is ready, with the I/O still going on.
TEST_P(EngineTest, PollPendingBesideDirectIo) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  std::string dir = DirectIoDir();
  if (dir.empty()) GTEST_SKIP() << "no writable disk-backed directory";
  TempFile file(dir, O_DIRECT);
  ASSERT_GE(file.fd(), 0) << dir << ": " << strerror(errno);
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
  Op poll_op{.kind = OpKind::kPoll, .fd = fds[0], .mode = POLLIN};
  bool polled = false;
  poll_op.done = [&](Op&) { polled = true; };
  engine->Submit(&poll_op);
  AlignedBuffer buf(kBlock);
  for (size_t i = 0; i < buf.size(); ++i) buf.data()[i] = 0x5a;
  struct iovec v = {buf.data(), buf.size()};
  for (int round = 0; round < 3; ++round) {
    EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kWrite,
                                                 .fd = file.fd(),
                                                 .iov = &v,
                                                 .iovcnt = 1,
                                                 .offset = round * kBlock})),
              static_cast<int64_t>(kBlock));
    EXPECT_FALSE(polled);
  }
  EXPECT_EQ(engine->in_flight(), 1u);  // the poll
  ASSERT_EQ(write(fds[1], "x", 1), 1);
  Op read_op{.kind = OpKind::kRead, .fd = file.fd(), .iov = &v, .iovcnt = 1,
             .offset = 0};
  bool read_done = false;
  read_op.done = [&](Op&) { read_done = true; };
  engine->Submit(&read_op);
  while (!polled || !read_done) ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
  EXPECT_EQ(poll_op.result & POLLIN, POLLIN);
  EXPECT_EQ(read_op.result, static_cast<int64_t>(kBlock));
  EXPECT_EQ(engine->in_flight(), 0u);
  close(fds[0]);
  close(fds[1]);
}

// Flush() hands queued requests over without running callbacks: they run
// in the next Poll(), also for a request refused at once (a bad fd), and
// also when Flush() is called from a callback inside Poll().
TEST_P(EngineTest, FlushStartsRequestsAndPollFinishesThem) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  std::string data = Pattern(1, kBlock);
  struct iovec iov = {data.data(), data.size()};
  Op good{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov, .iovcnt = 1};
  Op bad{.kind = OpKind::kWrite, .fd = -1, .iov = &iov, .iovcnt = 1};
  Op later{.kind = OpKind::kWrite, .fd = -1, .iov = &iov, .iovcnt = 1};
  int finished = 0;
  good.done = [&](Op&) { ++finished; };
  bad.done = [&](Op&) {
    ++finished;
    // From a callback: submitted and flushed inside Poll().
    engine->Submit(&later);
    engine->Flush();
  };
  later.done = [&](Op&) { ++finished; };
  engine->Submit(&good);
  engine->Submit(&bad);
  engine->Flush();
  EXPECT_EQ(finished, 0);  // callbacks run in Poll() only
  EXPECT_EQ(engine->in_flight(), 2u);
  while (finished < 3) ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
  EXPECT_EQ(good.result, static_cast<int64_t>(kBlock));
  EXPECT_EQ(bad.result, -EBADF);
  EXPECT_EQ(later.result, -EBADF);
  EXPECT_EQ(engine->in_flight(), 0u);
  std::string back(kBlock, '\0');
  ASSERT_EQ(pread(file.fd(), back.data(), back.size(), 0),
            static_cast<ssize_t>(kBlock));
  EXPECT_EQ(back, data);
}

// With a poll pending, I/O whose completions are taken from the ring
// before anything waits leaves the native engine's eventfd counting them;
// a later Poll(wait) must still sleep until the polled fd is ready (not
// return without progress, not miss the fd), and I/O that finishes while
// it sleeps must wake it.
TEST_P(EngineTest, PollAfterReapedIoSleepsUntilTheFdIsReady) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  int fds[2];
  ASSERT_EQ(pipe2(fds, O_CLOEXEC | O_NONBLOCK), 0);
  Op poll_op{.kind = OpKind::kPoll, .fd = fds[0], .mode = POLLIN};
  bool polled = false;
  poll_op.done = [&](Op&) { polled = true; };
  engine->Submit(&poll_op);
  std::string data = Pattern(2, kBlock);
  struct iovec iov = {data.data(), data.size()};
  for (int round = 0; round < 4; ++round) {
    Op w{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov, .iovcnt = 1,
         .offset = round * kBlock};
    bool written = false;
    w.done = [&](Op&) { written = true; };
    engine->Submit(&w);
    engine->Flush();
    // Without waiting until the write is done (its event is then reaped
    // without the eventfd being read), then waiting.
    while (!written) ASSERT_TRUE(engine->Poll(/*wait=*/round % 2 == 1).ok());
    EXPECT_EQ(w.result, static_cast<int64_t>(kBlock));
    EXPECT_FALSE(polled);
  }
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_EQ(write(fds[1], "x", 1), 1);
  });
  // Returns only with progress: the poll, once the writer has written.
  while (!polled) ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
  writer.join();
  EXPECT_EQ(poll_op.result & POLLIN, POLLIN);
  // A write finishing while the engine sleeps in poll(2) with a new poll
  // pending wakes it.
  char byte;
  ASSERT_EQ(read(fds[0], &byte, 1), 1);
  Op poll_again{.kind = OpKind::kPoll, .fd = fds[0], .mode = POLLIN};
  poll_again.done = [](Op&) {};
  engine->Submit(&poll_again);
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kWrite,
                                               .fd = file.fd(),
                                               .iov = &iov,
                                               .iovcnt = 1,
                                               .offset = 8 * kBlock})),
            static_cast<int64_t>(kBlock));
  EXPECT_EQ(engine->in_flight(), 1u);
  ASSERT_EQ(write(fds[1], "y", 1), 1);
  Drain(*engine);
  close(fds[0]);
  close(fds[1]);
}

TEST_P(EngineTest, FsyncAndFdatasyncSucceed) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  ASSERT_EQ(pwrite(file.fd(), "data", 4, 0), 4);
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kFsync,
                                               .fd = file.fd()})),
            0);
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kFdatasync,
                                               .fd = file.fd()})),
            0);
}

TEST_P(EngineTest, FallocateAllocatesBlocks) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  struct stat st;
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_blocks, 0);
  constexpr uint64_t kLength = 1 << 20;
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kFallocate,
                                               .fd = file.fd(),
                                               .offset = 0,
                                               .length = kLength,
                                               .mode = 0})),
            0);
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(kLength));
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, kLength);
}

TEST_P(EngineTest, PunchedHoleReadsBackZero) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  const std::string data(16 * kBlock, '\xab');
  ASSERT_EQ(pwrite(file.fd(), data.data(), data.size(), 0),
            static_cast<ssize_t>(data.size()));
  EXPECT_EQ(RunSync(*engine,
                    RunOp(*engine,
                          Op{.kind = OpKind::kFallocate,
                             .fd = file.fd(),
                             .offset = 4 * kBlock,
                             .length = 4 * kBlock,
                             .mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE})),
            0);
  std::string back(data.size(), '\x55');
  struct iovec iov = {back.data(), back.size()};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kRead,
                                               .fd = file.fd(),
                                               .iov = &iov,
                                               .iovcnt = 1,
                                               .offset = 0})),
            static_cast<int64_t>(data.size()));
  EXPECT_EQ(back.substr(0, 4 * kBlock), data.substr(0, 4 * kBlock));
  EXPECT_EQ(back.substr(4 * kBlock, 4 * kBlock), std::string(4 * kBlock, '\0'));
  EXPECT_EQ(back.substr(8 * kBlock), data.substr(8 * kBlock));
  struct stat st;
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(data.size()));
}

TEST_P(EngineTest, ReportsEbadfForABadFd) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  char byte = 'x';
  struct iovec iov = {&byte, 1};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kWrite,
                                               .fd = -1,
                                               .iov = &iov,
                                               .iovcnt = 1})),
            -EBADF);
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kFsync,
                                               .fd = -1})),
            -EBADF);
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kFallocate,
                                               .fd = -1,
                                               .length = kBlock})),
            -EBADF);
}

TEST_P(EngineTest, ReadOnAWriteOnlyFdFails) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  ASSERT_EQ(pwrite(file.fd(), "data", 4, 0), 4);
  int wfd = open(file.path().c_str(), O_WRONLY | O_CLOEXEC);
  ASSERT_GE(wfd, 0);
  char buf[4];
  struct iovec iov = {buf, sizeof(buf)};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kRead,
                                               .fd = wfd,
                                               .iov = &iov,
                                               .iovcnt = 1})),
            -EBADF);
  close(wfd);
}

TEST_P(EngineTest, DirectWriteFromAlignedBuffer) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  std::string dir = DirectIoDir();
  if (dir.empty()) GTEST_SKIP() << "no writable disk-backed directory";
  TempFile file(dir, O_DIRECT);
  ASSERT_GE(file.fd(), 0) << dir << ": " << strerror(errno);
  AlignedBuffer first(16 * kBlock);
  AlignedBuffer second(kBlock);
  for (size_t i = 0; i < first.size(); ++i) first.data()[i] = (i * 7) & 0xff;
  for (size_t i = 0; i < second.size(); ++i) second.data()[i] = 0xc3;
  struct iovec wv[2] = {{first.data(), first.size()},
                        {second.data(), second.size()}};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kWrite,
                                               .fd = file.fd(),
                                               .iov = wv,
                                               .iovcnt = 2,
                                               .offset = kBlock})),
            static_cast<int64_t>(17 * kBlock));
  AlignedBuffer back(18 * kBlock);
  struct iovec rv = {back.data(), back.size()};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kRead,
                                               .fd = file.fd(),
                                               .iov = &rv,
                                               .iovcnt = 1,
                                               .offset = 0})),
            static_cast<int64_t>(18 * kBlock));
  std::string got(reinterpret_cast<const char*>(back.data()), back.size());
  std::string want(kBlock, '\0');
  want.append(reinterpret_cast<const char*>(first.data()), first.size());
  want.append(reinterpret_cast<const char*>(second.data()), second.size());
  EXPECT_EQ(got, want);
  // A misaligned buffer is refused by O_DIRECT: the error comes back.
  struct iovec bad = {first.data() + 1, kBlock};
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, Op{.kind = OpKind::kWrite,
                                               .fd = file.fd(),
                                               .iov = &bad,
                                               .iovcnt = 1,
                                               .offset = 0})),
            -EINVAL);
}

// Writes 512-byte records one after another, each submitted from the
// previous one's callback, then an fdatasync.
class Chain {
 public:
  Chain(Engine& engine, int fd, int count)
      : engine_(engine), fd_(fd), count_(count), record_(512, '\0') {}

  void Start() { SubmitWrite(); }
  const std::vector<int64_t>& results() const { return results_; }

 private:
  void SubmitWrite() {
    record_.assign(512, static_cast<char>('a' + next_ % 26));
    iov_ = {record_.data(), record_.size()};
    op_.kind = OpKind::kWrite;
    op_.fd = fd_;
    op_.iov = &iov_;
    op_.iovcnt = 1;
    op_.offset = next_ * 512;
    ++next_;
    op_.done = [this](Op& op) { OnDone(op); };
    engine_.Submit(&op_);
  }

  void OnDone(Op& op) {
    // `done` was moved out before this runs: `op` can be reused right away.
    EXPECT_FALSE(op.done);
    results_.push_back(op.result);
    if (next_ < count_) {
      SubmitWrite();
    } else if (next_ == count_) {
      ++next_;
      op.kind = OpKind::kFdatasync;
      op.done = [this](Op& sync) { results_.push_back(sync.result); };
      engine_.Submit(&op);
    }
  }

  Engine& engine_;
  int fd_;
  int count_;
  int next_ = 0;
  std::string record_;
  struct iovec iov_ = {};
  Op op_;
  std::vector<int64_t> results_;
};

TEST_P(EngineTest, CallbacksSubmitFurtherRequests) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  Chain chain(*engine, file.fd(), 50);
  chain.Start();
  Drain(*engine);
  std::vector<int64_t> want(50, 512);
  want.push_back(0);  // fdatasync
  EXPECT_EQ(chain.results(), want);
  for (int i = 0; i < 50; ++i) {
    ASSERT_EQ(PRead(file.fd(), 512, i * 512),
              std::string(512, static_cast<char>('a' + i % 26)));
  }
}

// A request refused on its own (bad fd) among good ones: the others still
// run, each reports its own result, in one batch of the engine.
TEST_P(EngineTest, ABadRequestInABatchFailsAlone) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  std::string data[5];
  struct iovec iovs[5];
  Op ops[5];
  for (int i = 0; i < 5; ++i) {
    data[i] = Pattern(i, 512);
    iovs[i] = {data[i].data(), data[i].size()};
    ops[i] = Op{.kind = OpKind::kWrite, .fd = i % 2 == 1 ? -1 : file.fd(),
                .iov = &iovs[i], .iovcnt = 1, .offset = i * 512u};
    ops[i].result = 12345;
    engine->Submit(&ops[i]);
  }
  Drain(*engine);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(ops[i].result, i % 2 == 1 ? -EBADF : 512) << "request " << i;
  }
  EXPECT_EQ(PRead(file.fd(), 512, 0), data[0]);
  EXPECT_EQ(PRead(file.fd(), 512, 2 * 512), data[2]);
  EXPECT_EQ(PRead(file.fd(), 512, 4 * 512), data[4]);
}

// One Poll(wait) returns once a request the kernel cannot do asynchronously
// (run by the native engine's side threads) has finished, with its callback
// run: the wait wakes up for it.
TEST_P(EngineTest, OnePollWaitsForAnFdatasyncAlone) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  const std::string data(1 << 20, 'x');
  ASSERT_EQ(pwrite(file.fd(), data.data(), data.size(), 0),
            static_cast<ssize_t>(data.size()));
  for (OpKind kind : {OpKind::kFdatasync, OpKind::kFsync,
                      OpKind::kFallocate}) {
    bool done = false;
    Op op{.kind = kind, .fd = file.fd(), .offset = 1 << 20,
          .length = 1 << 20};
    op.result = 12345;
    op.done = [&done](Op&) { done = true; };
    engine->Submit(&op);
    ASSERT_TRUE(engine->Poll(/*wait=*/true).ok());
    EXPECT_TRUE(done);
    EXPECT_EQ(op.result, 0);
    EXPECT_EQ(engine->in_flight(), 0u);
  }
}

// Reads and writes in flight together with side requests (fallocate,
// fdatasync): Poll(wait) keeps returning until all have finished, in any
// order, with every result right.
TEST_P(EngineTest, MixesReadsAndWritesWithSideRequests) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr int kRounds = 50;
  std::vector<std::string> data(kRounds);
  std::vector<struct iovec> iovs(kRounds);
  std::vector<Op> writes(kRounds), syncs(kRounds), fallocs(kRounds);
  int completed = 0;
  auto count = [&completed](Op&) { ++completed; };
  for (int i = 0; i < kRounds; ++i) {
    data[i] = Pattern(i, kBlock);
    iovs[i] = {data[i].data(), data[i].size()};
    writes[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iovs[i],
                   .iovcnt = 1, .offset = i * kBlock};
    fallocs[i] = Op{.kind = OpKind::kFallocate, .fd = file.fd(),
                    .offset = (kRounds + i) * kBlock, .length = kBlock};
    syncs[i] = Op{.kind = OpKind::kFdatasync, .fd = file.fd()};
    for (Op* op : {&writes[i], &fallocs[i], &syncs[i]}) {
      op->result = 12345;
      op->done = count;
      engine->Submit(op);
    }
  }
  EXPECT_EQ(engine->in_flight(), 3u * kRounds);
  Drain(*engine);
  EXPECT_EQ(completed, 3 * kRounds);
  for (int i = 0; i < kRounds; ++i) {
    EXPECT_EQ(writes[i].result, static_cast<int64_t>(kBlock));
    EXPECT_EQ(fallocs[i].result, 0);
    EXPECT_EQ(syncs[i].result, 0);
    ASSERT_EQ(PRead(file.fd(), kBlock, i * kBlock), data[i]) << "block " << i;
  }
  struct stat st;
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(2 * kRounds * kBlock));
}

// Many more O_DIRECT requests than the queue depth, each extending the file:
// the way bench -w runs on a fresh image.
TEST_P(EngineTest, QueuesDirectWritesBeyondTheQueueDepth) {
  std::unique_ptr<Engine> engine = MakeEngine(4);
  ASSERT_NE(engine, nullptr);
  std::string dir = DirectIoDir();
  if (dir.empty()) GTEST_SKIP() << "no writable disk-backed directory";
  TempFile file(dir, O_DIRECT);
  ASSERT_GE(file.fd(), 0) << dir << ": " << strerror(errno);
  constexpr int kCount = 300;
  AlignedBuffer buffer(kCount * kBlock);
  for (size_t i = 0; i < buffer.size(); ++i) {
    buffer.data()[i] = static_cast<uint8_t>(i / kBlock);
  }
  std::vector<struct iovec> iovs(kCount);
  std::vector<Op> ops(kCount);
  for (int i = 0; i < kCount; ++i) {
    iovs[i] = {buffer.data() + i * kBlock, kBlock};
    ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iovs[i],
                .iovcnt = 1, .offset = i * kBlock};
    engine->Submit(&ops[i]);
  }
  Drain(*engine);
  for (int i = 0; i < kCount; ++i) {
    ASSERT_EQ(ops[i].result, static_cast<int64_t>(kBlock)) << "request " << i;
  }
  AlignedBuffer back(kCount * kBlock);
  ASSERT_EQ(pread(file.fd(), back.data(), back.size(), 0),
            static_cast<ssize_t>(back.size()));
  EXPECT_EQ(std::string(reinterpret_cast<char*>(back.data()), back.size()),
            std::string(reinterpret_cast<char*>(buffer.data()),
                        buffer.size()));
}

// Requests the engine handed on (to the kernel or, for io_uring, to its
// side pool), a merged run counting once.
uint64_t RequestsSubmitted(const Engine& engine) {
  if (const auto* aio = dynamic_cast<const AioEngine*>(&engine)) {
    return aio->requests_submitted();
  }
  if (const auto* uring = dynamic_cast<const UringEngine*>(&engine)) {
    return uring->requests_submitted();
  }
  ADD_FAILURE() << engine.name() << " does not count its requests";
  return 0;
}

// Adjacent reads or writes queued before the next Poll go to the kernel as
// one request per run (io/coalesce.h); each Op still gets its own result.
class MergingEngineTest : public EngineTest {
 protected:
  static constexpr size_t kPiece = 16 * 1024;
  // 100 pieces of 16 KiB: runs of 64 (kMaxMergedBytes) and 36.
  static constexpr int kPieces = 100;

  // Writes kPieces adjacent pieces of distinct patterns to `fd` at
  // `base`, all submitted before one Drain, then reads them back the same
  // way; checks every result, the file's content and that each direction
  // took two requests.
  void WriteAndReadAdjacentPieces(Engine& engine, int fd, uint64_t base) {
    AlignedBuffer data(kPieces * kPiece);
    for (int i = 0; i < kPieces; ++i) {
      const std::string piece = Pattern(i * 7, kPiece);
      std::memcpy(data.data() + i * kPiece, piece.data(), kPiece);
    }
    std::vector<struct iovec> iovs(kPieces);
    std::vector<Op> ops(kPieces);
    for (int i = 0; i < kPieces; ++i) {
      iovs[i] = {data.data() + i * kPiece, kPiece};
      ops[i] = Op{.kind = OpKind::kWrite, .fd = fd, .iov = &iovs[i],
                  .iovcnt = 1, .offset = base + i * kPiece};
      ops[i].result = 12345;
      engine.Submit(&ops[i]);
    }
    uint64_t before = RequestsSubmitted(engine);
    Drain(engine);
    EXPECT_EQ(RequestsSubmitted(engine) - before, 2u);
    for (int i = 0; i < kPieces; ++i) {
      ASSERT_EQ(ops[i].result, static_cast<int64_t>(kPiece)) << "write " << i;
    }
    AlignedBuffer file(kPieces * kPiece);
    ASSERT_EQ(pread(fd, file.data(), file.size(), static_cast<off_t>(base)),
              static_cast<ssize_t>(file.size()));
    ASSERT_EQ(std::memcmp(file.data(), data.data(), data.size()), 0);

    AlignedBuffer back(kPieces * kPiece);
    std::memset(back.data(), 0x5a, back.size());
    for (int i = 0; i < kPieces; ++i) {
      iovs[i] = {back.data() + i * kPiece, kPiece};
      ops[i] = Op{.kind = OpKind::kRead, .fd = fd, .iov = &iovs[i],
                  .iovcnt = 1, .offset = base + i * kPiece};
      ops[i].result = 12345;
      engine.Submit(&ops[i]);
    }
    before = RequestsSubmitted(engine);
    Drain(engine);
    EXPECT_EQ(RequestsSubmitted(engine) - before, 2u);
    for (int i = 0; i < kPieces; ++i) {
      ASSERT_EQ(ops[i].result, static_cast<int64_t>(kPiece)) << "read " << i;
      ASSERT_EQ(std::memcmp(back.data() + i * kPiece,
                            data.data() + i * kPiece, kPiece),
                0)
          << "read " << i;
    }
  }
};

TEST_P(MergingEngineTest, MergesAdjacentBufferedReadsAndWrites) {
  std::unique_ptr<Engine> engine = MakeEngine(128);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  WriteAndReadAdjacentPieces(*engine, file.fd(), 4096);
}

TEST_P(MergingEngineTest, MergesAdjacentDirectReadsAndWrites) {
  std::unique_ptr<Engine> engine = MakeEngine(128);
  ASSERT_NE(engine, nullptr);
  std::string dir = DirectIoDir();
  if (dir.empty()) GTEST_SKIP() << "no writable disk-backed directory";
  TempFile file(dir, O_DIRECT);
  ASSERT_GE(file.fd(), 0) << dir << ": " << strerror(errno);
  // Into preallocated (unwritten) extents, the case merging is for.
  ASSERT_EQ(fallocate(file.fd(), 0, 0, kPieces * kPiece + 8192), 0);
  WriteAndReadAdjacentPieces(*engine, file.fd(), 8192);
}

// Requests on another fd, of another kind, or not adjacent are not merged;
// a run stops there and the rest keep their order.
TEST_P(MergingEngineTest, OnlyAdjacentRequestsOnOneFdMerge) {
  std::unique_ptr<Engine> engine = MakeEngine(16);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  TempFile other(TestDir());
  ASSERT_GE(file.fd(), 0);
  ASSERT_GE(other.fd(), 0);
  const std::string old_data = Pattern(200, kBlock);
  ASSERT_EQ(pwrite(file.fd(), old_data.data(), kBlock, 8 * kBlock),
            static_cast<ssize_t>(kBlock));
  std::string data[6];
  struct iovec iovs[6];
  Op ops[6];
  // Blocks 0, 1 (merge), block 2 of `other`, a read of block 8, blocks 3, 4
  // of `file` (merge; 3 does not continue the read).
  const struct {
    OpKind kind;
    int fd;
    uint64_t block;
  } layout[6] = {{OpKind::kWrite, file.fd(), 0}, {OpKind::kWrite, file.fd(), 1},
                 {OpKind::kWrite, other.fd(), 2}, {OpKind::kRead, file.fd(), 8},
                 {OpKind::kWrite, file.fd(), 3}, {OpKind::kWrite, file.fd(), 4}};
  for (int i = 0; i < 6; ++i) {
    data[i] = layout[i].kind == OpKind::kRead ? std::string(kBlock, '\0')
                                              : Pattern(i, kBlock);
    iovs[i] = {data[i].data(), kBlock};
    ops[i] = Op{.kind = layout[i].kind, .fd = layout[i].fd, .iov = &iovs[i],
                .iovcnt = 1, .offset = layout[i].block * kBlock};
    ops[i].result = 12345;
    engine->Submit(&ops[i]);
  }
  Drain(*engine);
  EXPECT_EQ(RequestsSubmitted(*engine), 4u);
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(ops[i].result, static_cast<int64_t>(kBlock)) << "request " << i;
  }
  EXPECT_EQ(data[3], old_data);
  EXPECT_EQ(PRead(file.fd(), 2 * kBlock, 0), data[0] + data[1]);
  EXPECT_EQ(PRead(other.fd(), kBlock, 2 * kBlock), data[2]);
  EXPECT_EQ(PRead(file.fd(), 2 * kBlock, 3 * kBlock), data[4] + data[5]);
}

// A merged read crossing the end of the file: the op the count ends in gets
// its part, the one past it -EAGAIN (its caller retries it alone and then
// sees the end of the file).
TEST_P(MergingEngineTest, AShortMergedReadHandsEagainToTheOpsItMissed) {
  std::unique_ptr<Engine> engine = MakeEngine(16);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr size_t kPiece = 16 * 1024;
  const std::string content = Pattern(9, kPiece + 5000);
  ASSERT_EQ(pwrite(file.fd(), content.data(), content.size(), 0),
            static_cast<ssize_t>(content.size()));
  std::string back[3];
  struct iovec iovs[3];
  Op ops[3];
  for (int i = 0; i < 3; ++i) {
    back[i].assign(kPiece, 'z');
    iovs[i] = {back[i].data(), kPiece};
    ops[i] = Op{.kind = OpKind::kRead, .fd = file.fd(), .iov = &iovs[i],
                .iovcnt = 1, .offset = i * kPiece};
    ops[i].result = 12345;
    engine->Submit(&ops[i]);
  }
  const uint64_t before = RequestsSubmitted(*engine);
  Drain(*engine);
  EXPECT_EQ(RequestsSubmitted(*engine) - before, 1u);
  EXPECT_EQ(ops[0].result, static_cast<int64_t>(kPiece));
  EXPECT_EQ(ops[1].result, 5000);
  EXPECT_EQ(ops[2].result, -EAGAIN);
  EXPECT_EQ(back[0], content.substr(0, kPiece));
  EXPECT_EQ(back[1].substr(0, 5000), content.substr(kPiece));
  EXPECT_EQ(back[2], std::string(kPiece, 'z'));
  // Retried alone, the third read is a read at the end of the file.
  EXPECT_EQ(RunSync(*engine, RunOp(*engine, std::move(ops[2]))), 0);
}

// The same for a merged write cut short by the file size limit
// (RLIMIT_FSIZE): the write that crosses the limit writes what fits.
TEST_P(MergingEngineTest, AShortMergedWriteHandsEagainToTheOpsItMissed) {
  std::unique_ptr<Engine> engine = MakeEngine(16);
  ASSERT_NE(engine, nullptr);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr size_t kPiece = 16 * 1024;
  constexpr rlim_t kLimit = kPiece + 5000;
  struct rlimit old_limit;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  if (old_limit.rlim_max != RLIM_INFINITY && old_limit.rlim_max < kLimit) {
    GTEST_SKIP() << "RLIMIT_FSIZE hard limit too low";
  }
  // Writing at the limit raises SIGXFSZ (fatal by default): ignore it.
  struct sigaction ignore = {}, old_action;
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(sigaction(SIGXFSZ, &ignore, &old_action), 0);
  struct rlimit limit = {kLimit, old_limit.rlim_max};
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &limit), 0);
  std::string data[3];
  struct iovec iovs[3];
  Op ops[3];
  for (int i = 0; i < 3; ++i) {
    data[i] = Pattern(i * 3, kPiece);
    iovs[i] = {data[i].data(), kPiece};
    ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iovs[i],
                .iovcnt = 1, .offset = i * kPiece};
    ops[i].result = 12345;
    engine->Submit(&ops[i]);
  }
  const uint64_t before = RequestsSubmitted(*engine);
  Drain(*engine);
  const uint64_t requests = RequestsSubmitted(*engine) - before;
  // Retried alone, the third write starts past the limit.
  const int64_t retried = RunSync(*engine, RunOp(*engine, std::move(ops[2])));
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old_limit), 0);
  ASSERT_EQ(sigaction(SIGXFSZ, &old_action, nullptr), 0);
  EXPECT_EQ(requests, 1u);
  EXPECT_EQ(ops[0].result, static_cast<int64_t>(kPiece));
  EXPECT_EQ(ops[1].result, 5000);
  EXPECT_EQ(ops[2].result, -EAGAIN);
  EXPECT_EQ(retried, -EFBIG);
  struct stat st;
  ASSERT_EQ(fstat(file.fd(), &st), 0);
  EXPECT_EQ(st.st_size, static_cast<off_t>(kLimit));
  EXPECT_EQ(PRead(file.fd(), kLimit, 0),
            data[0] + data[1].substr(0, 5000));
}

INSTANTIATE_TEST_SUITE_P(
    Backends, MergingEngineTest,
    ::testing::Values(EngineKind::kIoUring, EngineKind::kNative),
    [](const ::testing::TestParamInfo<EngineKind>& info) {
      return std::string(KindName(info.param));
    });

INSTANTIATE_TEST_SUITE_P(
    Backends, EngineTest,
    ::testing::Values(EngineKind::kIoUring, EngineKind::kNative,
                      EngineKind::kThreads),
    [](const ::testing::TestParamInfo<EngineKind>& info) {
      return std::string(KindName(info.param));
    });

TEST(CreateEngineTest, AutoPicksIoUring) {
  std::ostringstream notice;
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      CreateEngine(EngineKind::kAuto, 64, &notice);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_STREQ((*engine)->name(), "io_uring");
  EXPECT_EQ(notice.str(), "");
}

TEST(CreateEngineTest, ThreadsGivesThePool) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      CreateEngine(EngineKind::kThreads, 64, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_STREQ((*engine)->name(), "threads");
}

TEST(CreateEngineTest, NativeGivesLinuxAio) {
  absl::StatusOr<std::unique_ptr<Engine>> engine =
      CreateEngine(EngineKind::kNative, 64, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_STREQ((*engine)->name(), "native");
}

TEST(AioEngineTest, KeepsTwiceTheQueueDepthInTheKernel) {
  absl::StatusOr<std::unique_ptr<Engine>> engine = AioEngine::Create(64);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(static_cast<AioEngine&>(**engine).max_in_kernel(), 128u);
  engine = AioEngine::Create(1);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(static_cast<AioEngine&>(**engine).max_in_kernel(), 16u);
}

// Submit() hands the queued requests to the kernel when one arrives that
// does not continue the last queued one; a run of adjacent ones stays
// queued (and merges) until then or the next Poll().
TEST(AioEngineTest, SubmitHandsOnTheRunsARequestCloses) {
  absl::StatusOr<std::unique_ptr<Engine>> created = AioEngine::Create(16);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<AioEngine&>(**created);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  // Blocks 0, 1 (a run), 5 (closes it), 6 (continues 5), then 2 (closes
  // 5-6); 2 is left for Poll().
  constexpr uint64_t kBlocks[] = {0, 1, 5, 6, 2};
  constexpr uint64_t kSubmittedAfter[] = {0, 0, 1, 1, 2};
  std::string data[5];
  struct iovec iovs[5];
  Op ops[5];
  for (int i = 0; i < 5; ++i) {
    data[i] = Pattern(i + 40, kBlock);
    iovs[i] = {data[i].data(), kBlock};
    ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iovs[i],
                .iovcnt = 1, .offset = kBlocks[i] * kBlock};
    ops[i].result = 12345;
    engine.Submit(&ops[i]);
    EXPECT_EQ(engine.requests_submitted(), kSubmittedAfter[i]) << "op " << i;
  }
  EXPECT_EQ(engine.in_flight(), 5u);
  while (engine.in_flight() > 0) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  EXPECT_EQ(engine.requests_submitted(), 3u);
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(ops[i].result, static_cast<int64_t>(kBlock)) << "op " << i;
    EXPECT_EQ(PRead(file.fd(), kBlock, kBlocks[i] * kBlock), data[i])
        << "op " << i;
  }
}

// The spin before a sleep (io/aio_engine.h): doubled from 4 us up to 50 us
// while the sleeps after a fruitless spin are short, 0 after a long one.
TEST(AioEngineTest, SpinTimeAdaptsToHowLongSleepsTake) {
  EXPECT_EQ(AioEngine::NextSpinNs(0, 20'000), 4'000u);
  EXPECT_EQ(AioEngine::NextSpinNs(4'000, 20'000), 8'000u);
  EXPECT_EQ(AioEngine::NextSpinNs(32'000, 50'000), 50'000u);
  EXPECT_EQ(AioEngine::NextSpinNs(50'000, 1'000), 50'000u);
  EXPECT_EQ(AioEngine::NextSpinNs(50'000, 50'001), 0u);
  EXPECT_EQ(AioEngine::NextSpinNs(0, 10'000'000), 0u);
}

TEST(UringEngineTest, RoundsTheRingUpToAPowerOfTwo) {
  absl::StatusOr<std::unique_ptr<Engine>> engine = UringEngine::Create(100);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(static_cast<UringEngine&>(**engine).ring_entries(), 128u);
  engine = UringEngine::Create(1);
  ASSERT_TRUE(engine.ok()) << engine.status();
  EXPECT_EQ(static_cast<UringEngine&>(**engine).ring_entries(), 8u);
}

// A read of a pipe that blocks until `data` is written to it.
struct PipeRead {
  int fds[2] = {-1, -1};
  char byte = 0;
  struct iovec iov = {&byte, 1};
  Op op;
  PipeRead() {
    EXPECT_EQ(pipe2(fds, O_CLOEXEC), 0);
    op = Op{.kind = OpKind::kRead, .fd = fds[0], .iov = &iov, .iovcnt = 1,
            .may_block = true};
  }
  ~PipeRead() {
    close(fds[0]);
    close(fds[1]);
  }
};

// Poll(wait) submits, then sleeps only if no completion is ready: reads
// of cached pages complete within their submission and cost no wait, and
// a read of an empty pipe costs one.
TEST(UringEngineTest, WaitsOnlyWhenTheSubmissionCompletedNothing) {
  absl::StatusOr<std::unique_ptr<Engine>> created = UringEngine::Create(8);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<UringEngine&>(**created);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  const std::string data = Pattern(9, kBlock);
  ASSERT_EQ(pwrite(file.fd(), data.data(), kBlock, 0),
            static_cast<ssize_t>(kBlock));
  std::string buffer(kBlock, '\0');
  struct iovec iov = {buffer.data(), kBlock};
  for (int i = 0; i < 4; ++i) {
    Op read{.kind = OpKind::kRead, .fd = file.fd(), .iov = &iov, .iovcnt = 1,
            .offset = 0};
    EXPECT_EQ(RunSync(engine, RunOp(engine, std::move(read))),
              int64_t{kBlock});
  }
  EXPECT_EQ(buffer, data);
  EXPECT_EQ(engine.waits(), 0u);

  PipeRead pipe;
  pipe.op.may_block = false;  // through the ring, not the side pool
  pipe.op.done = [](Op&) {};
  engine.Submit(&pipe.op);
  // The byte goes in once this thread sleeps (state S) in io_uring_enter
  // (/proc/.../syscall), which only the wait does: the submission of a pipe
  // read does not block.
  std::thread writer([fd = pipe.fds[1],
                      task = absl::StrCat("/proc/self/task/", gettid())] {
    const std::string in_enter = absl::StrCat(__NR_io_uring_enter, " ");
    for (;;) {
      std::ifstream stat(task + "/stat");
      std::string line;
      std::getline(stat, line);
      const size_t paren = line.rfind(')');
      if (paren != std::string::npos && line.size() > paren + 2 &&
          line[paren + 2] == 'S') {
        std::ifstream syscall(task + "/syscall");
        std::getline(syscall, line);
        if (line.rfind(in_enter, 0) == 0) break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(write(fd, "x", 1), 1);
  });
  while (engine.in_flight() > 0) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  writer.join();
  EXPECT_EQ(pipe.op.result, 1);
  EXPECT_EQ(pipe.byte, 'x');
  EXPECT_EQ(engine.waits(), 1u);
}

TEST(UringEngineTest, MayBlockRequestsRunOnTheSidePool) {
  absl::StatusOr<std::unique_ptr<Engine>> created = UringEngine::Create(16);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<UringEngine&>(**created);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  EXPECT_EQ(engine.side_requests(), 0u);
  std::string data = Pattern(7, kBlock);
  struct iovec iov = {data.data(), data.size()};
  Op plain{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov, .iovcnt = 1,
           .offset = 0};
  Op marked{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov, .iovcnt = 1,
            .offset = kBlock, .may_block = true};
  EXPECT_EQ(RunSync(engine, RunOp(engine, std::move(plain))), int64_t{kBlock});
  EXPECT_EQ(engine.side_requests(), 0u);
  EXPECT_EQ(RunSync(engine, RunOp(engine, std::move(marked))), int64_t{kBlock});
  EXPECT_EQ(engine.side_requests(), 1u);
  EXPECT_EQ(engine.in_flight(), 0u);
  EXPECT_EQ(PRead(file.fd(), 2 * kBlock, 0), data + data);
}

// Poll(wait) blocks until a side-pool request finishes, and runs its
// callback before returning, even with nothing in the ring.
TEST(UringEngineTest, PollWaitsForTheSidePool) {
  absl::StatusOr<std::unique_ptr<Engine>> created = UringEngine::Create(8);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<UringEngine&>(**created);
  PipeRead read;
  bool done = false;
  read.op.done = [&done](Op& op) {
    EXPECT_EQ(op.result, 1);
    done = true;
  };
  engine.Submit(&read.op);
  EXPECT_EQ(engine.in_flight(), 1u);
  ASSERT_TRUE(engine.Poll(/*wait=*/false).ok());
  EXPECT_FALSE(done);
  std::thread writer([&read] {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_EQ(write(read.fds[1], "x", 1), 1);
  });
  const auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  const auto waited = std::chrono::steady_clock::now() - start;
  writer.join();
  EXPECT_TRUE(done);
  EXPECT_EQ(read.byte, 'x');
  EXPECT_EQ(engine.in_flight(), 0u);
  EXPECT_GE(waited, std::chrono::milliseconds(40));
  EXPECT_EQ(engine.side_requests(), 1u);
}

// With a side-pool request blocked, ring requests still complete, and
// in_flight() counts both paths.
TEST(UringEngineTest, RingRequestsCompleteWhileTheSidePoolBlocks) {
  absl::StatusOr<std::unique_ptr<Engine>> created = UringEngine::Create(8);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<UringEngine&>(**created);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  PipeRead read;
  bool read_done = false;
  read.op.done = [&read_done](Op&) { read_done = true; };
  engine.Submit(&read.op);
  // More than the ring holds, with gaps between them so that none merge.
  constexpr int kCount = 40;
  std::string data = Pattern(3, 512);
  struct iovec iov = {data.data(), data.size()};
  std::vector<Op> ops(kCount);
  int written = 0;
  for (int i = 0; i < kCount; ++i) {
    ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov,
                .iovcnt = 1, .offset = i * uint64_t{1024}};
    ops[i].done = [&written](Op& op) {
      EXPECT_EQ(op.result, 512);
      ++written;
    };
    engine.Submit(&ops[i]);
  }
  EXPECT_EQ(engine.in_flight(), uint64_t{kCount + 1});
  while (written < kCount) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  EXPECT_EQ(engine.requests_submitted(), uint64_t{kCount} + 1);
  EXPECT_FALSE(read_done);
  EXPECT_EQ(engine.in_flight(), 1u);
  ASSERT_EQ(write(read.fds[1], "y", 1), 1);
  while (engine.in_flight() > 0) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  EXPECT_TRUE(read_done);
  EXPECT_EQ(read.byte, 'y');
}

// A run of adjacent writes with one marked may_block goes to the side pool
// as one request; the results and data are those of separate writes.
TEST(UringEngineTest, AMergedRunWithAMayBlockOpRunsOnTheSidePool) {
  absl::StatusOr<std::unique_ptr<Engine>> created = UringEngine::Create(16);
  ASSERT_TRUE(created.ok()) << created.status();
  auto& engine = static_cast<UringEngine&>(**created);
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  constexpr int kCount = 8;
  std::string data[kCount];
  struct iovec iovs[kCount];
  Op ops[kCount];
  for (int i = 0; i < kCount; ++i) {
    data[i] = Pattern(i * 5, kBlock);
    iovs[i] = {data[i].data(), kBlock};
    ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iovs[i],
                .iovcnt = 1, .offset = i * kBlock, .may_block = i == 5};
    ops[i].result = 12345;
    engine.Submit(&ops[i]);
  }
  // Not adjacent: a ring request of its own.
  std::string last = Pattern(99, kBlock);
  struct iovec last_iov = {last.data(), kBlock};
  Op apart{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &last_iov,
           .iovcnt = 1, .offset = (kCount + 1) * kBlock};
  engine.Submit(&apart);
  EXPECT_EQ(engine.in_flight(), uint64_t{kCount + 1});
  while (engine.in_flight() > 0) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  EXPECT_EQ(engine.side_requests(), uint64_t{kCount});
  EXPECT_EQ(engine.requests_submitted(), 2u);
  std::string want;
  for (int i = 0; i < kCount; ++i) {
    EXPECT_EQ(ops[i].result, static_cast<int64_t>(kBlock)) << "request " << i;
    want += data[i];
  }
  EXPECT_EQ(apart.result, static_cast<int64_t>(kBlock));
  EXPECT_EQ(PRead(file.fd(), kCount * kBlock, 0), want);
  EXPECT_EQ(PRead(file.fd(), kBlock, (kCount + 1) * kBlock), last);
}

// Destroying the engine with side-pool requests not yet collected: the
// pool still makes their syscalls (the callbacks of those not collected
// never run), and the pending read of its eventfd is cancelled safely.
TEST(UringEngineTest, DestructionFinishesSidePoolRequests) {
  TempFile file(TestDir());
  ASSERT_GE(file.fd(), 0);
  std::string data = Pattern(5, kBlock);
  struct iovec iov = {data.data(), data.size()};
  std::vector<Op> ops(8);
  {
    absl::StatusOr<std::unique_ptr<Engine>> engine = UringEngine::Create(8);
    ASSERT_TRUE(engine.ok()) << engine.status();
    for (size_t i = 0; i < ops.size(); ++i) {
      ops[i] = Op{.kind = OpKind::kWrite, .fd = file.fd(), .iov = &iov,
                  .iovcnt = 1, .offset = i * kBlock, .may_block = true};
      (*engine)->Submit(&ops[i]);
    }
    ASSERT_TRUE((*engine)->Poll(/*wait=*/false).ok());  // arms the eventfd read
  }
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(PRead(file.fd(), kBlock, i * kBlock), data) << "request " << i;
  }
}

// Workers start when requests wait and none is idle, up to the limit.
TEST(ThreadPoolEngineTest, StartsWorkersOnDemandUpToTheLimit) {
  ThreadPoolEngine engine(4);
  EXPECT_EQ(engine.threads_started(), 0);
  constexpr int kCount = 10;
  std::vector<std::unique_ptr<PipeRead>> reads;
  int done = 0;
  for (int i = 0; i < kCount; ++i) {
    reads.push_back(std::make_unique<PipeRead>());
    reads.back()->op.done = [&done](Op& op) {
      EXPECT_EQ(op.result, 1);
      ++done;
    };
    engine.Submit(&reads.back()->op);
  }
  // Each worker blocks in its read, so none gets idle again.
  EXPECT_EQ(engine.threads_started(), 4);
  for (auto& r : reads) ASSERT_EQ(write(r->fds[1], "z", 1), 1);
  while (engine.in_flight() > 0) ASSERT_TRUE(engine.Poll(/*wait=*/true).ok());
  EXPECT_EQ(done, kCount);
  EXPECT_EQ(engine.threads_started(), 4);
}

TEST(ParseEngineKindTest, AcceptsQemuNames) {
  EXPECT_EQ(ParseEngineKind("io_uring").value(), EngineKind::kIoUring);
  EXPECT_EQ(ParseEngineKind("native").value(), EngineKind::kNative);
  EXPECT_EQ(ParseEngineKind("threads").value(), EngineKind::kThreads);
}

TEST(ParseEngineKindTest, RejectsUnknownName) {
  absl::StatusOr<EngineKind> kind = ParseEngineKind("foo");
  EXPECT_EQ(kind.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(kind.status().message(), "Invalid aio option: foo");
}

TEST(AlignedBufferTest, IsAlignedAndZeroed) {
  AlignedBuffer buf(10000, 4096);
  ASSERT_NE(buf.data(), nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 4096, 0u);
  EXPECT_EQ(buf.size(), 10000u);
  EXPECT_EQ(buf.alignment(), 4096u);
  EXPECT_EQ(buf.span().size(), 10000u);
  for (uint8_t b : buf.span()) ASSERT_EQ(b, 0);
  AlignedBuffer big(3, 1 << 16);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data()) % (1 << 16), 0u);
  AlignedBuffer tiny(3, 1);
  EXPECT_EQ(tiny.size(), 3u);
}

TEST(AlignedBufferTest, MovesOwnership) {
  AlignedBuffer a(kBlock);
  a.data()[0] = 42;
  uint8_t* p = a.data();
  AlignedBuffer b(std::move(a));
  EXPECT_EQ(b.data(), p);
  EXPECT_EQ(b.size(), kBlock);
  EXPECT_EQ(b.span()[0], 42);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(a.data(), nullptr);
  AlignedBuffer c;
  EXPECT_TRUE(c.empty());
  c = std::move(b);
  EXPECT_EQ(c.data(), p);
  const AlignedBuffer& cc = c;
  EXPECT_EQ(cc.span().size(), kBlock);
  EXPECT_EQ(AlignedBuffer(0).data(), nullptr);
}

}  // namespace
}  // namespace imgtool::io
