#include "quorum_block/quorum_node.h"

#include <cerrno>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "base/errno_status.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::quorum_block {
namespace {

using io::testing::MemoryNode;
using io::testing::RunInline;

constexpr uint64_t kSize = 4096;

// A node whose reads, writes and flushes fail with `error_number`.
class FailingNode final : public io::BlockNode {
 public:
  explicit FailingNode(int error_number)
      : io::BlockNode("failing", false), error_number_(error_number) {}
  uint64_t size() const override { return kSize; }
  io::Task<absl::Status> Close() override { co_return absl::OkStatus(); }

 protected:
  io::Task<absl::Status> DoRead(uint64_t, io::IoVec) override {
    co_return ErrnoStatus("failing", "read", error_number_);
  }
  io::Task<absl::Status> DoWrite(uint64_t, io::ConstIoVec) override {
    co_return ErrnoStatus("failing", "write", error_number_);
  }
  io::Task<absl::Status> DoFlush() override {
    co_return ErrnoStatus("failing", "flush", error_number_);
  }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t, uint64_t) override {
    co_return ErrnoStatus("failing", "block status", error_number_);
  }

 private:
  const int error_number_;
};

std::vector<uint8_t> Filled(uint8_t byte) {
  return std::vector<uint8_t>(kSize, byte);
}

QuorumSettings Settings(int threshold, bool rewrite = false) {
  QuorumSettings s;
  s.threshold = threshold;
  s.rewrite_corrupted = rewrite;
  return s;
}

TEST(QuorumVoteTest, AllEqualWinsWithFirstChild) {
  const std::vector<uint8_t> a = Filled(1);
  std::vector<ChildRead> reads = {{absl::OkStatus(), a},
                                  {absl::OkStatus(), a},
                                  {absl::OkStatus(), a}};
  VoteResult r = Vote(reads, Settings(3), "q");
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.winner, 0);
  EXPECT_TRUE(r.losers.empty());
}

TEST(QuorumVoteTest, MajorityWinsAndNamesTheLoser) {
  const std::vector<uint8_t> a = Filled(1), b = Filled(2);
  std::vector<ChildRead> reads = {{absl::OkStatus(), b},
                                  {absl::OkStatus(), a},
                                  {absl::OkStatus(), a}};
  VoteResult r = Vote(reads, Settings(2), "q");
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.winner, 1);
  EXPECT_EQ(r.losers, std::vector<int>{0});
}

TEST(QuorumVoteTest, MajorityBelowThresholdIsEio) {
  const std::vector<uint8_t> a = Filled(1), b = Filled(2);
  std::vector<ChildRead> reads = {{absl::OkStatus(), b},
                                  {absl::OkStatus(), a},
                                  {absl::OkStatus(), a}};
  VoteResult r = Vote(reads, Settings(3), "q");
  EXPECT_EQ(StatusErrno(r.status), EIO);
}

TEST(QuorumVoteTest, TieGoesToTheGroupSeenLast) {
  // QEMU's vote list has the newest version first and takes the first with
  // the most votes: with threshold 1 and two different reads, the second.
  const std::vector<uint8_t> a = Filled(1), b = Filled(2);
  std::vector<ChildRead> reads = {{absl::OkStatus(), a},
                                  {absl::OkStatus(), b}};
  VoteResult r = Vote(reads, Settings(1), "q");
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.winner, 1);
  EXPECT_EQ(r.losers, std::vector<int>{0});
}

TEST(QuorumVoteTest, TooFewSuccessesReturnTheMostCommonError) {
  const std::vector<uint8_t> a = Filled(1);
  std::vector<ChildRead> reads = {
      {ErrnoStatus("x", "read", ENOSPC), {}},
      {ErrnoStatus("y", "read", EPERM), {}},
      {ErrnoStatus("z", "read", EPERM), {}},
      {absl::OkStatus(), a}};
  VoteResult r = Vote(reads, Settings(2), "q");
  EXPECT_EQ(StatusErrno(r.status), EPERM);
}

TEST(QuorumVoteTest, FailedChildrenAreNotLosers) {
  const std::vector<uint8_t> a = Filled(1), b = Filled(2);
  std::vector<ChildRead> reads = {{ErrnoStatus("x", "read", EIO), {}},
                                  {absl::OkStatus(), a},
                                  {absl::OkStatus(), a},
                                  {absl::OkStatus(), b}};
  VoteResult r = Vote(reads, Settings(2), "q");
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.winner, 1);
  EXPECT_EQ(r.losers, std::vector<int>{3});
}

TEST(QuorumVoteTest, BlkverifyReportsTheFirstDifferingByte) {
  std::vector<uint8_t> a = Filled(1), b = Filled(1);
  b[100] = 7;
  QuorumSettings s = Settings(2);
  s.blkverify = true;
  std::vector<ChildRead> reads = {{absl::OkStatus(), a},
                                  {absl::OkStatus(), b}};
  EXPECT_EQ(Vote(reads, s, "q").mismatch, 100);
}

