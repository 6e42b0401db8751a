// The fault matrix of issue 17 ("Fault tolerance, measured"): an I/O error
// injected through a blkdebug node under the qcow2 driver at every debug
// event (io::BlkdebugEvent), with errno EIO and ENOSPC, once and always
// (blkdebug's `once`), during each operation below, on a standard image
// (512-byte clusters, so that L2 tables, refcount blocks and the L1 table
// are allocated by small requests) and on an extended-L2 image (16 KiB
// clusters of 32 subclusters):
//   write      an unaligned 96 KiB write into unallocated clusters
//   zero       zero writes over data and over unallocated clusters, with
//              and without may_unmap
//   discard    a discard of allocated clusters
//   cow        a partial-cluster write over a backing file
//   compressed compressed writes of two clusters
//   grow       a resize to 64 MiB (a larger L1 table) and a write past the
//              old end
//   shrink     a resize to 16 KiB, freeing clusters
//   vmstate    a 64 KiB write to the VM state area and a read of it back
//   check      `check -r all` of an image with a leaked cluster
// For each case:
//   * every request that fails, fails with the injected errno (an error of
//     the file, not a corruption); in `once` mode a later write and read of
//     other clusters succeed (the image is not marked corrupt for an I/O
//     error);
//   * after close, the image opens without blkdebug, the corrupt bit is
//     clear, our check finds no corruption and no check error (leaks are
//     allowed), and `qemu-img check` (the oracle) agrees for every case in
//     which an error was injected;
//   * every byte written by a request that succeeded (and every byte
//     written before the operation) reads back.
// A case whose event the operation never raises fails nothing; the test
// prints how many cases ran, how many had an error injected and how many
// survived (all must).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <iostream>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "blkdebug/blkdebug.h"
#include "blkdebug/blkdebug_options.pb.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/bytes.h"
#include "qcow2/check.h"
#include "qcow2/format/header.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using blkdebug::BlkdebugNode;
using blkdebug::Rule;
using io::BlkdebugEvent;
using testing::Env;
using testing::Pattern;
using testing::Shell;
using testing::TempPath;

constexpr uint64_t kSize = 4 << 20;

enum class Op {
  kWrite, kZero, kDiscard, kCow, kCompressed, kGrow, kShrink, kVmState, kCheck
};
constexpr Op kOps[] = {Op::kWrite,  Op::kZero,   Op::kDiscard,
                       Op::kCow,    Op::kCompressed, Op::kGrow,
                       Op::kShrink, Op::kVmState, Op::kCheck};

const char* OpName(Op op) {
  switch (op) {
    case Op::kWrite: return "write";
    case Op::kZero: return "zero";
    case Op::kDiscard: return "discard";
    case Op::kCow: return "cow";
    case Op::kCompressed: return "compressed";
    case Op::kGrow: return "grow";
    case Op::kShrink: return "shrink";
    case Op::kVmState: return "vmstate";
    case Op::kCheck: return "check";
  }
  return "?";
}

struct Kind {
  const char* name;
  uint64_t cluster_size;
  bool extended_l2;
};
constexpr Kind kKinds[] = {{"standard", 512, false},
                           {"extended-l2", 16384, true}};

// What the guest must read: `bytes` where `known`; a range a failed request
// covered may hold the old or the new bytes. A write is acknowledged (must
// read back after a reopen) once a flush after it succeeded: until then a
// failed flush (of the metadata caches, at close too) may lose it, in QEMU
// as here, so the ranges written since the last flush are `pending`.
struct Model {
  std::vector<uint8_t> bytes;
  std::vector<bool> known;
  std::vector<std::pair<uint64_t, uint64_t>> pending;  // offset, length

