#include "io/coalesce.h"

#include <sys/uio.h>

#include <cerrno>
#include <climits>
#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "io/engine.h"

namespace imgtool::io {
namespace {

constexpr uint64_t kKiB = 1024;

// Ops whose buffers point into one byte array (contents never touched), each
// with its own iovecs.
class Ops {
 public:
  // Adds an op of `kind` on `fd` at `offset` with `buffers` buffers of
  // `buffer_bytes` bytes each.
  Op* Add(OpKind kind, int fd, uint64_t offset, uint64_t buffer_bytes,
          int buffers = 1) {
    auto& iov = iovs_.emplace_back(std::make_unique<std::vector<iovec>>());
    for (int i = 0; i < buffers; ++i) {
      iov->push_back({Address(next_address_), buffer_bytes});
      next_address_ += buffer_bytes;
    }
    auto& op = ops_.emplace_back(std::make_unique<Op>());
    *op = Op{.kind = kind, .fd = fd, .iov = iov->data(),
             .iovcnt = buffers, .offset = offset};
    return op.get();
  }
  Op* Write(uint64_t offset, uint64_t bytes) {
    return Add(OpKind::kWrite, 3, offset, bytes);
  }

 private:
  // Distinct, never dereferenced addresses.
  static void* Address(uintptr_t n) { return reinterpret_cast<void*>(n); }

  uintptr_t next_address_ = 0x10000;
  std::vector<std::unique_ptr<std::vector<iovec>>> iovs_;
  std::vector<std::unique_ptr<Op>> ops_;
};

// The run's buffers as (address, length) pairs.
std::vector<std::pair<const void*, size_t>> Buffers(const MergedRequest& run) {
  std::vector<std::pair<const void*, size_t>> out;
  for (int i = 0; i < run.iovec_count(); ++i) {
    out.emplace_back(run.iovec_data()[i].iov_base, run.iovec_data()[i].iov_len);
  }
  return out;
}

// Every buffer of `ops`, in order.
std::vector<std::pair<const void*, size_t>> Buffers(
    const std::vector<Op*>& ops) {
  std::vector<std::pair<const void*, size_t>> out;
  for (const Op* op : ops) {
    for (int i = 0; i < op->iovcnt; ++i) {
      out.emplace_back(op->iov[i].iov_base, op->iov[i].iov_len);
    }
  }
  return out;
}

TEST(TakeRunTest, MergesAdjacentWritesAndStopsAtAGap) {
  Ops ops;
  Op* a = ops.Write(0, 16 * kKiB);
  Op* b = ops.Write(16 * kKiB, 16 * kKiB);
  Op* c = ops.Add(OpKind::kWrite, 3, 32 * kKiB, 4 * kKiB, /*buffers=*/3);
  Op* gap = ops.Write(48 * kKiB, 16 * kKiB);  // 4 KiB after c's end
  Op* d = ops.Write(64 * kKiB, 16 * kKiB);
  std::deque<Op*> queue = {a, b, c, gap, d};
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, (std::vector<Op*>{a, b, c}));
  EXPECT_EQ(run.bytes, 44 * kKiB);
  EXPECT_EQ(run.iovec_count(), 5);
  EXPECT_EQ(Buffers(run), Buffers({a, b, c}));
  EXPECT_EQ(queue, (std::deque<Op*>{gap, d}));
  // The rest: gap and d are adjacent to each other.
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, (std::vector<Op*>{gap, d}));
  EXPECT_EQ(run.bytes, 32 * kKiB);
  EXPECT_TRUE(queue.empty());
}

TEST(TakeRunTest, StopsAtAnotherFdOrKindOrAnOverlap) {
  Ops ops;
  Op* a = ops.Write(0, 4 * kKiB);
  Op* other_fd = ops.Add(OpKind::kWrite, 4, 4 * kKiB, 4 * kKiB);
  Op* read = ops.Add(OpKind::kRead, 3, 4 * kKiB, 4 * kKiB);
  Op* overlap = ops.Write(2 * kKiB, 4 * kKiB);
  Op* backwards = ops.Write(0, 2 * kKiB);  // ends where overlap starts
  for (Op* next : {other_fd, read, overlap, backwards}) {
    std::deque<Op*> queue = {a, next, ops.Write(4 * kKiB, 4 * kKiB)};
    const std::deque<Op*> rest(queue.begin() + 1, queue.end());
    MergedRequest run;
    TakeRun(queue, kMaxMergedBytes, run);
    EXPECT_EQ(run.ops, std::vector<Op*>{a});
    EXPECT_EQ(run.bytes, 4 * kKiB);
    // A run of one uses the op's own iovec.
    EXPECT_EQ(run.iovec_data(), a->iov);
    EXPECT_EQ(run.iovec_count(), 1);
    EXPECT_EQ(queue, rest);
  }
}

