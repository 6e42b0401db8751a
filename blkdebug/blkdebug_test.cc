#include "blkdebug/blkdebug.h"

#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::blkdebug {
namespace {

using io::BlkdebugEvent;
using io::testing::MemoryNode;
using io::testing::RunInline;

std::string WriteConfig(const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  static int n = 0;
  std::string path =
      std::string(dir != nullptr ? dir : "/tmp") + "/blkdebug" +
      std::to_string(n++) + ".conf";
  std::ofstream(path) << text;
  return path;
}

absl::Status ConfigError(const std::string& text) {
  return ParseConfigFile(WriteConfig(text)).status();
}

struct Opened {
  std::unique_ptr<BlkdebugNode> node;
  MemoryNode* image;
  std::ostringstream messages;
};

// A blkdebug node over a 64 KiB memory image holding bytes i % 251.
std::unique_ptr<Opened> Open(std::vector<Rule> rules,
                             BlkdebugOptions options = {},
                             uint64_t image_size = 65536) {
  std::vector<uint8_t> bytes(image_size);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = i % 251;
  auto image = std::make_unique<MemoryNode>("img", std::move(bytes), false,
                                            1 << 20);
  auto out = std::make_unique<Opened>();
  out->image = image.get();
  auto node = RunInline(OpenBlkdebug(std::move(image), options,
                                     std::move(rules)));
  EXPECT_TRUE(node.has_value() && node->ok());
  out->node = std::move(**node);
  out->node->set_message_stream(&out->messages);
  return out;
}

Rule Inject(BlkdebugEvent event, int error, bool once, int64_t sector = -1) {
  Rule r;
  r.action = Rule::Action::kInjectError;
  r.event = event;
  r.error = error;
  r.once = once;
  r.offset = sector < 0 ? -1 : sector * 512;
  r.iotype_mask = 0x1f;
  return r;
}

void Raise(io::BlockNode& node, BlkdebugEvent event) {
  RunInline([](io::BlockNode& n, BlkdebugEvent e) -> io::Task<bool> {
    co_await n.DebugEvent(e);
    co_return true;
  }(node, event));
}

absl::Status Write(io::BlockNode& node, uint64_t offset, uint64_t length,
                   uint8_t fill) {
  std::vector<uint8_t> data(length, fill);
  return *RunInline(node.Write(offset, io::ConstIoVec(data.data(), length)));
}

absl::Status Read(io::BlockNode& node, uint64_t offset,
                  std::vector<uint8_t>* out) {
  return *RunInline(node.Read(offset, io::IoVec(out->data(), out->size())));
}

TEST(BlkdebugConfigTest, ParsesSectionsInjectErrorsFirst) {
  auto rules = ParseConfigFile(WriteConfig(
      "# comment\n"
      "[set-state]\n"
      "event = \"l2_load\"\n"
      "new_state = \"2\"\n"
      "\n"
      "[inject-error]\n"
      "event = \"write_aio\"\n"
      "errno = \"28\"\n"
      "once = \"on\"\n"
      "sector = \"8\"\n"
      "state = \"2\"\n"
      "[inject-error]\n"
      "  event = \"read_aio\"\n"
      "iotype = \"flush\"\n"
      "immediately =\"yes\"\n"));
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 3u);
  const Rule& a = (*rules)[0];
  EXPECT_EQ(a.action, Rule::Action::kInjectError);
  EXPECT_EQ(a.event, BlkdebugEvent::kWriteAio);
  EXPECT_EQ(a.error, 28);
  EXPECT_TRUE(a.once);
  EXPECT_FALSE(a.immediately);
  EXPECT_EQ(a.offset, 4096);
  EXPECT_EQ(a.state, 2);
  EXPECT_EQ(a.iotype_mask, 0x1fu);  // read, write, write-zeroes, discard, flush
  const Rule& b = (*rules)[1];
  EXPECT_EQ(b.event, BlkdebugEvent::kReadAio);
  EXPECT_EQ(b.error, EIO);
  EXPECT_EQ(b.offset, -1);
  EXPECT_TRUE(b.immediately);
  EXPECT_EQ(b.iotype_mask, 1u << 4);
  const Rule& c = (*rules)[2];
  EXPECT_EQ(c.action, Rule::Action::kSetState);
  EXPECT_EQ(c.event, BlkdebugEvent::kL2Load);
  EXPECT_EQ(c.new_state, 2);
}

