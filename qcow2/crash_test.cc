// Crash consistency: every write, zero write, truncate and flush the driver
// sends to its file is recorded; then images are rebuilt as they could be
// on disk after a crash at many points (everything before the last
// completed flush, plus any subset of what came after) and `qemu-img check`
// must find at most leaked clusters, never corruption.
#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::Pattern;
using testing::Shell;
using testing::TempPath;
using testing::WriteFile;

struct Event {
  enum Kind { kWrite, kTruncate, kFlushStart, kFlushEnd } kind;
  uint64_t offset = 0;        // kWrite; new length for kTruncate
  std::vector<uint8_t> data;  // kWrite (zero writes are recorded as zeroes)
  int flush = 0;              // kFlushStart, kFlushEnd: which flush
};

// Forwards to `target` and records what reached it.
class RecordingNode final : public testing::ForwardingNode {
 public:
  RecordingNode(std::unique_ptr<io::BlockNode> target, std::vector<Event>* log)
      : ForwardingNode(std::move(target)), log_(log) {}

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    absl::Status st = co_await ForwardingNode::DoWrite(offset, data);
    if (st.ok()) {
      log_->push_back({Event::kWrite, offset, {data.begin(), data.end()}});
    }
    co_return st;
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    absl::Status st = co_await ForwardingNode::DoWriteZeroes(offset, length, flags);
    if (st.ok()) {
      log_->push_back({Event::kWrite, offset, std::vector<uint8_t>(length, 0)});
    }
    co_return st;
  }
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override {
    // A hole reads as zeroes, but may also not have happened yet.
    absl::Status st = co_await ForwardingNode::DoDiscard(offset, length);
    if (st.ok()) {
      log_->push_back({Event::kWrite, offset, std::vector<uint8_t>(length, 0)});
    }
    co_return st;
  }
  io::Task<absl::Status> DoFlush() override {
    // Flushes may overlap (qcow2's shared flush beside one under its lock).
    const int id = ++flushes_;
    log_->push_back({.kind = Event::kFlushStart, .flush = id});
    absl::Status st = co_await ForwardingNode::DoFlush();
    if (st.ok()) log_->push_back({.kind = Event::kFlushEnd, .flush = id});
    co_return st;
  }
  io::Task<absl::Status> DoTruncate(uint64_t size, io::PreallocMode mode) override {
    absl::Status st = co_await ForwardingNode::DoTruncate(size, mode);
    if (st.ok()) log_->push_back({Event::kTruncate, size});
    co_return st;
  }

 private:
  std::vector<Event>* log_;
  int flushes_ = 0;
};

void Apply(const Event& e, std::vector<uint8_t>& image) {
  if (e.kind == Event::kTruncate) {
    image.resize(e.offset, 0);
  } else if (e.kind == Event::kWrite) {
    if (image.size() < e.offset + e.data.size()) image.resize(e.offset + e.data.size(), 0);
    std::copy(e.data.begin(), e.data.end(), image.begin() + e.offset);
  }
}

// Starts every operation of `ops` at once and runs `env` until all are done;
// all must succeed.
void RunAtOnce(Env& env, std::vector<io::Task<absl::Status>> ops) {
  size_t done = 0;
  const size_t n = ops.size();
  for (io::Task<absl::Status>& op : ops) {
    io::Spawn(std::move(op), [&done](absl::Status st) {
      EXPECT_TRUE(st.ok()) << st;
      ++done;
    });
  }
  while (done < n) ASSERT_TRUE(env.engine().Poll(true).ok());
}

