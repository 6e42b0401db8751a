#include "io/block_node.h"

#include <cerrno>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/errno_status.h"
#include "gtest/gtest.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::io {
namespace {

using testing::MemoryNode;
using testing::RunInline;

// A node over `child` that handles nothing itself (a filter or format).
class PassNode : public BlockNode {
 public:
  explicit PassNode(std::unique_ptr<BlockNode> child)
      : BlockNode("pass", false), child_(std::move(child)) {}
  uint64_t size() const override { return child_->size(); }
  Task<absl::Status> Close() override { co_return absl::OkStatus(); }
  BlockNode* primary_child() const override { return child_.get(); }

 protected:
  Task<absl::Status> DoRead(uint64_t offset, IoVec buf) override {
    return child_->Read(offset, buf);
  }
  Task<absl::Status> DoWrite(uint64_t offset, ConstIoVec data) override {
    return child_->Write(offset, data);
  }
  Task<absl::Status> DoFlush() override { return child_->Flush(); }
  Task<absl::StatusOr<BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    return child_->GetBlockStatus(offset, max_length);
  }

 private:
  std::unique_ptr<BlockNode> child_;
};

// A node that handles debug events: records them and its breakpoint calls.
class RecordingNode final : public PassNode {
 public:
  using PassNode::PassNode;
  std::vector<BlkdebugEvent> events;
  std::vector<std::string> calls;

 protected:
  bool HandlesDebugEvents() const override { return true; }
  Task<void> DoDebugEvent(BlkdebugEvent event) override {
    events.push_back(event);
    co_return;
  }
  absl::Status DoDebugBreakpoint(BlkdebugEvent event,
                                 absl::string_view tag) override {
    calls.push_back("break " + std::string(BlkdebugEventName(event)) + " " +
                    std::string(tag));
    return absl::OkStatus();
  }
  absl::Status DoDebugRemoveBreakpoint(absl::string_view tag) override {
    calls.push_back("remove " + std::string(tag));
    return absl::OkStatus();
  }
  absl::Status DoDebugResume(absl::string_view tag) override {
    calls.push_back("resume " + std::string(tag));
    return absl::OkStatus();
  }
  bool DoDebugIsSuspended(absl::string_view tag) override {
    return tag == "A";
  }
};

std::unique_ptr<BlockNode> Memory() {
  return std::make_unique<MemoryNode>("mem", std::vector<uint8_t>(512), false,
                                      1 << 20);
}

Task<void> Raise(BlockNode& node, BlkdebugEvent event) {
  co_await node.DebugEvent(event);
}

TEST(BlkdebugEventTest, NamesAreQemu72sInOrderAndRoundTrip) {
  // qapi/block-core.json of QEMU 7.2, BlkdebugEvent.
  const std::vector<std::string> qemu = {
      "l1_update", "l1_grow_alloc_table", "l1_grow_write_table",
      "l1_grow_activate_table", "l2_load", "l2_update", "l2_update_compressed",
      "l2_alloc_cow_read", "l2_alloc_write", "read_aio", "read_backing_aio",
      "read_compressed", "write_aio", "write_compressed", "vmstate_load",
      "vmstate_save", "cow_read", "cow_write", "reftable_load",
      "reftable_grow", "reftable_update", "refblock_load", "refblock_update",
      "refblock_update_part", "refblock_alloc", "refblock_alloc_hookup",
      "refblock_alloc_write", "refblock_alloc_write_blocks",
      "refblock_alloc_write_table", "refblock_alloc_switch_table",
      "cluster_alloc", "cluster_alloc_bytes", "cluster_free", "flush_to_os",
      "flush_to_disk", "pwritev_rmw_head", "pwritev_rmw_after_head",
      "pwritev_rmw_tail", "pwritev_rmw_after_tail", "pwritev", "pwritev_zero",
      "pwritev_done", "empty_image_prepare", "l1_shrink_write_table",
      "l1_shrink_free_l2_clusters", "cor_write", "cluster_alloc_space",
      "none"};
  ASSERT_EQ(kBlkdebugEventCount, 48);
  ASSERT_EQ(qemu.size(), 48u);
  for (int i = 0; i < kBlkdebugEventCount; ++i) {
    const auto event = static_cast<BlkdebugEvent>(i);
    EXPECT_EQ(BlkdebugEventName(event), qemu[i]);
    EXPECT_EQ(ParseBlkdebugEvent(qemu[i]), event);
  }
  EXPECT_EQ(BlkdebugEventName(BlkdebugEvent::kRefblockAllocWrite),
            "refblock_alloc_write");
}