  void Resize(uint64_t size) {
    bytes.resize(size, 0);
    known.resize(size, true);
  }
  void Set(uint64_t offset, const std::vector<uint8_t>& data) {
    std::copy(data.begin(), data.end(), bytes.begin() + offset);
    std::fill(known.begin() + offset, known.begin() + offset + data.size(),
              true);
    pending.emplace_back(offset, data.size());
  }
  void Zero(uint64_t offset, uint64_t length) {
    std::fill(bytes.begin() + offset, bytes.begin() + offset + length, 0);
    std::fill(known.begin() + offset, known.begin() + offset + length, true);
    pending.emplace_back(offset, length);
  }
  // After a flush: `ok` commits the pending writes, a failure forgets them.
  void Flushed(bool ok) {
    if (!ok) {
      for (const auto& [offset, length] : pending) {
        if (offset < known.size()) Forget(offset, length);
      }
    }
    pending.clear();
  }
  void Forget(uint64_t offset, uint64_t length) {
    length = std::min<uint64_t>(length, known.size() - offset);
    std::fill(known.begin() + offset, known.begin() + offset + length, false);
  }
};

struct Totals {
  int cases = 0;
  int injected = 0;  // cases in which some request failed
  int survived = 0;  // cases that passed every check
};

// The event that moves the blkdebug node to state 2, where the injecting
// rule acts (so that opening the image raises nothing that fails): one the
// qcow2 driver never raises in these operations.
BlkdebugEvent Trigger(BlkdebugEvent event) {
  return event == BlkdebugEvent::kCorWrite ? BlkdebugEvent::kVmstateLoad
                                           : BlkdebugEvent::kCorWrite;
}

io::Task<absl::Status> Raise(io::BlockNode& node, BlkdebugEvent event) {
  co_await node.DebugEvent(event);
  co_return absl::OkStatus();
}

bool CorruptBitSet(const std::string& path) {
  const std::vector<uint8_t> bytes = testing::ReadFile(path);
  auto header = format::DecodeHeader(bytes, bytes.size());
  return header.ok() && header->corrupt();
}

// Failures recorded in the running test so far.
int FailedParts() {
  const ::testing::TestResult* result =
      ::testing::UnitTest::GetInstance()->current_test_info()->result();
  int failed = 0;
  for (int i = 0; i < result->total_part_count(); ++i) {
    if (result->GetTestPartResult(i).failed()) ++failed;
  }
  return failed;
}

// A directory on tmpfs if there is one (the cases flush their files some
// ten thousand times; the filesystem is not what they test), else the
// test's temporary directory.
std::string Dir() {
  static const std::string dir = [] {
    char shm[] = "/dev/shm/fault_matrix.XXXXXX";
    if (access("/dev/shm", W_OK) == 0 && mkdtemp(shm) != nullptr) {
      return std::string(shm);
    }
    return TempPath("");
  }();
  return dir;
}

// "KIND OP EVENT", e.g. "standard write l2_update".
std::string CaseName(const Kind& kind, Op op, BlkdebugEvent event) {
  return absl::StrCat(kind.name, " ", OpName(op), " ",
                      BlkdebugEventName(event));
}

// CaseName, the errno and the mode: one case.
std::string CaseLabel(const Kind& kind, Op op, BlkdebugEvent event, int error,
                      bool once) {
  return absl::StrCat(CaseName(kind, op, event), " errno ", error,
                      once ? " once" : " always");
}

// FAULT_MATRIX_ONLY="KIND OP EVENT" (a CaseName) runs only the cases of that
// image kind, operation and event, to debug one.
bool Selected(const Kind& kind, Op op, BlkdebugEvent event) {
  const char* only = getenv("FAULT_MATRIX_ONLY");
  return only == nullptr || CaseName(kind, op, event) == only;
}

// Records the debug events raised on it (after Arm()) instead of acting on
// them: which events an operation raises.
class RecordingNode final : public testing::ForwardingNode {
 public:
  RecordingNode(std::unique_ptr<io::BlockNode> file,
                std::set<BlkdebugEvent>* raised)
      : ForwardingNode(std::move(file)), raised_(raised) {}
  void Arm() { armed_ = true; }

 protected:
  bool HandlesDebugEvents() const override { return true; }
  io::Task<void> DoDebugEvent(BlkdebugEvent event) override {
    if (armed_) raised_->insert(event);
    co_return;
  }

 private:
  std::set<BlkdebugEvent>* raised_;
  bool armed_ = false;
};