// `concurrent`: rounds of 8 operations started at once over a larger disk,
// so that writes allocate L2 tables together (Qcow2Node::AllocateL2Grouped)
// and flushes overlap; else one operation at a time.
void RunCrashTest(bool extended_l2, bool concurrent = false) {
  Env env;
  const std::string path = TempPath(
      absl::StrCat(extended_l2 ? "crash_ext" : "crash", concurrent ? "_conc" : "",
                   ".qcow2"));
  // One L2 table covers 2 MiB of 4 KiB clusters, 64 MiB of extended ones.
  const uint64_t disk = !concurrent ? 2 << 20 : extended_l2 ? 1ull << 30 : 128 << 20;
  std::vector<Event> log;
  // A clean image to start from, not recorded.
  {
    auto file = env.CreateEmpty(path);
    ASSERT_TRUE(file.ok());
    Qcow2CreateOptions o;
    o.set_size(disk);
    // Extended L2: 32 KiB clusters of 1 KiB subclusters.
    o.set_cluster_size(extended_l2 ? 32768 : 4096);
    o.set_extended_l2(extended_l2);
    ASSERT_TRUE(env.Run(CreateQcow2(**file, o)).ok());
    ASSERT_TRUE(env.Run((*file)->Close()).ok());
  }
  const std::vector<uint8_t> initial = testing::ReadFile(path);
  {
    auto file = env.OpenFile(path, false);
    ASSERT_TRUE(file.ok());
    auto node = env.Run(Qcow2Node::Open(
        std::make_unique<RecordingNode>(*std::move(file), &log), Qcow2OpenOptions(),
        nullptr));
    ASSERT_TRUE(node.ok()) << node.status();
    std::mt19937_64 rng(42);
    if (concurrent) {
      std::vector<std::vector<uint8_t>> buffers;
      buffers.reserve(30 * 8);
      for (int round = 0; round < 30; ++round) {
        std::vector<io::Task<absl::Status>> ops;
        for (int j = 0; j < 8; ++j) {
          const uint64_t length = 1 + rng() % 20000;
          const uint64_t offset = rng() % (disk - 2 * length);
          const uint64_t kind = rng() % 10;
          if (kind == 0) {
            ops.push_back((*node)->WriteZeroes(offset, length, {.may_unmap = true}));
          } else if (kind == 1) {
            ops.push_back((*node)->Flush());
          } else {
            buffers.push_back(Pattern(length, round * 8 + j));
            ops.push_back((*node)->Write(offset, io::ConstIoVec(buffers.back())));
          }
        }
        RunAtOnce(env, std::move(ops));
      }
    }
    for (int i = 0; i < (concurrent ? 0 : 120); ++i) {
      const uint64_t length = 1 + rng() % 20000;
      const uint64_t offset = rng() % ((2 << 20) - 4 * length);
      absl::Status st;
      switch (rng() % 8) {
        case 0:
          st = env.Run((*node)->WriteZeroes(offset, length, {.may_unmap = true}));
          break;
        case 1:
          st = env.Run((*node)->Discard(offset, length * 4));
          break;
        case 2:
          st = env.Run((*node)->Flush());
          break;
        case 3:
          if (i == 60) st = env.Run((*node)->Truncate(3 << 20, io::PreallocMode::kOff));
          break;
        default: {
          std::vector<uint8_t> data = Pattern(length, i);
          st = env.Run((*node)->Write(offset, io::ConstIoVec(data)));
        }
      }
      ASSERT_TRUE(st.ok()) << st;
    }
    ASSERT_TRUE(env.Run((*node)->Close()).ok());
  }
  ASSERT_GT(log.size(), 100u);

  std::mt19937_64 rng(7);
  int checked = 0;
  for (size_t crash = 1; crash <= log.size(); crash += 1 + log.size() / 150) {
    // What is surely on disk: everything before the start of the latest
    // started flush that completed before the crash.
    size_t durable = 0;
    std::map<int, size_t> started;
    for (size_t i = 0; i < crash; ++i) {
      if (log[i].kind == Event::kFlushStart) started[log[i].flush] = i;
      if (log[i].kind == Event::kFlushEnd) {
        durable = std::max(durable, started[log[i].flush]);
      }
    }
    for (int variant = 0; variant < 4; ++variant) {
      std::vector<uint8_t> image = initial;
      for (size_t i = 0; i < durable; ++i) Apply(log[i], image);
      for (size_t i = durable; i < crash; ++i) {
        const bool keep = variant == 0 ? false : variant == 1 ? true : (rng() & 1);
        if (keep || log[i].kind == Event::kTruncate) Apply(log[i], image);
      }
      const std::string crashed = TempPath("crashed.qcow2");
      WriteFile(crashed, image);
      testing::ShellResult r = Shell("qemu-img check " + crashed);
      EXPECT_TRUE(r.exit_code == 0 || r.exit_code == 3)
          << "crash after event " << crash << " variant " << variant << ":\n"
          << r.output;
      ++checked;
    }
  }
  EXPECT_GE(checked, 400);
}

TEST(CrashTest, EveryCrashPointLeavesAConsistentImage) { RunCrashTest(false); }

TEST(CrashTest, EveryCrashPointLeavesAConsistentExtendedL2Image) {
  RunCrashTest(true);
}

TEST(CrashTest, EveryCrashPointOfConcurrentWritesLeavesAConsistentImage) {
  RunCrashTest(false, /*concurrent=*/true);
}

TEST(CrashTest, EveryCrashPointOfConcurrentWritesLeavesAConsistentExtendedL2Image) {
  RunCrashTest(true, /*concurrent=*/true);
}

}  // namespace
}  // namespace imgtool::qcow2