TEST(ContinuesRunTest, SameKindAndFdStartingWhereTheLastEnds) {
  Ops ops;
  Op* a = ops.Add(OpKind::kWrite, 3, 8 * kKiB, 2 * kKiB, /*buffers=*/2);
  EXPECT_TRUE(ContinuesRun(*a, *ops.Write(12 * kKiB, kKiB)));
  EXPECT_FALSE(ContinuesRun(*a, *ops.Write(12 * kKiB + 1, kKiB)));  // gap
  EXPECT_FALSE(ContinuesRun(*a, *ops.Write(10 * kKiB, kKiB)));  // overlap
  EXPECT_FALSE(ContinuesRun(*a, *ops.Write(0, 8 * kKiB)));  // ends at a
  EXPECT_FALSE(ContinuesRun(*a, *ops.Add(OpKind::kWrite, 4, 12 * kKiB, kKiB)));
  EXPECT_FALSE(ContinuesRun(*a, *ops.Add(OpKind::kRead, 3, 12 * kKiB, kKiB)));
  Op* read = ops.Add(OpKind::kRead, 3, 0, 4 * kKiB);
  EXPECT_TRUE(ContinuesRun(*read, *ops.Add(OpKind::kRead, 3, 4 * kKiB, kKiB)));
  // Only reads and writes have runs.
  Op* sync = ops.Add(OpKind::kFsync, 3, 0, 0, /*buffers=*/0);
  EXPECT_FALSE(ContinuesRun(*sync, *ops.Add(OpKind::kFsync, 3, 0, 0, 0)));
}

TEST(TakeRunTest, ReadsMergeLikeWrites) {
  Ops ops;
  Op* a = ops.Add(OpKind::kRead, 7, 1000, 24);
  Op* b = ops.Add(OpKind::kRead, 7, 1024, 512, /*buffers=*/2);
  std::deque<Op*> queue = {a, b};
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, (std::vector<Op*>{a, b}));
  EXPECT_EQ(run.bytes, 24u + 1024u);
  EXPECT_EQ(Buffers(run), Buffers({a, b}));
}

TEST(TakeRunTest, StopsAtIovMaxBuffers) {
  Ops ops;
  std::deque<Op*> queue;
  // IOV_MAX + 1 requests of one buffer: 512 KiB + 512 bytes, under the cap.
  for (int i = 0; i <= IOV_MAX; ++i) queue.push_back(ops.Write(i * 512u, 512));
  Op* last = queue.back();
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops.size(), static_cast<size_t>(IOV_MAX));
  EXPECT_EQ(run.iovec_count(), IOV_MAX);
  EXPECT_EQ(run.bytes, IOV_MAX * 512u);
  EXPECT_EQ(queue, std::deque<Op*>{last});

  // Requests of several buffers: 400 + 400 fit, a third 400 would not.
  Op* a = ops.Add(OpKind::kWrite, 3, 0, 16, 400);
  Op* b = ops.Add(OpKind::kWrite, 3, 6400, 16, 400);
  Op* c = ops.Add(OpKind::kWrite, 3, 12800, 16, 400);
  queue = {a, b, c};
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, (std::vector<Op*>{a, b}));
  EXPECT_EQ(run.iovec_count(), 800);
  EXPECT_EQ(queue, std::deque<Op*>{c});
}

TEST(TakeRunTest, StopsAtTheByteCap) {
  Ops ops;
  std::deque<Op*> queue;
  for (int i = 0; i < 17; ++i) queue.push_back(ops.Write(i * 64 * kKiB, 64 * kKiB));
  Op* seventeenth = queue.back();
  MergedRequest run;
  // A larger max_bytes is clamped to kMaxMergedBytes.
  TakeRun(queue, 4 * kMaxMergedBytes, run);
  EXPECT_EQ(run.ops.size(), 16u);
  EXPECT_EQ(run.bytes, kMaxMergedBytes);
  EXPECT_EQ(queue, std::deque<Op*>{seventeenth});

  // A smaller one is kept: 100 KiB takes one 64 KiB request.
  queue.clear();
  for (int i = 0; i < 3; ++i) queue.push_back(ops.Write(i * 64 * kKiB, 64 * kKiB));
  TakeRun(queue, 100 * kKiB, run);
  EXPECT_EQ(run.ops.size(), 1u);
  EXPECT_EQ(run.bytes, 64 * kKiB);
  EXPECT_EQ(queue.size(), 2u);
}