TEST(BlkdebugConfigTest, ErrorsAreQemus) {
  // Each text is what qemu-io 7.2 prints after "can't open device X: ".
  EXPECT_EQ(ConfigError("[inject-error]\nevent = \"l2_load\"\nfoo = \"1\"\n")
                .message(),
            "Invalid parameter 'foo'");
  EXPECT_EQ(ConfigError("[inject-error]\nevent = \"l2_loadx\"\n").message(),
            "invalid parameter value: l2_loadx");
  EXPECT_EQ(ConfigError("[inject-error]\nerrno = \"5\"\n").message(),
            "Missing event name for rule");
  EXPECT_EQ(ConfigError("[inject-error]\nevent = l2_load\n").message(),
            "invalid parameter value: ");
  EXPECT_EQ(ConfigError("[foo]\nevent = \"l2_load\"\n").message(),
            "There is no option group 'foo'");
  EXPECT_EQ(ConfigError("event = \"l2_load\"\n").message(),
            "no group defined");
  EXPECT_EQ(ConfigError("  [inject-error]\n").message(), "no group defined");
  EXPECT_EQ(
      ConfigError("[inject-error]\nevent = \"l2_load\"\nerrno = \"x\"\n")
          .message(),
      "Parameter 'errno' expects a number");
  EXPECT_EQ(
      ConfigError("[inject-error]\nevent = \"l2_load\"\niotype = \"x\"\n")
          .message(),
      "invalid parameter value: x");
  EXPECT_EQ(
      ConfigError("[inject-error]\nevent = \"l2_load\"\nonce = \"maybe\"\n")
          .message(),
      "Parameter 'once' expects 'on' or 'off'");
  EXPECT_EQ(ConfigError("[inject-error]\n   \n").message(), "parse error");
  absl::Status missing = ParseConfigFile("/nonexistent/blkdebug.conf").status();
  EXPECT_EQ(missing.message(),
            "Could not read blkdebug config file: No such file or directory");
  EXPECT_EQ(StatusErrno(missing), ENOENT);
}

TEST(BlkdebugConfigTest, RulesFromOptionsListsInIndexOrder) {
  auto list = BuildNodeOptions(*ParseOptionString(
      "inject-error.1.event=read_aio,inject-error.0.event=write_aio,"
      "inject-error.0.errno=28,set-state.state=1,set-state.event=l1_update,"
      "set-state.new_state=3",
      ""));
  ASSERT_TRUE(list.ok()) << list.status();
  auto rules = RulesFromOptions(*list);
  ASSERT_TRUE(rules.ok()) << rules.status();
  ASSERT_EQ(rules->size(), 3u);
  EXPECT_EQ((*rules)[0].event, BlkdebugEvent::kWriteAio);
  EXPECT_EQ((*rules)[0].error, 28);
  EXPECT_EQ((*rules)[1].event, BlkdebugEvent::kReadAio);
  EXPECT_EQ((*rules)[2].action, Rule::Action::kSetState);
  EXPECT_EQ((*rules)[2].new_state, 3);

  auto bad = BuildNodeOptions(
      *ParseOptionString("inject-error.0.event=write_aio,inject-error.0.x=1", ""));
  EXPECT_EQ(RulesFromOptions(*bad).status().message(),
            "Invalid parameter 'x'");
}

TEST(BlkdebugFilenameTest, SplitsConfigAndImage) {
  NodeOptions node;
  ASSERT_TRUE(ParseBlkdebugFilename("blkdebug:a.conf:dir/x:y.qcow2", &node).ok());
  EXPECT_EQ(node.values["config"], "a.conf");
  EXPECT_EQ(node.values["x-image"], "dir/x:y.qcow2");
  NodeOptions empty;
  ASSERT_TRUE(ParseBlkdebugFilename("blkdebug::x.qcow2", &empty).ok());
  EXPECT_EQ(empty.values.count("config"), 0u);
  EXPECT_EQ(empty.values["x-image"], "x.qcow2");
  NodeOptions bad;
  EXPECT_EQ(ParseBlkdebugFilename("blkdebug:x.qcow2", &bad).message(),
            "blkdebug requires both config file and image path");
}

