#include "null_block/null_node.h"

#include <time.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"

namespace imgtool::null_block {
namespace {

std::unique_ptr<io::Engine> MakeEngine(io::EngineKind kind) {
  absl::StatusOr<std::unique_ptr<io::Engine>> e =
      io::CreateEngine(kind, 8, nullptr);
  EXPECT_TRUE(e.ok()) << e.status();
  return *std::move(e);
}

std::unique_ptr<NullNode> Open(const NullOptions& options,
                               io::Engine* engine, bool read_only = false) {
  absl::StatusOr<std::unique_ptr<NullNode>> n =
      NullNode::Open("null-co", options, engine, read_only);
  EXPECT_TRUE(n.ok()) << n.status();
  return *std::move(n);
}

TEST(NullNodeTest, DefaultsToOneGibAndReadsLeaveTheBufferAlone) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  auto node = Open(NullOptions(), engine.get());
  EXPECT_EQ(node->size(), uint64_t{1} << 30);
  EXPECT_EQ(*node->AllocatedSize(), 0u);
  EXPECT_EQ(node->filename(), "null-co://");
  std::vector<uint8_t> buf(4096, 0xab);
  ASSERT_TRUE(io::RunSync(*engine, node->Read(0, io::IoVec(buf))).ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(4096, 0xab));
}

TEST(NullNodeTest, ReadZeroesZeroesTheBuffer) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  NullOptions options;
  options.set_read_zeroes(true);
  options.set_size(1000);
  auto node = Open(options, engine.get());
  EXPECT_EQ(node->size(), 1024u);  // whole sectors, as QEMU
  std::vector<uint8_t> buf(524, 0xab);
  ASSERT_TRUE(io::RunSync(*engine, node->Read(500, io::IoVec(buf))).ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(524, 0));
}

TEST(NullNodeTest, WritesAreDropped) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  NullOptions options;
  options.set_read_zeroes(true);
  auto node = Open(options, engine.get());
  std::vector<uint8_t> data(512, 7);
  EXPECT_TRUE(io::RunSync(*engine, node->Write(0, io::ConstIoVec(data))).ok());
  EXPECT_TRUE(io::RunSync(*engine, node->WriteZeroes(0, 1 << 20, {})).ok());
  EXPECT_TRUE(io::RunSync(*engine, node->Discard(0, 1 << 20)).ok());
  EXPECT_TRUE(io::RunSync(*engine, node->Flush()).ok());
  std::vector<uint8_t> buf(512, 0xab);
  ASSERT_TRUE(io::RunSync(*engine, node->Read(0, io::IoVec(buf))).ok());
  EXPECT_EQ(buf, std::vector<uint8_t>(512, 0));
}

TEST(NullNodeTest, ReadOnlyNodeRefusesWrites) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  auto node = Open(NullOptions(), engine.get(), /*read_only=*/true);
  std::vector<uint8_t> data(512, 7);
  EXPECT_EQ(io::RunSync(*engine, node->Write(0, io::ConstIoVec(data))).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST(NullNodeTest, BlockStatusAsQemuReportsIt) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  NullOptions options;
  options.set_size(1 << 20);
  auto plain = Open(options, engine.get());
  absl::StatusOr<io::BlockStatus> st =
      io::RunSync(*engine, plain->GetBlockStatus(4096, 1 << 30));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->length, (1u << 20) - 4096);
  EXPECT_FALSE(st->data);
  EXPECT_FALSE(st->zero);
  options.set_read_zeroes(true);
  auto zeroes = Open(options, engine.get());
  st = io::RunSync(*engine, zeroes->GetBlockStatus(4096, 8192));
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_EQ(st->length, 8192u);
  EXPECT_FALSE(st->data);
  EXPECT_TRUE(st->zero);
  EXPECT_TRUE(st->offset_valid);
  EXPECT_EQ(st->host_offset, 4096u);
  EXPECT_EQ(st->file, zeroes.get());
}

TEST(NullNodeTest, ResizeIsRefused) {
  auto engine = MakeEngine(io::EngineKind::kAuto);
  auto node = Open(NullOptions(), engine.get());
  absl::Status st =
      io::RunSync(*engine, node->Truncate(2 << 20, io::PreallocMode::kOff));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(st.message(), "Image format driver does not support resize");
}

TEST(NullNodeTest, NegativeLatencyIsInvalid) {
  NullOptions options;
  options.set_latency_ns(-1);
  absl::StatusOr<std::unique_ptr<NullNode>> n =
      NullNode::Open("null-aio", options, nullptr, false);
  ASSERT_FALSE(n.ok());
  EXPECT_EQ(n.status().message(), "latency-ns is invalid");
}

TEST(NullNodeTest, OnlyTheDriversOwnUrlIsAFilename) {
  EXPECT_TRUE(ParseNullFilename("null-co", "null-co://").ok());
  EXPECT_TRUE(ParseNullFilename("null-aio", "null-aio://").ok());
  absl::Status st = ParseNullFilename("null-co", "null-co:x");
  EXPECT_EQ(st.message(),
            "The only allowed filename for this driver is 'null-co://'");
  EXPECT_FALSE(ParseNullFilename("null-aio", "null-co://").ok());
}

int64_t Now() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

// Every engine waits at least latency-ns per request (never less; an upper
// bound would depend on the machine's load).
TEST(NullNodeTest, LatencyDelaysEveryRequestOnEveryEngine) {
  for (io::EngineKind kind : {io::EngineKind::kAuto, io::EngineKind::kThreads,
                              io::EngineKind::kNative}) {
    auto engine = MakeEngine(kind);
    NullOptions options;
    options.set_latency_ns(20'000'000);  // 20 ms
    auto node = Open(options, engine.get());
    std::vector<uint8_t> buf(512);
    const int64_t start = Now();
    ASSERT_TRUE(io::RunSync(*engine, node->Read(0, io::IoVec(buf))).ok());
    ASSERT_TRUE(
        io::RunSync(*engine, node->Write(0, io::ConstIoVec(buf))).ok());
    ASSERT_TRUE(io::RunSync(*engine, node->Flush()).ok());
    EXPECT_GE(Now() - start, 60'000'000) << engine->name();
  }
}

}  // namespace
}  // namespace imgtool::null_block