TEST(QuorumOptionsTest, QemuChecksAndTexts) {
  QuorumOptions o;
  EXPECT_EQ(CheckQuorumOptions(o, 0).status().message(),
            "Number of provided children must be 1 or more");
  EXPECT_EQ(CheckQuorumOptions(o, 2).status().message(),
            "Parameter 'vote-threshold' expects a value >= 1");
  o.set_vote_threshold(3);
  EXPECT_EQ(CheckQuorumOptions(o, 2).status().message(),
            "threshold may not exceed children count");
  o.set_vote_threshold(1);
  o.set_read_pattern("round-robin");
  EXPECT_EQ(CheckQuorumOptions(o, 2).status().message(),
            "Please set read-pattern as fifo or quorum");
  o.set_read_pattern("quorum");
  o.set_blkverify(true);
  EXPECT_EQ(CheckQuorumOptions(o, 2).status().message(),
            "blkverify=on can only be set if there are exactly two files "
            "and vote-threshold is 2");
  o.set_vote_threshold(2);
  o.set_rewrite_corrupted(true);
  EXPECT_EQ(CheckQuorumOptions(o, 2).status().message(),
            "rewrite-corrupted=on cannot be used with blkverify=on");
  o.set_read_pattern("fifo");  // both ignored
  absl::StatusOr<QuorumSettings> s = CheckQuorumOptions(o, 2);
  ASSERT_TRUE(s.ok());
  EXPECT_FALSE(s->blkverify);
  EXPECT_FALSE(s->rewrite_corrupted);
  EXPECT_EQ(s->read_pattern, ReadPattern::kFifo);
}

struct Graph {
  std::vector<MemoryNode*> children;
  std::unique_ptr<QuorumNode> node;
};

Graph MakeGraph(std::vector<uint8_t> fills, const QuorumSettings& settings) {
  Graph g;
  std::vector<std::unique_ptr<io::BlockNode>> nodes;
  for (uint8_t fill : fills) {
    auto m = std::make_unique<MemoryNode>("m", Filled(fill), false, kSize);
    g.children.push_back(m.get());
    nodes.push_back(std::move(m));
  }
  absl::StatusOr<std::unique_ptr<QuorumNode>> q =
      QuorumNode::Open(std::move(nodes), settings, "q", false);
  EXPECT_TRUE(q.ok()) << q.status();
  g.node = *std::move(q);
  return g;
}

TEST(QuorumNodeTest, RewriteCorruptedRepairsTheLoser) {
  Graph g = MakeGraph({1, 2, 1}, Settings(2, /*rewrite=*/true));
  std::vector<uint8_t> buf(512);
  ASSERT_TRUE(RunInline(g.node->Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf[0], 1);
  EXPECT_EQ(g.children[1]->bytes()[0], 1);
  EXPECT_EQ(g.children[1]->bytes()[512], 2);  // only the range read
}

TEST(QuorumNodeTest, WithoutRewriteTheLoserStays) {
  Graph g = MakeGraph({1, 2, 1}, Settings(2));
  std::vector<uint8_t> buf(512);
  ASSERT_TRUE(RunInline(g.node->Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(g.children[1]->bytes()[0], 2);
}

TEST(QuorumNodeTest, FifoReadsTheFirstChildThatSucceeds) {
  std::vector<std::unique_ptr<io::BlockNode>> nodes;
  nodes.push_back(std::make_unique<FailingNode>(EIO));
  nodes.push_back(std::make_unique<MemoryNode>("m", Filled(5), false, kSize));
  nodes.push_back(std::make_unique<MemoryNode>("m", Filled(6), false, kSize));
  QuorumSettings s = Settings(1);
  s.read_pattern = ReadPattern::kFifo;
  absl::StatusOr<std::unique_ptr<QuorumNode>> q =
      QuorumNode::Open(std::move(nodes), s, "q", false);
  ASSERT_TRUE(q.ok());
  std::vector<uint8_t> buf(512);
  ASSERT_TRUE(RunInline((*q)->Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf[0], 5);
}

TEST(QuorumNodeTest, WriteNeedsThresholdSuccesses) {
  for (int threshold : {2, 3}) {
    std::vector<std::unique_ptr<io::BlockNode>> nodes;
    nodes.push_back(std::make_unique<MemoryNode>("m", Filled(0), false, kSize));
    nodes.push_back(std::make_unique<FailingNode>(ENOSPC));
    nodes.push_back(std::make_unique<MemoryNode>("m", Filled(0), false, kSize));
    absl::StatusOr<std::unique_ptr<QuorumNode>> q =
        QuorumNode::Open(std::move(nodes), Settings(threshold), "q", false);
    ASSERT_TRUE(q.ok());
    const std::vector<uint8_t> data = Filled(9);
    absl::Status st =
        *RunInline((*q)->Write(0, io::ConstIoVec(data.data(), 512)));
    if (threshold == 2) {
      EXPECT_TRUE(st.ok()) << st;
    } else {
      EXPECT_EQ(StatusErrno(st), ENOSPC);
    }
    EXPECT_EQ(StatusErrno(*RunInline((*q)->Flush())),
              threshold == 2 ? 0 : ENOSPC);
  }
}

TEST(QuorumNodeTest, LengthsMustAgreeInSectors) {
  std::vector<std::unique_ptr<io::BlockNode>> nodes;
  nodes.push_back(std::make_unique<MemoryNode>(
      "m", std::vector<uint8_t>(1000), false, 4096));
  nodes.push_back(std::make_unique<MemoryNode>(
      "m", std::vector<uint8_t>(1024), false, 4096));
  nodes.push_back(std::make_unique<MemoryNode>(
      "m", std::vector<uint8_t>(1536), false, 4096));
  absl::StatusOr<std::unique_ptr<QuorumNode>> q =
      QuorumNode::Open(std::move(nodes), Settings(1), "q", false);
  EXPECT_EQ(q.status().message(),
            "Could not refresh total sector count: Input/output error");
  EXPECT_EQ(nodes.size(), 3u);  // still the caller's
}

TEST(QuorumNodeTest, HasNoDirectory) {
  Graph g = MakeGraph({0}, Settings(1));
  EXPECT_EQ(g.node->Dirname().status().message(),
            "Cannot generate a base directory for quorum nodes");
}

}  // namespace
}  // namespace imgtool::quorum_block
