#include "cor_filter/cor_filter.h"

#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::cor_filter {
namespace {

using io::testing::RunInline;

constexpr uint64_t kBlock = 4096;

// A format-like layer in memory: 4 KiB blocks, each unallocated (the
// backing node shows through), data or zero; counts what reaches it.
class LayerNode final : public io::BlockNode {
 public:
  LayerNode(uint64_t size, std::unique_ptr<io::BlockNode> backing)
      : io::BlockNode("layer", false),
        bytes_(size),
        state_((size + kBlock - 1) / kBlock, kUnallocated),
        backing_(std::move(backing)) {}

  enum State { kUnallocated, kData, kZero };

  void Fill(uint64_t block, uint8_t value) {
    std::memset(bytes_.data() + block * kBlock, value,
                std::min<uint64_t>(kBlock, bytes_.size() - block * kBlock));
    state_[block] = kData;
  }
  State state(uint64_t block) const { return state_[block]; }
  uint8_t byte(uint64_t offset) const { return bytes_[offset]; }

  uint64_t size() const override { return bytes_.size(); }
  io::BlockNode* backing() const override { return backing_.get(); }
  io::Task<absl::Status> Close() override { co_return absl::OkStatus(); }

  int writes = 0;
  int zero_writes = 0;
  int cor_events = 0;
  std::vector<std::pair<uint64_t, uint64_t>> write_ranges;

 protected:
  bool HandlesDebugEvents() const override { return true; }
  io::Task<void> DoDebugEvent(io::BlkdebugEvent event) override {
    if (event == io::BlkdebugEvent::kCorWrite) ++cor_events;
    co_return;
  }
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    for (uint64_t i = 0; i < buf.size(); ++i) {
      const uint64_t pos = offset + i;
      if (pos >= bytes_.size()) {
        buf[i] = 0;
      } else if (state_[pos / kBlock] == kUnallocated) {
        buf[i] = 0;
        if (backing_ != nullptr && pos < backing_->size()) {
          absl::Status st = co_await backing_->Read(pos, buf.subspan(i, 1));
          if (!st.ok()) co_return st;
        }
      } else {
        buf[i] = bytes_[pos];
      }
    }
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    ++writes;
    write_ranges.emplace_back(offset, data.size());
    std::memcpy(bytes_.data() + offset, data.data(), data.size());
    Mark(offset, data.size(), kData);
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags) override {
    ++zero_writes;
    write_ranges.emplace_back(offset, length);
    std::memset(bytes_.data() + offset, 0, length);
    Mark(offset, length, kZero);
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoFlush() override { co_return absl::OkStatus(); }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    const State s = state_[offset / kBlock];
    uint64_t end = offset;
    while (end < offset + max_length && end < bytes_.size() &&
           state_[end / kBlock] == s) {
      end = (end / kBlock + 1) * kBlock;
    }
    io::BlockStatus st;
    st.length = std::min(end, offset + max_length) - offset;
    st.data = s == kData;
    st.zero = s == kZero;
    co_return st;
  }

 private:
  void Mark(uint64_t offset, uint64_t length, State s) {
    // Whole blocks only in these tests (the filter widens to clusters).
    for (uint64_t b = offset / kBlock; b * kBlock < offset + length; ++b) {
      state_[b] = s;
    }
  }

  std::vector<uint8_t> bytes_;
  std::vector<State> state_;
  std::unique_ptr<io::BlockNode> backing_;
};

std::vector<uint8_t> Pattern(uint64_t n, uint8_t v) {
  return std::vector<uint8_t>(n, v);
}

struct Chain {
  LayerNode* top;
  LayerNode* mid;
  LayerNode* base;
  std::unique_ptr<LayerNode> owner;
};

// top -> mid -> base, 8 blocks each.
Chain MakeChain() {
  auto base = std::make_unique<LayerNode>(8 * kBlock, nullptr);
  LayerNode* b = base.get();
  auto mid = std::make_unique<LayerNode>(8 * kBlock, std::move(base));
  LayerNode* m = mid.get();
  auto top = std::make_unique<LayerNode>(8 * kBlock, std::move(mid));
  LayerNode* t = top.get();
  return Chain{t, m, b, std::move(top)};
}