class FaultMatrix {
 public:
  FaultMatrix() = default;
  ~FaultMatrix() {
    Shell("rm -f " + Dir() + "/matrix*.qcow2");
    if (Dir().rfind("/dev/shm/fault_matrix.", 0) == 0) rmdir(Dir().c_str());
  }

  // Runs one case; gtest failures say what went wrong. With `probe`, no
  // error is injected: the events the operation raises are put in it.
  void RunCase(const Kind& kind, Op op, BlkdebugEvent event, int error,
               bool once, bool* injected,
               std::set<BlkdebugEvent>* probe = nullptr);

  Env& env() { return env_; }

 private:
  // Creates the image (and its backing file for kCow) and writes the data
  // the operation works on, without blkdebug; fills `model_`.
  void Prepare(const Kind& kind, Op op);
  // The operation's requests through `node`; each failure is checked and
  // recorded.
  void Operate(const Kind& kind, Op op, Qcow2Node& node, int error);
  // A request's result: OK, or a failure with `error`.
  bool Result(const absl::Status& st, int error, const char* what);

  Env env_;
  Model model_;
  std::string path_ = Dir() + "/matrix.qcow2";
  std::string base_ = Dir() + "/matrix_base.qcow2";
  int failures_ = 0;
};

bool FaultMatrix::Result(const absl::Status& st, int error, const char* what) {
  if (st.ok()) return true;
  ++failures_;
  if (StatusErrno(st) != error) {
    ADD_FAILURE() << what << " failed with " << st << ", not with errno "
                  << error;
  }
  return false;
}

void FaultMatrix::Prepare(const Kind& kind, Op op) {
  unlink(path_.c_str());
  unlink(base_.c_str());
  Qcow2CreateOptions create;
  create.set_size(kSize);
  create.set_cluster_size(kind.cluster_size);
  create.set_extended_l2(kind.extended_l2);
  model_ = Model();
  model_.Resize(kSize);
  if (op == Op::kCow) {
    Qcow2CreateOptions base = create;
    ASSERT_TRUE(env_.CreateImage(base_, base).ok());
    auto node = env_.OpenQcow2(base_, false);
    ASSERT_TRUE(node.ok()) << node.status();
    const std::vector<uint8_t> data = Pattern(kSize, 7);
    ASSERT_TRUE(env_.Run((*node)->Write(0, io::ConstIoVec(data))).ok());
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    model_.Set(0, data);
    create.set_backing_file(base_);
    create.set_backing_fmt("qcow2");
  }
  ASSERT_TRUE(env_.CreateImage(path_, create).ok());
  auto node = env_.OpenQcow2(path_, false);
  ASSERT_TRUE(node.ok()) << node.status();
  // Data in the first 64 KiB and at 2 MiB + 64 KiB (the zero writes,
  // discards and shrinks work on it).
  for (uint64_t offset : {uint64_t{0}, uint64_t{(2 << 20) + (64 << 10)}}) {
    const std::vector<uint8_t> data = Pattern(64 << 10, offset + 1);
    ASSERT_TRUE(env_.Run((*node)->Write(offset, io::ConstIoVec(data))).ok());
    model_.Set(offset, data);
  }
  ASSERT_TRUE(env_.Run((*node)->Close()).ok());
  model_.Flushed(true);
  if (op == Op::kCheck) {
    // A leaked cluster: refcount 1 for the cluster after the file's end,
    // in the refcount block that covers it.
    const std::vector<uint8_t> bytes = testing::ReadFile(path_);
    auto header = format::DecodeHeader(bytes, bytes.size());
    ASSERT_TRUE(header.ok()) << header.status();
    const uint64_t cluster = (bytes.size() + kind.cluster_size - 1) /
                             kind.cluster_size;
    const uint64_t per_block = kind.cluster_size / 2;  // 16-bit refcounts
    const uint64_t refblock =
        LoadBE64(&bytes[header->refcount_table_offset +
                        8 * (cluster / per_block)]) &
        ~uint64_t{511};
    ASSERT_NE(refblock, 0u) << "no refcount block covers cluster " << cluster;
    testing::PatchHex(path_, refblock + 2 * (cluster % per_block), "0001");
    ASSERT_EQ(truncate(path_.c_str(), (cluster + 1) * kind.cluster_size), 0);
  }
}

