// Crash safety of snapshot create, apply and delete (qcow2_snapshot.cc):
// each operation runs once to count the requests that change the file
// (writes, write zeroes, discards, truncates), then again on a fresh copy
// for every k below that count with the file refusing every change after
// the first k (the file then holds what a crash after k requests leaves,
// requests reaching the disk in order), and for each k once more with the
// k-th change on disk but the earlier changes since the last flush not
// (requests reordered between flushes: catches a flush missing between two
// changes that must be durable in order). Every such image must be:
//  * consistent for qemu-img check: leaks allowed; COPIED flags that do
//    not match the refcounts only while the dirty bit says so (version 3
//    images carry it for the duration of the operation);
//  * listing either the old or the new snapshot table (qemu-img snapshot -l);
//  * clean after `qemu-img check -r all`, reading as before the operation
//    or as after it (the active state; qemu-img convert).
// Images are made with qemu-img and qemu-io: data, compressed and zero
// clusters, two snapshots sharing some of them; standard and extended L2
// entries, 4 KiB clusters (several L2 tables). Version 2 images have no
// dirty bit: their COPIED flags can disagree after a crash, as with QEMU.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::ReadAll;
using testing::Shell;
using testing::TempPath;

// Refuses every change after the first `budget` (EIO), as if the machine
// stopped there; reads go on. Keeps a journal of the changes it let through
// and, for each, where its flush epoch began: the number of changes that a
// flush had made durable when it was asked for (a flush covers the changes
// issued before it started).
class CrashNode final : public testing::ForwardingNode {
 public:
  struct Change {
    enum Kind { kWrite, kZeroes, kDiscard, kTruncate } kind;
    uint64_t offset = 0;  // bytes; the new size for kTruncate
    uint64_t length = 0;  // bytes
    std::vector<uint8_t> data;  // kWrite
    uint64_t epoch_start = 0;
  };