TEST(BlkdebugEventTest, UnknownAndDottedNamesAreNotEvents) {
  EXPECT_FALSE(ParseBlkdebugEvent("l1_grow.alloc_table").has_value());
  EXPECT_FALSE(ParseBlkdebugEvent("").has_value());
  EXPECT_FALSE(ParseBlkdebugEvent("L1_UPDATE").has_value());
  EXPECT_FALSE(ParseBlkdebugEvent("neg1").has_value());
}

TEST(DebugEventTest, NodeThatHandlesNothingIgnoresEvents) {
  std::unique_ptr<BlockNode> node = Memory();
  // Completes at once; nothing to observe but that it does.
  ASSERT_TRUE(RunInline([&]() -> Task<bool> {
                co_await node->DebugEvent(BlkdebugEvent::kWriteAio);
                co_return true;
              }())
                  .has_value());
}

TEST(DebugEventTest, EventReachesOnlyTheNodeItIsRaisedOn) {
  auto recording = std::make_unique<RecordingNode>(Memory());
  RecordingNode* rec = recording.get();
  PassNode top(std::move(recording));
  // Raised on the filter above: QEMU's bdrv_debug_event does not walk down.
  RunInline([&]() -> Task<bool> {
    co_await Raise(top, BlkdebugEvent::kL2Update);
    co_await Raise(*rec, BlkdebugEvent::kRefblockAlloc);
    co_await Raise(*rec, BlkdebugEvent::kNone);
    co_return true;
  }());
  EXPECT_EQ(rec->events, (std::vector<BlkdebugEvent>{
                             BlkdebugEvent::kRefblockAlloc,
                             BlkdebugEvent::kNone}));
}

TEST(DebugBreakpointTest, OperationsGoDownThePrimaryChildChain) {
  auto recording = std::make_unique<RecordingNode>(Memory());
  RecordingNode* rec = recording.get();
  PassNode top(std::make_unique<PassNode>(std::move(recording)));
  EXPECT_TRUE(top.DebugBreakpoint("write_aio", "A").ok());
  EXPECT_TRUE(top.DebugResume("A").ok());
  EXPECT_TRUE(top.DebugRemoveBreakpoint("B").ok());
  EXPECT_TRUE(top.DebugIsSuspended("A"));
  EXPECT_FALSE(top.DebugIsSuspended("B"));
  EXPECT_EQ(rec->calls, (std::vector<std::string>{"break write_aio A",
                                                  "resume A", "remove B"}));
}

TEST(DebugBreakpointTest, UnknownEventIsENOENT) {
  PassNode top(std::make_unique<RecordingNode>(Memory()));
  absl::Status st = top.DebugBreakpoint("no_such_event", "A");
  EXPECT_EQ(st.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(st.message(), "No such file or directory");
  EXPECT_EQ(StatusErrno(st), ENOENT);
}

TEST(DebugBreakpointTest, WithoutADebugNodeEveryOperationIsENOTSUP) {
  PassNode top(Memory());
  for (const absl::Status& st :
       {top.DebugBreakpoint("write_aio", "A"), top.DebugResume("A"),
        top.DebugRemoveBreakpoint("A")}) {
    EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
    EXPECT_EQ(st.message(), "Operation not supported");
    EXPECT_EQ(StatusErrno(st), ENOTSUP);
  }
  // Also for a bad event name: the debug node is looked for first.
  EXPECT_EQ(top.DebugBreakpoint("nonsense", "A").message(),
            "Operation not supported");
  EXPECT_FALSE(top.DebugIsSuspended("A"));
}

}  // namespace
}  // namespace imgtool::io