void FaultMatrix::Operate(const Kind& kind, Op op, Qcow2Node& node,
                          int error) {
  const uint64_t cs = kind.cluster_size;
  auto write = [&](uint64_t offset, uint64_t length, uint64_t seed) {
    const std::vector<uint8_t> data = Pattern(length, seed);
    if (Result(env_.Run(node.Write(offset, io::ConstIoVec(data))), error,
               "write")) {
      model_.Set(offset, data);
    } else {
      model_.Forget(offset, length);
    }
  };
  auto zero = [&](uint64_t offset, uint64_t length, bool unmap) {
    io::WriteZeroesFlags flags;
    flags.may_unmap = unmap;
    if (Result(env_.Run(node.WriteZeroes(offset, length, flags)), error,
               "zero write")) {
      model_.Zero(offset, length);
    } else {
      model_.Forget(offset, length);
    }
  };
  switch (op) {
    case Op::kWrite:
      write((1 << 20) + 1000, 96 << 10, 11);
      break;
    case Op::kZero:
      zero(4096 + 512, 32 << 10, false);
      zero(40 << 10, 64 << 10, true);
      zero(3 << 20, 2 * cs, false);
      break;
    case Op::kDiscard: {
      const uint64_t offset = 16 << 10, length = 32 << 10;
      if (Result(env_.Run(node.Discard(offset, length)), error, "discard")) {
        model_.Zero(offset, length);
      } else {
        model_.Forget(offset, length);
      }
      break;
    }
    case Op::kCow:
      write((1 << 20) + 700, 3000, 13);
      write((1 << 20) + 3 * cs + 100, cs, 17);
      break;
    case Op::kCompressed: {
      for (uint64_t offset : {uint64_t{3 << 20}, uint64_t{(3 << 20) + cs}}) {
        std::vector<uint8_t> data(cs, 0);
        for (uint64_t i = 0; i < cs; i += 64) data[i] = i / 64 + offset;
        if (Result(env_.Run(node.WriteCompressed(offset,
                                                 io::ConstIoVec(data))),
                   error, "compressed write")) {
          model_.Set(offset, data);
        } else {
          model_.Forget(offset, cs);
        }
      }
      break;
    }
    case Op::kGrow: {
      const uint64_t size = 64 << 20;
      if (Result(env_.Run(node.Truncate(size, io::PreallocMode::kOff)), error,
                 "grow")) {
        model_.Resize(size);
        write(48 << 20, 4096, 19);
      }
      break;
    }
    case Op::kShrink: {
      const uint64_t size = 16 << 10;
      if (Result(env_.Run(node.Truncate(size, io::PreallocMode::kOff)), error,
                 "shrink")) {
        model_.Resize(size);
      } else {
        // The clusters past the new end may be gone.
        model_.Forget(size, kSize - size);
      }
      break;
    }
    case Op::kVmState: {
      // Not guest data: what a successful write put there reads back.
      const std::vector<uint8_t> data = Pattern(64 << 10, 29);
      if (Result(env_.Run(node.WriteVmState(0, io::ConstIoVec(data))), error,
                 "vmstate write")) {
        std::vector<uint8_t> back(data.size());
        if (Result(env_.Run(node.ReadVmState(0, io::IoVec(back))), error,
                   "vmstate read")) {
          EXPECT_TRUE(back == data) << "the VM state does not read back";
        }
      }
      break;
    }
    case Op::kCheck:
      return;  // on the file, by RunCase
  }
  model_.Flushed(Result(env_.Run(node.Flush()), error, "flush"));
}