  CrashNode(std::unique_ptr<io::BlockNode> target, uint64_t budget)
      : ForwardingNode(std::move(target)), budget_(budget) {}
  uint64_t changes() const { return changes_; }
  const std::vector<Change>& journal() const { return journal_; }

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    if (!Allow()) co_return absl::DataLossError("crashed");
    Record(Change::kWrite, offset, data.size())
        .data.assign(data.data(), data.data() + data.size());
    co_return co_await ForwardingNode::DoWrite(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    if (!Allow()) co_return absl::DataLossError("crashed");
    Record(Change::kZeroes, offset, length);
    co_return co_await ForwardingNode::DoWriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override {
    if (!Allow()) co_return absl::DataLossError("crashed");
    Record(Change::kDiscard, offset, length);
    co_return co_await ForwardingNode::DoDiscard(offset, length);
  }
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override {
    if (!Allow()) co_return absl::DataLossError("crashed");
    Record(Change::kTruncate, size, 0);
    co_return co_await ForwardingNode::DoTruncate(size, prealloc);
  }
  io::Task<absl::Status> DoFlush() override {
    if (changes_ > budget_) co_return absl::DataLossError("crashed");
    const uint64_t covered = changes_;
    absl::Status st = co_await ForwardingNode::DoFlush();
    if (st.ok()) flushed_ = std::max(flushed_, covered);
    co_return st;
  }

 private:
  bool Allow() { return ++changes_ <= budget_; }
  Change& Record(Change::Kind kind, uint64_t offset, uint64_t length) {
    journal_.push_back(Change{kind, offset, length, {}, flushed_});
    return journal_.back();
  }
  const uint64_t budget_;
  uint64_t changes_ = 0;
  uint64_t flushed_ = 0;  // changes a successful flush covered
  std::vector<Change> journal_;
};

// Applies `journal` but its changes [skip_begin, skip_end) to the file at
// `path` (a copy of the image before the operation): what the disk may
// hold when unflushed changes reached it out of order.
void Replay(const std::string& path,
            const std::vector<CrashNode::Change>& journal, size_t skip_begin,
            size_t skip_end) {
  const int fd = open(path.c_str(), O_RDWR);
  ASSERT_GE(fd, 0) << path;
  for (size_t i = 0; i < journal.size(); ++i) {
    if (i >= skip_begin && i < skip_end) continue;
    const CrashNode::Change& c = journal[i];
    switch (c.kind) {
      case CrashNode::Change::kWrite:
        ASSERT_EQ(pwrite(fd, c.data.data(), c.data.size(), c.offset),
                  static_cast<ssize_t>(c.data.size()));
        break;
      case CrashNode::Change::kZeroes:
      case CrashNode::Change::kDiscard: {
        // Both read as zeroes afterwards (a discard of the file punches).
        const std::vector<uint8_t> zeroes(c.length, 0);
        struct stat st;
        ASSERT_EQ(fstat(fd, &st), 0);
        const uint64_t end = c.kind == CrashNode::Change::kDiscard
                                 ? std::min<uint64_t>(c.offset + c.length,
                                                      st.st_size)
                                 : c.offset + c.length;
        if (end > c.offset) {
          ASSERT_EQ(pwrite(fd, zeroes.data(), end - c.offset, c.offset),
                    static_cast<ssize_t>(end - c.offset));
        }
        break;
      }
      case CrashNode::Change::kTruncate:
        ASSERT_EQ(ftruncate(fd, c.offset), 0);
        break;
    }
  }
  close(fd);
}

// kDelete removes s1 (the active clusters stay shared with s2), kDeleteLast
// s2: clusters shared by s2 and the active state only drop to refcount 1 and
// their COPIED flags are set again.
enum class Op { kCreate, kApply, kDelete, kDeleteLast };

struct Case {
  const char* name;
  const char* create_options;
  Op op;
};

std::string Sh(const std::string& cmd) {
  testing::ShellResult r = Shell(cmd);
  EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.output;
  return r.output;
}

class SnapshotCrashTest : public ::testing::TestWithParam<Case> {};

// Runs the case's operation on `path` with at most `budget` changes.
// Returns the number of changes it asked for.
uint64_t RunOp(Env& env, const std::string& path, Op op, uint64_t budget,
               std::vector<CrashNode::Change>* journal = nullptr) {
  absl::StatusOr<std::unique_ptr<io::BlockNode>> file =
      env.OpenFile(path, /*read_only=*/false);
  EXPECT_TRUE(file.ok()) << file.status();
  auto crash = std::make_unique<CrashNode>(*std::move(file), budget);
  CrashNode* c = crash.get();
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node = env.Run(
      Qcow2Node::Open(std::move(crash), Qcow2OpenOptions(), env.Opener()));
  EXPECT_TRUE(node.ok()) << node.status();
  if (!node.ok()) return 0;
  absl::Status st;
  switch (op) {
    case Op::kCreate:
      st = env.Run((*node)->CreateSnapshot("new", 1000, 0));
      break;
    case Op::kApply: {
      std::string report;
      st = env.Run((*node)->GotoSnapshot("1", &report));
      break;
    }
    case Op::kDelete:
      st = env.Run((*node)->DeleteSnapshot(0));
      break;
    case Op::kDeleteLast:
      st = env.Run((*node)->DeleteSnapshot(1));
      break;
  }
  absl::Status closed = env.Run((*node)->Close());
  if (journal != nullptr) *journal = c->journal();
  if (budget == ~uint64_t{0}) {
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(closed.ok()) << closed;
  }
  return c->changes();
}

std::string SnapshotNames(const std::string& path) {
  return Sh(absl::StrCat("qemu-img snapshot -l ", path,
                         " | awk 'NR > 2 { print $1, $2 }'"));
}

TEST_P(SnapshotCrashTest, EveryPrefixIsConsistent) {
  const Case& c = GetParam();
  Env env;
  const std::string dir = TempPath(absl::StrCat("snapcrash_", c.name));
  const std::string base = dir + "/base.qcow2";
  const std::string img = dir + "/img.qcow2";
  Sh(absl::StrCat("rm -rf ", dir, " && mkdir -p ", dir, " && qemu-img create -q -f qcow2 ",
                  c.create_options, " ", base, " 4M && qemu-io -c 'write -P 1 0 192k' "
                  "-c 'write -c -P 2 1M 64k' -c 'write -z 2M 64k' ", base,
                  " >/dev/null && qemu-img snapshot -c s1 ", base,
                  " && qemu-io -c 'write -P 3 64k 8k' -c 'write -P 4 1M 64k' ", base,
                  " >/dev/null && qemu-img snapshot -c s2 ", base,
                  " && qemu-io -c 'write -P 5 3M 64k' ", base, " >/dev/null"));
  const std::string old_names = SnapshotNames(base);
  const std::string old_data = dir + "/old.raw";
  const std::string new_data = dir + "/new.raw";
  Sh(absl::StrCat("qemu-img convert -O raw ", base, " ", old_data));

  // The operation unhindered: its result and its number of changes.
  Sh(absl::StrCat("cp ", base, " ", img));
  const uint64_t total = RunOp(env, img, c.op, ~uint64_t{0});
  ASSERT_GT(total, 0u);
  std::cout << c.name << ": " << total << " changes\n";
  Sh(absl::StrCat("qemu-img check ", img));
  const std::string new_names = SnapshotNames(img);
  Sh(absl::StrCat("qemu-img convert -O raw ", img, " ", new_data));

  // The checks on an image a crash left.
  auto verify = [&](const std::string& img) {
    testing::ShellResult check = Shell(absl::StrCat("qemu-img check ", img, " 2>&1"));
    const bool dirty = (ReadAll(img)[79] & 1) != 0;
    if (check.exit_code == 2) {
      // Only COPIED flags may disagree with the refcounts, on a dirty image.
      EXPECT_TRUE(dirty) << check.output;
      for (absl::string_view line : absl::StrSplit(check.output, '\n')) {
        if (absl::StartsWith(line, "ERROR")) {
          EXPECT_TRUE(absl::StrContains(line, "OFLAG_COPIED")) << check.output;
        }
      }
    } else {
      EXPECT_TRUE(check.exit_code == 0 || check.exit_code == 3) << check.output;
    }
    const std::string names = SnapshotNames(img);
    EXPECT_TRUE(names == old_names || names == new_names)
        << names << "\nold:\n" << old_names << "\nnew:\n" << new_names;
    testing::ShellResult repair =
        Shell(absl::StrCat("qemu-img check -r all ", img, " >/dev/null 2>&1 && "
                           "qemu-img check ", img, " 2>&1"));
    EXPECT_EQ(repair.exit_code, 0) << repair.output;
    testing::ShellResult same_old = Shell(absl::StrCat(
        "qemu-img compare -q -f qcow2 -F raw ", img, " ", old_data));
    testing::ShellResult same_new = Shell(absl::StrCat(
        "qemu-img compare -q -f qcow2 -F raw ", img, " ", new_data));
    EXPECT_TRUE(same_old.exit_code == 0 || same_new.exit_code == 0)
        << "the active state is neither the old nor the new one";
  };

  const std::string reordered = dir + "/reordered.qcow2";
  int reorderings = 0;
  for (uint64_t k = 0; k < total; ++k) {
    SCOPED_TRACE(absl::StrCat(c.name, ": crash after ", k, " of ", total,
                              " changes"));
    Sh(absl::StrCat("cp ", base, " ", img));
    std::vector<CrashNode::Change> journal;
    RunOp(env, img, c.op, k, &journal);
    verify(img);
    // The same crash with the last change on disk but none of the earlier
    // changes of its flush epoch: a missing flush between two changes
    // that must reach the disk in order shows here.
    if (k == 0 || journal.size() != k) continue;
    const size_t epoch_start = journal[k - 1].epoch_start;
    if (epoch_start + 1 >= k) continue;  // first of its epoch: the prefix
    SCOPED_TRACE(absl::StrCat("without changes ", epoch_start, " to ", k - 2,
                              " (unflushed)"));
    Sh(absl::StrCat("cp ", base, " ", reordered));
    Replay(reordered, journal, epoch_start, k - 1);
    verify(reordered);
    ++reorderings;
  }
  std::cout << c.name << ": " << reorderings << " reordered crashes\n";
}

INSTANTIATE_TEST_SUITE_P(
    Ops, SnapshotCrashTest,
    ::testing::Values(Case{"create", "", Op::kCreate},
                      Case{"apply", "", Op::kApply},
                      Case{"delete", "", Op::kDelete},
                      Case{"delete_last", "", Op::kDeleteLast},
                      Case{"create_ext", "-o extended_l2=on", Op::kCreate},
                      Case{"apply_ext", "-o extended_l2=on", Op::kApply},
                      Case{"delete_ext", "-o extended_l2=on", Op::kDelete},
                      Case{"apply_4k", "-o cluster_size=4k", Op::kApply},
                      Case{"delete_4k", "-o cluster_size=4k", Op::kDelete}),
    [](const ::testing::TestParamInfo<Case>& info) {
      return std::string(info.param.name);
    });

}  // namespace
}  // namespace imgtool::qcow2