TEST(BlkdebugOptionsTest, ValidationTextsAreQemus) {
  BlkdebugOptions o;
  o.set_align(3);
  EXPECT_EQ(ValidateOptions(o, 1).message(),
            "Cannot meet constraints with align 3");
  o.set_align(4096);
  o.set_max_transfer(1000);
  EXPECT_EQ(ValidateOptions(o, 1).message(),
            "Cannot meet constraints with max-transfer 1000");
  o.set_max_transfer(8192);
  o.set_opt_write_zero(12288);
  o.set_max_write_zero(16384);
  EXPECT_EQ(ValidateOptions(o, 1).message(),
            "Cannot meet constraints with max-write-zero 16384");
  o.set_max_write_zero(24576);
  EXPECT_TRUE(ValidateOptions(o, 1).ok());
  o.set_opt_discard(100);
  EXPECT_EQ(ValidateOptions(o, 1).message(),
            "Cannot meet constraints with opt-discard 100");
  BlkdebugOptions unaligned;
  unaligned.set_max_transfer(1000);  // align 1: any value
  EXPECT_TRUE(ValidateOptions(unaligned, 1).ok());
}

TEST(BlkdebugNodeTest, SizeIsTheImagesRoundedUpToSectors) {
  auto o = Open({}, {}, 1000);
  EXPECT_EQ(o->node->size(), 1024u);
}

TEST(BlkdebugNodeTest, OnceRuleFailsTheNextRequestAfterItsEventOnly) {
  auto o = Open({Inject(BlkdebugEvent::kWriteAio, ENOSPC, true)});
  EXPECT_TRUE(Write(*o->node, 0, 512, 1).ok());  // not armed yet
  Raise(*o->node, BlkdebugEvent::kWriteAio);
  absl::Status st = Write(*o->node, 0, 512, 2);
  EXPECT_EQ(StatusErrno(st), ENOSPC);
  EXPECT_EQ(o->image->bytes()[0], 1);  // the failed write did not reach it
  EXPECT_TRUE(Write(*o->node, 0, 512, 3).ok());
  Raise(*o->node, BlkdebugEvent::kWriteAio);  // the rule is gone
  EXPECT_TRUE(Write(*o->node, 0, 512, 4).ok());
}

TEST(BlkdebugNodeTest, RuleWithoutOnceFailsEveryRequestTypeUntilReplaced) {
  auto o = Open({Inject(BlkdebugEvent::kL2Load, EIO, false),
                 Inject(BlkdebugEvent::kL1Update, EINVAL, false, 1)});
  Raise(*o->node, BlkdebugEvent::kL2Load);
  std::vector<uint8_t> buf(512);
  EXPECT_EQ(StatusErrno(Read(*o->node, 0, &buf)), EIO);
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 512, 1)), EIO);
  EXPECT_EQ(StatusErrno(*RunInline(o->node->Flush())), EIO);
  EXPECT_EQ(StatusErrno(*RunInline(o->node->Discard(0, 512))), EIO);
  // Block status is not in the default iotypes.
  EXPECT_TRUE(RunInline(o->node->GetBlockStatus(0, 512))->ok());
  // l1_update arms its own rule, which only fails requests over sector 1.
  Raise(*o->node, BlkdebugEvent::kL1Update);
  EXPECT_TRUE(Read(*o->node, 0, &buf).ok());
  EXPECT_EQ(StatusErrno(Read(*o->node, 256, &buf)), EINVAL);
  EXPECT_TRUE(*RunInline(o->node->Flush()) == absl::OkStatus());
}

TEST(BlkdebugNodeTest, IotypeLimitsWhatFails) {
  Rule r = Inject(BlkdebugEvent::kReadAio, EIO, false);
  r.iotype_mask = 1u << static_cast<int>(IoType::kWrite);
  auto o = Open({r});
  Raise(*o->node, BlkdebugEvent::kReadAio);
  std::vector<uint8_t> buf(512);
  EXPECT_TRUE(Read(*o->node, 0, &buf).ok());
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 512, 1)), EIO);
}

TEST(BlkdebugNodeTest, StatesGateRulesAndSetStateMovesThem) {
  Rule inject = Inject(BlkdebugEvent::kWriteAio, EIO, false);
  inject.state = 2;
  Rule set;
  set.action = Rule::Action::kSetState;
  set.event = BlkdebugEvent::kL2Update;
  set.state = 1;
  set.new_state = 2;
  auto o = Open({inject, set});
  EXPECT_EQ(o->node->state(), 1);
  Raise(*o->node, BlkdebugEvent::kWriteAio);  // state 1: not armed
  EXPECT_TRUE(Write(*o->node, 0, 512, 1).ok());
  Raise(*o->node, BlkdebugEvent::kL2Update);
  EXPECT_EQ(o->node->state(), 2);
  Raise(*o->node, BlkdebugEvent::kL2Update);  // state 2: the rule is for 1
  EXPECT_EQ(o->node->state(), 2);
  Raise(*o->node, BlkdebugEvent::kWriteAio);
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 512, 1)), EIO);
}