void FaultMatrix::RunCase(const Kind& kind, Op op, BlkdebugEvent event,
                          int error, bool once, bool* injected,
                          std::set<BlkdebugEvent>* probe) {
  SCOPED_TRACE(CaseLabel(kind, op, event, error, once));
  failures_ = 0;
  const int failed_before = FailedParts();
  Prepare(kind, op);
  if (FailedParts() != failed_before) return;

  auto file = env_.OpenFile(path_, false);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return;
  // The node under the qcow2 driver: a blkdebug node whose rule acts from
  // the trigger event on, or (probing) a node recording the events raised
  // from Arm() on.
  std::unique_ptr<io::BlockNode> below;
  std::ostringstream messages;
  if (probe != nullptr) {
    below = std::make_unique<RecordingNode>(std::move(*file), probe);
  } else {
    std::vector<Rule> rules(2);
    rules[0].action = Rule::Action::kSetState;
    rules[0].event = Trigger(event);
    rules[0].state = 1;
    rules[0].new_state = 2;
    rules[1].action = Rule::Action::kInjectError;
    rules[1].event = event;
    rules[1].state = 2;
    rules[1].iotype_mask = 0x1f;  // read, write, write-zeroes, discard, flush
    rules[1].error = error;
    rules[1].once = once;
    auto debug = env_.Run(blkdebug::OpenBlkdebug(
        std::move(*file), blkdebug::BlkdebugOptions(), std::move(rules)));
    EXPECT_TRUE(debug.ok()) << debug.status();
    if (!debug.ok()) return;
    (*debug)->set_message_stream(&messages);
    below = std::move(*debug);
  }
  io::BlockNode* const below_node = below.get();
  auto arm = [&] {
    if (probe != nullptr) {
      static_cast<RecordingNode*>(below_node)->Arm();
    } else {
      (void)env_.Run(Raise(*below_node, Trigger(event)));
    }
  };

  if (op == Op::kCheck) {
    arm();
    std::ostringstream check_messages;
    auto repaired =
        env_.Run(CheckQcow2(*below, RepairMode::kAll, check_messages));
    if (!repaired.ok()) {
      ++failures_;
      // "Check failed: <strerror>": the errno is kept in the status.
      EXPECT_EQ(StatusErrno(repaired.status()), error)
          << "check -r all: " << repaired.status();
    } else if (repaired->check_errors != 0) {
      ++failures_;
    }
    (void)env_.Run(below->Close());
  } else {
    auto node_or = env_.Run(
        Qcow2Node::Open(std::move(below), Qcow2OpenOptions(), env_.Opener()));
    EXPECT_TRUE(node_or.ok()) << node_or.status();
    if (!node_or.ok()) return;
    std::unique_ptr<Qcow2Node> node = std::move(*node_or);
    arm();
    Operate(kind, op, *node, error);
    if (once && failures_ > 0 && op != Op::kShrink) {
      // The rule is gone: the image takes writes and reads elsewhere.
      const uint64_t offset = 3 * (1 << 20) + (512 << 10);
      const std::vector<uint8_t> data = Pattern(8192, 23);
      const absl::Status st = env_.Run(node->Write(offset, io::ConstIoVec(data)));
      EXPECT_TRUE(st.ok()) << "a write after the fault: " << st;
      if (st.ok()) model_.Set(offset, data);
      std::vector<uint8_t> back(data.size());
      const absl::Status rd = env_.Run(node->Read(offset, io::IoVec(back)));
      EXPECT_TRUE(rd.ok()) << "a read after the fault: " << rd;
      EXPECT_TRUE(back == data) << "a write after the fault does not read back";
      const absl::Status fl = env_.Run(node->Flush());
      EXPECT_TRUE(fl.ok()) << "a flush after the fault: " << fl;
      model_.Flushed(fl.ok());
    }
    // Close may fail (a cache flush hits the fault); it must not crash.
    const absl::Status closed = env_.Run(node->Close());
    if (!closed.ok()) {
      ++failures_;
      EXPECT_EQ(StatusErrno(closed), error) << "close: " << closed;
    }
    model_.Flushed(closed.ok());
  }
  *injected = failures_ > 0;

  // Without blkdebug: not corrupt, consistent, the acknowledged bytes.
  EXPECT_FALSE(CorruptBitSet(path_)) << "the image is marked corrupt";
  {
    auto file2 = env_.OpenFile(path_, true);
    EXPECT_TRUE(file2.ok()) << file2.status();
    if (file2.ok()) {
      std::ostringstream check_messages;
      auto result =
          env_.Run(CheckQcow2(**file2, RepairMode::kNone, check_messages));
      EXPECT_TRUE(result.ok()) << result.status();
      if (result.ok()) {
        EXPECT_EQ(result->corruptions, 0u) << check_messages.str();
        EXPECT_EQ(result->check_errors, 0u) << check_messages.str();
      }
      (void)env_.Run((*file2)->Close());
    }
  }
  if (*injected) {
    const testing::ShellResult oracle =
        Shell("qemu-img check -q -f qcow2 " + path_);
    // 0: clean, 3: leaks only.
    EXPECT_TRUE(oracle.exit_code == 0 || oracle.exit_code == 3)
        << "qemu-img check: exit " << oracle.exit_code << "\n"
        << oracle.output;
  }
  auto image = env_.OpenQcow2(path_, true);
  EXPECT_TRUE(image.ok()) << image.status();
  if (image.ok()) {
    const uint64_t size = (*image)->size();
    EXPECT_TRUE(size == model_.bytes.size() ||
                (op == Op::kGrow && size == kSize) ||
                (op == Op::kShrink && size == kSize && failures_ > 0))
        << "size " << size;
    const uint64_t n = std::min<uint64_t>(size, model_.bytes.size());
    std::vector<uint8_t> got(n);
    const absl::Status rd = env_.Run((*image)->Read(0, io::IoVec(got)));
    EXPECT_TRUE(rd.ok()) << rd;
    uint64_t bad = 0, first_bad = 0;
    for (uint64_t i = 0; rd.ok() && i < n; ++i) {
      if (model_.known[i] && got[i] != model_.bytes[i]) {
        if (bad++ == 0) first_bad = i;
      }
    }
    EXPECT_EQ(bad, 0u) << "acknowledged bytes lost, the first at " << first_bad;
    (void)env_.Run((*image)->Close());
  }
}