// An op's merge_limit (the device's largest request) caps the run it is in.
TEST(TakeRunTest, StopsAtAnOpsMergeLimit) {
  Ops ops;
  std::deque<Op*> queue;
  for (int i = 0; i < 5; ++i) {
    queue.push_back(ops.Write(i * 64 * kKiB, 64 * kKiB));
    queue.back()->merge_limit = 128 * kKiB;
  }
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops.size(), 2u);
  EXPECT_EQ(run.bytes, 128 * kKiB);
  // A later op's limit counts too.
  queue.front()->merge_limit = 0;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops.size(), 2u);
  EXPECT_EQ(queue.size(), 1u);
}

TEST(TakeRunTest, ARequestOverTheCapIsTakenAlone) {
  Ops ops;
  Op* big = ops.Write(0, 2 * kMaxMergedBytes);
  Op* next = ops.Write(2 * kMaxMergedBytes, 4 * kKiB);
  Op* after = ops.Write(2 * kMaxMergedBytes + 4 * kKiB, 4 * kKiB);
  std::deque<Op*> queue = {big, next, after};
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, std::vector<Op*>{big});
  EXPECT_EQ(run.bytes, 2 * kMaxMergedBytes);
  EXPECT_EQ(run.iovec_data(), big->iov);
  EXPECT_EQ(queue, (std::deque<Op*>{next, after}));
  // Runs are reused: the next TakeRun starts from a cleared one.
  TakeRun(queue, kMaxMergedBytes, run);
  EXPECT_EQ(run.ops, (std::vector<Op*>{next, after}));
  EXPECT_EQ(run.bytes, 8 * kKiB);
  EXPECT_EQ(Buffers(run), Buffers({next, after}));
}

// Three ops of 16, 8 and 16 KiB merged.
class SplitResultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    a_ = ops_.Write(0, 16 * kKiB);
    b_ = ops_.Write(16 * kKiB, 8 * kKiB);
    c_ = ops_.Write(24 * kKiB, 16 * kKiB);
    std::deque<Op*> queue = {a_, b_, c_};
    TakeRun(queue, kMaxMergedBytes, run_);
    ASSERT_EQ(run_.ops.size(), 3u);
    for (Op* op : run_.ops) op->result = 12345;
  }

  Ops ops_;
  Op* a_ = nullptr;
  Op* b_ = nullptr;
  Op* c_ = nullptr;
  MergedRequest run_;
};

TEST_F(SplitResultTest, FullCountGivesEveryOpItsLength) {
  SplitResult(run_, 40 * kKiB);
  EXPECT_EQ(a_->result, 16 * 1024);
  EXPECT_EQ(b_->result, 8 * 1024);
  EXPECT_EQ(c_->result, 16 * 1024);
}

TEST_F(SplitResultTest, AnErrorGoesToEveryOp) {
  SplitResult(run_, -EIO);
  EXPECT_EQ(a_->result, -EIO);
  EXPECT_EQ(b_->result, -EIO);
  EXPECT_EQ(c_->result, -EIO);
}

TEST_F(SplitResultTest, AShortCountEndsInsideTheSecondOp) {
  SplitResult(run_, 16 * kKiB + 100);
  EXPECT_EQ(a_->result, 16 * 1024);
  EXPECT_EQ(b_->result, 100);
  EXPECT_EQ(c_->result, -EAGAIN);
}

TEST_F(SplitResultTest, AShortCountEndingBetweenOps) {
  SplitResult(run_, 16 * kKiB);
  EXPECT_EQ(a_->result, 16 * 1024);
  EXPECT_EQ(b_->result, -EAGAIN);
  EXPECT_EQ(c_->result, -EAGAIN);
  // Nothing at all (end of file at the run's start): a short count of the
  // first op, as if it had run alone.
  SplitResult(run_, 0);
  EXPECT_EQ(a_->result, 0);
  EXPECT_EQ(b_->result, -EAGAIN);
  EXPECT_EQ(c_->result, -EAGAIN);
}

TEST(SplitResultSingleTest, ARunOfOneGetsTheResultAsIs) {
  Ops ops;
  Op* a = ops.Write(0, 4 * kKiB);
  std::deque<Op*> queue = {a};
  MergedRequest run;
  TakeRun(queue, kMaxMergedBytes, run);
  SplitResult(run, 100);
  EXPECT_EQ(a->result, 100);
  SplitResult(run, -ENOSPC);
  EXPECT_EQ(a->result, -ENOSPC);
}

}  // namespace
}  // namespace imgtool::io