TEST(BlkdebugNodeTest, EventNoneArmsAtOpen) {
  auto o = Open({Inject(BlkdebugEvent::kNone, EIO, true)});
  std::vector<uint8_t> buf(512);
  EXPECT_EQ(StatusErrno(Read(*o->node, 0, &buf)), EIO);
  EXPECT_TRUE(Read(*o->node, 0, &buf).ok());
}

TEST(BlkdebugNodeTest, TwoRulesOfOneEventFailInConfigOrder) {
  auto o = Open({Inject(BlkdebugEvent::kWriteAio, ENOSPC, true),
                 Inject(BlkdebugEvent::kWriteAio, EIO, true)});
  Raise(*o->node, BlkdebugEvent::kWriteAio);
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 512, 1)), ENOSPC);
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 512, 1)), EIO);
  EXPECT_TRUE(Write(*o->node, 0, 512, 1).ok());
}

TEST(BlkdebugNodeTest, BreakpointSuspendsUntilResumed) {
  auto o = Open({});
  io::BlockNode& top = *o->node;
  ASSERT_TRUE(top.DebugBreakpoint("write_aio", "A").ok());
  bool done = false;
  io::Spawn(
      [](io::BlockNode& n, bool* d) -> io::Task<void> {
        co_await n.DebugEvent(BlkdebugEvent::kWriteAio);
        std::vector<uint8_t> data(512, 7);
        EXPECT_TRUE((co_await n.Write(0, io::ConstIoVec(data.data(), 512))).ok());
        *d = true;
      }(top, &done));
  EXPECT_FALSE(done);
  EXPECT_TRUE(top.DebugIsSuspended("A"));
  EXPECT_FALSE(top.DebugIsSuspended("B"));
  EXPECT_EQ(top.DebugResume("B").message(), "No such file or directory");
  ASSERT_TRUE(top.DebugResume("A").ok());
  EXPECT_TRUE(done);
  EXPECT_FALSE(top.DebugIsSuspended("A"));
  EXPECT_EQ(o->image->bytes()[0], 7);
  EXPECT_EQ(o->messages.str(),
            "blkdebug: Suspended request 'A'\n"
            "blkdebug: Resuming request 'A'\n");
  // One-shot: the event no longer suspends.
  Raise(top, BlkdebugEvent::kWriteAio);
  EXPECT_FALSE(top.DebugIsSuspended("A"));
}

TEST(BlkdebugNodeTest, RemoveBreakpointRemovesAndResumes) {
  auto o = Open({});
  io::BlockNode& top = *o->node;
  EXPECT_EQ(top.DebugRemoveBreakpoint("A").message(),
            "No such file or directory");
  ASSERT_TRUE(top.DebugBreakpoint("l2_update", "A").ok());
  ASSERT_TRUE(top.DebugRemoveBreakpoint("A").ok());
  Raise(top, BlkdebugEvent::kL2Update);  // does not suspend
  EXPECT_FALSE(top.DebugIsSuspended("A"));
  ASSERT_TRUE(top.DebugBreakpoint("l2_update", "A").ok());
  bool done = false;
  io::Spawn(
      [](io::BlockNode& n, bool* d) -> io::Task<void> {
        co_await n.DebugEvent(BlkdebugEvent::kL2Update);
        *d = true;
      }(top, &done));
  EXPECT_TRUE(top.DebugIsSuspended("A"));
  // The request is resumed, but with no breakpoint left to remove QEMU
  // 7.2's blkdebug reports ENOENT (qemu-io: "Could not remove breakpoint").
  EXPECT_EQ(top.DebugRemoveBreakpoint("A").message(),
            "No such file or directory");
  EXPECT_TRUE(done);
  EXPECT_EQ(top.DebugBreakpoint("nonsense", "A").message(),
            "No such file or directory");
}