TEST(FaultMatrixTest, EveryEventErrnoModeOperation) {
  FaultMatrix matrix;
  Totals totals;
  std::vector<std::string> lost;
  for (const Kind& kind : kKinds) {
    for (Op op : kOps) {
      // The events this operation raises on the image's file, in a run
      // without errors (which must pass every check too).
      std::set<BlkdebugEvent> raised;
      bool unused = false;
      matrix.RunCase(kind, op, BlkdebugEvent::kNone, 0, true, &unused,
                     &raised);
      std::string names;
      int op_cases = 0, op_injected = 0;
      for (BlkdebugEvent event : raised) {
        absl::StrAppend(&names, " ", BlkdebugEventName(event));
        if (!Selected(kind, op, event)) continue;
        for (int error : {EIO, ENOSPC}) {
          for (bool once : {true, false}) {
            const int failed_before = FailedParts();
            bool injected = false;
            matrix.RunCase(kind, op, event, error, once, &injected);
            ++totals.cases;
            ++op_cases;
            if (injected) {
              ++totals.injected;
              ++op_injected;
            }
            if (FailedParts() == failed_before) {
              ++totals.survived;
            } else {
              lost.push_back(CaseLabel(kind, op, event, error, once));
            }
            if (lost.size() > 20) {
              GTEST_FAIL() << "stopping after 20 failing cases";
            }
          }
        }
      }
      std::cout << kind.name << " " << OpName(op) << ": " << op_cases
                << " cases, " << op_injected
                << " with an injected error; events raised:" << names
                << "\n";
      EXPECT_GT(op_injected, 0) << kind.name << " " << OpName(op);
    }
  }
  std::cout << "fault matrix: " << totals.cases
            << " cases (event raised, errno, mode, operation, image kind), "
            << totals.injected << " with an injected error, "
            << totals.survived << " survived\n";
  for (const std::string& name : lost) std::cout << "failed: " << name << "\n";
  EXPECT_EQ(totals.survived, totals.cases);
}

}  // namespace
}  // namespace imgtool::qcow2