TEST(CorFilterTest, ReadFromBackingCopiesWholeClustersIntoTheChild) {
  Chain c = MakeChain();
  c.base->Fill(1, 0x55);
  CorNode cor(std::move(c.owner), CorSettings{.cluster_size = kBlock});
  std::vector<uint8_t> buf(50);
  ASSERT_TRUE(RunInline(cor.Read(kBlock + 100, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, Pattern(50, 0x55));
  EXPECT_EQ(c.top->state(1), LayerNode::kData);
  EXPECT_EQ(c.top->byte(kBlock), 0x55);
  EXPECT_EQ(c.top->byte(2 * kBlock - 1), 0x55);
  EXPECT_EQ(c.top->state(0), LayerNode::kUnallocated);
  EXPECT_EQ(c.top->state(2), LayerNode::kUnallocated);
  EXPECT_EQ(c.top->cor_events, 1);
  ASSERT_EQ(c.top->write_ranges.size(), 1u);
  EXPECT_EQ(c.top->write_ranges[0], std::make_pair(kBlock, kBlock));
}

TEST(CorFilterTest, AllocatedClustersAreNotRewritten) {
  Chain c = MakeChain();
  c.top->Fill(0, 0x11);
  c.base->Fill(1, 0x22);
  CorNode cor(std::move(c.owner), CorSettings{.cluster_size = kBlock});
  std::vector<uint8_t> buf(2 * kBlock);
  ASSERT_TRUE(RunInline(cor.Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf[0], 0x11);
  EXPECT_EQ(buf[kBlock], 0x22);
  ASSERT_EQ(c.top->write_ranges.size(), 1u);
  EXPECT_EQ(c.top->write_ranges[0], std::make_pair(kBlock, kBlock));
  EXPECT_EQ(c.top->cor_events, 1);
}

TEST(CorFilterTest, FullyAllocatedReadsPassThrough) {
  Chain c = MakeChain();
  c.top->Fill(2, 0x33);
  CorNode cor(std::move(c.owner), CorSettings{.cluster_size = kBlock});
  std::vector<uint8_t> buf(100);
  ASSERT_TRUE(RunInline(cor.Read(2 * kBlock, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, Pattern(100, 0x33));
  EXPECT_EQ(c.top->writes + c.top->zero_writes, 0);
  EXPECT_EQ(c.top->cor_events, 0);
}

TEST(CorFilterTest, ZeroesFromBackingBecomeZeroWrites) {
  Chain c = MakeChain();
  CorNode cor(std::move(c.owner), CorSettings{.cluster_size = kBlock});
  std::vector<uint8_t> buf(3 * kBlock, 0xff);
  ASSERT_TRUE(RunInline(cor.Read(kBlock, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, Pattern(3 * kBlock, 0));
  EXPECT_EQ(c.top->writes, 0);
  EXPECT_EQ(c.top->zero_writes, 1);
  EXPECT_EQ(c.top->state(1), LayerNode::kZero);
  EXPECT_EQ(c.top->state(3), LayerNode::kZero);
  EXPECT_EQ(c.top->state(4), LayerNode::kUnallocated);
}

TEST(CorFilterTest, BottomLimitsTheLayersCopiedFrom) {
  Chain c = MakeChain();
  c.mid->Fill(0, 0x44);   // above bottom (mid): copied
  c.base->Fill(1, 0x66);  // below bottom: read, not copied
  CorNode cor(std::move(c.owner),
              CorSettings{.cluster_size = kBlock, .bottom = c.mid});
  std::vector<uint8_t> buf(3 * kBlock);
  ASSERT_TRUE(RunInline(cor.Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf[0], 0x44);
  EXPECT_EQ(buf[kBlock], 0x66);
  EXPECT_EQ(buf[2 * kBlock], 0);
  EXPECT_EQ(c.top->state(0), LayerNode::kData);
  EXPECT_EQ(c.top->state(1), LayerNode::kUnallocated);
  EXPECT_EQ(c.top->state(2), LayerNode::kUnallocated);
  EXPECT_EQ(c.top->cor_events, 1);
}

TEST(CorFilterTest, PartialFinalClusterCopiesUpToTheEnd) {
  auto base = std::make_unique<LayerNode>(1024, nullptr);
  base->Fill(0, 0x77);
  auto top = std::make_unique<LayerNode>(1024, std::move(base));
  LayerNode* t = top.get();
  CorNode cor(std::move(top), CorSettings{.cluster_size = 65536});
  std::vector<uint8_t> buf(1024);
  ASSERT_TRUE(RunInline(cor.Read(0, io::IoVec(buf)))->ok());
  EXPECT_EQ(buf, Pattern(1024, 0x77));
  ASSERT_EQ(t->write_ranges.size(), 1u);
  EXPECT_EQ(t->write_ranges[0], std::make_pair(uint64_t{0}, uint64_t{1024}));
}

TEST(CorFilterTest, WritesPassThrough) {
  Chain c = MakeChain();
  CorNode cor(std::move(c.owner), CorSettings{.cluster_size = kBlock});
  std::vector<uint8_t> data(kBlock, 0x99);
  ASSERT_TRUE(RunInline(cor.Write(3 * kBlock, io::ConstIoVec(data)))->ok());
  EXPECT_EQ(c.top->byte(3 * kBlock), 0x99);
  ASSERT_TRUE(RunInline(cor.WriteZeroes(4 * kBlock, kBlock, {}))->ok());
  EXPECT_EQ(c.top->state(4), LayerNode::kZero);
  EXPECT_EQ(c.top->cor_events, 0);
  EXPECT_EQ(cor.size(), 8 * kBlock);
  EXPECT_EQ(cor.primary_child(), c.top);
}

TEST(CorFilterTest, BackingChainNextGoesThroughFilters) {
  Chain c = MakeChain();
  LayerNode* mid = c.mid;
  CorNode cor(std::move(c.owner), CorSettings{});
  EXPECT_EQ(BackingChainNext(cor), mid);
  EXPECT_EQ(BackingChainNext(*mid), c.base);
  EXPECT_EQ(BackingChainNext(*c.base), nullptr);
}

}  // namespace
}  // namespace imgtool::cor_filter