TEST(BlkdebugNodeTest, AlignReadModifyWritesPartialBlocks) {
  BlkdebugOptions options;
  options.set_align(4096);
  Rule rmw = Inject(BlkdebugEvent::kPwritevRmwTail, EIO, true);
  auto o = Open({rmw}, options);
  std::vector<uint8_t> buf(100);
  ASSERT_TRUE(Read(*o->node, 4000, &buf).ok());
  for (size_t i = 0; i < buf.size(); ++i) EXPECT_EQ(buf[i], (4000 + i) % 251);
  // Inside one block: one read for head and tail, after both events (QEMU's
  // merged padding read), which the rule armed by the tail event fails.
  EXPECT_EQ(StatusErrno(Write(*o->node, 10, 20, 0xaa)), EIO);
  EXPECT_EQ(o->image->bytes()[10], 10);
  ASSERT_TRUE(Write(*o->node, 10, 20, 0xaa).ok());  // the rule was `once`
  EXPECT_EQ(o->image->bytes()[9], 9);
  EXPECT_EQ(o->image->bytes()[10], 0xaa);
  EXPECT_EQ(o->image->bytes()[30], 30);
  // Across a boundary.
  ASSERT_TRUE(Write(*o->node, 4000, 200, 0xbb).ok());
  EXPECT_EQ(o->image->bytes()[3999], 3999 % 251);
  EXPECT_EQ(o->image->bytes()[4199], 0xbb);
  EXPECT_EQ(o->image->bytes()[4200], 4200 % 251);
}

TEST(BlkdebugNodeTest, WriteIntoBlockBeingReadModifyWrittenWaits) {
  BlkdebugOptions options;
  options.set_align(4096);
  auto o = Open({}, options);
  io::BlockNode& top = *o->node;
  ASSERT_TRUE(top.DebugBreakpoint("pwritev_rmw_after_head", "A").ok());
  std::vector<uint8_t> first(20, 0xaa), second(10, 0xbb);
  int done = 0;
  auto count = [&done](absl::Status st) {
    EXPECT_TRUE(st.ok()) << st;
    ++done;
  };
  io::Spawn(top.Write(10, io::ConstIoVec(first.data(), first.size())), count);
  ASSERT_TRUE(top.DebugIsSuspended("A"));  // its block read, not written
  // Same block: waits for the first write to end (block/io.c serialises a
  // read-modify-write), or the first would write back the old bytes.
  io::Spawn(top.Write(30, io::ConstIoVec(second.data(), second.size())),
            count);
  EXPECT_EQ(done, 0);
  EXPECT_EQ(o->image->bytes()[30], 30);
  ASSERT_TRUE(top.DebugResume("A").ok());
  EXPECT_EQ(done, 2);
  EXPECT_EQ(o->image->bytes()[10], 0xaa);
  EXPECT_EQ(o->image->bytes()[30], 0xbb);
  EXPECT_EQ(o->image->bytes()[40], 40);
  EXPECT_EQ(o->messages.str(),
            "blkdebug: Suspended request 'A'\n"
            "blkdebug: Resuming request 'A'\n");
}

TEST(BlkdebugNodeTest, SectorRuleMatchesMaxTransferPiecesSeparately) {
  BlkdebugOptions options;
  options.set_max_transfer(4096);
  auto o = Open({Inject(BlkdebugEvent::kWriteAio, EIO, true, 9)}, options);
  Raise(*o->node, BlkdebugEvent::kWriteAio);
  // The first 4 KiB piece is written, the second (holding sector 9) fails.
  EXPECT_EQ(StatusErrno(Write(*o->node, 0, 8192, 0xcc)), EIO);
  EXPECT_EQ(o->image->bytes()[4095], 0xcc);
  EXPECT_EQ(o->image->bytes()[4096], 4096 % 251);
}

TEST(BlkdebugNodeTest, ZeroWritesBelowOptWriteZeroAreWrites) {
  BlkdebugOptions options;
  options.set_opt_write_zero(4096);
  Rule r = Inject(BlkdebugEvent::kNone, EIO, false);
  r.iotype_mask = 1u << static_cast<int>(IoType::kWriteZeroes);
  auto o = Open({r}, options);
  // 1 KiB inside a block: written as zeroes, not a zero write.
  ASSERT_TRUE(
      RunInline(o->node->WriteZeroes(1024, 1024, io::WriteZeroesFlags{}))->ok());
  EXPECT_EQ(o->image->bytes()[1024], 0);
  EXPECT_EQ(o->image->bytes()[2047], 0);
  EXPECT_EQ(o->image->bytes()[2048], 2048 % 251);
  // A whole block is a zero write, which the rule fails.
  EXPECT_EQ(StatusErrno(*RunInline(
                o->node->WriteZeroes(4096, 4096, io::WriteZeroesFlags{}))),
            EIO);
}

}  // namespace
}  // namespace imgtool::blkdebug
