// CheckQcow2 and RebuildRefcounts against qemu-img 7.2 on the same broken
// images. Every image is made by qemu-img/qemu-io and then broken by
// patching bytes (the recipe is in each test). For each case the checker
// runs on one copy and `qemu-img check --output=json` on another, in the
// same repair mode: the problem lines must be the same multiset, the counts
// the same numbers, and after a repair both files must be byte-identical.
#include "qcow2/check.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAreArray;

using Shell = testing::ShellOutput;
using testing::PatchHex;
using testing::ReadAll;
using testing::RunShell;

std::string MakeTestDir() {
  static std::atomic<int> counter{0};
  const char* base = std::getenv("TEST_TMPDIR");
  const std::string dir =
      absl::StrCat(base != nullptr ? base : "/tmp", "/qcow2_check_test_",
                   getpid(), "_", counter++);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

// Writes `bytes` (hex) at `offset` of `path`.
std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    lines.emplace_back(l);
  }
  return lines;
}

// `"key": number` of qemu-img's JSON (0 when absent, as qemu-img omits
// zero counts).
uint64_t JsonNumber(const std::string& json, const std::string& key) {
  const std::string needle = absl::StrCat("\"", key, "\": ");
  const size_t pos = json.find(needle);
  if (pos == std::string::npos) return 0;
  const size_t start = pos + needle.size();
  const size_t end = json.find_first_not_of("0123456789", start);
  uint64_t v = 0;
  EXPECT_TRUE(absl::SimpleAtoi(json.substr(start, end - start), &v)) << json;
  return v;
}

struct Outcome {
  absl::Status status;  // of CheckQcow2
  CheckResult result;
  std::vector<std::string> messages;
};

// Runs CheckQcow2 on `path`, opened read-write for a repair.
Outcome CheckFile(const std::string& path, RepairMode mode) {
  Outcome o;
  absl::StatusOr<std::unique_ptr<io::Engine>> engine =
      io::CreateEngine(io::EngineKind::kAuto, 4, nullptr);
  if (!engine.ok()) {
    o.status = engine.status();
    return o;
  }
  posix_file::FileOpenOptions options;
  options.set_filename(path);
  options.set_read_only(mode == RepairMode::kNone);
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(**engine, options, nullptr);
  if (!file.ok()) {
    o.status = file.status();
    return o;
  }
  std::ostringstream messages;
  absl::StatusOr<CheckResult> r =
      io::RunSync(**engine, CheckQcow2(**file, mode, messages));
  absl::Status closed = io::RunSync(**engine, (*file)->Close());
  o.status = r.ok() ? closed : r.status();
  if (r.ok()) o.result = *r;
  o.messages = Lines(messages.str());
  return o;
}

// Forwards to a file node and records every write, flush and discard as
// "W <offset>+<length>", "F", "D <offset>+<length>" (hex), to check the
// order of the checker's writes.
class RecordingNode : public io::BlockNode {
 public:
  explicit RecordingNode(io::BlockNode& inner)
      : io::BlockNode(inner.filename(), inner.read_only()), inner_(inner) {}
  uint64_t size() const override { return inner_.size(); }
  io::Task<absl::Status> Close() override { co_return absl::OkStatus(); }
  std::vector<std::string> trace;

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    co_return co_await inner_.Read(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    trace.push_back(absl::StrFormat("W %x+%x", offset, data.size()));
    co_return co_await inner_.Write(offset, data);
  }
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override {
    trace.push_back(absl::StrFormat("D %x+%x", offset, length));
    co_return co_await inner_.Discard(offset, length);
  }
  io::Task<absl::Status> DoFlush() override {
    trace.push_back("F");
    co_return co_await inner_.Flush();
  }
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override {
    trace.push_back(absl::StrFormat("T %x", size));
    co_return co_await inner_.Truncate(size, prealloc);
  }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    co_return co_await inner_.GetBlockStatus(offset, max_length);
  }

 private:
  io::BlockNode& inner_;
};

// Repairs `path` with -r `mode` through a RecordingNode; returns the trace.
std::vector<std::string> RepairTrace(const std::string& path, RepairMode mode) {
  std::unique_ptr<io::Engine> engine =
      *io::CreateEngine(io::EngineKind::kAuto, 4, nullptr);
  posix_file::FileOpenOptions options;
  options.set_filename(path);
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*engine, options, nullptr);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return {};
  RecordingNode recorder(**file);
  std::ostringstream messages;
  absl::StatusOr<CheckResult> r =
      io::RunSync(*engine, CheckQcow2(recorder, mode, messages));
  EXPECT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(io::RunSync(*engine, (*file)->Close()).ok());
  return recorder.trace;
}

const char* ModeFlag(RepairMode mode) {
  switch (mode) {
    case RepairMode::kNone:
      return "";
    case RepairMode::kLeaks:
      return "-r leaks ";
    case RepairMode::kAll:
      return "-r all ";
  }
  return "";
}

class CheckTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = MakeTestDir(); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  // Runs a shell command in the test directory and expects success.
  void Sh(const std::string& command) {
    Shell r = RunShell(dir_, command);
    ASSERT_EQ(r.rc, 0) << command << "\n" << r.out << r.err;
  }

  // The standard 64 MiB image, 64 KiB clusters: header 0, reftable 1,
  // refblock 2, L1 3, L2 4, data clusters 5 (guest 0), 6 (guest 64k) and
  // 7 (guest 1 MiB); 8 clusters, 524288 bytes.
  void MakeBaseImage(const std::string& name) {
    Sh("qemu-img create -q -f qcow2 " + name + " 64M");
    Sh("qemu-io -c 'write -P 1 0 128k' -c 'write -P 2 1M 64k' " + name +
       " >/dev/null");
  }

  // In a MakeBaseImage image: copies metadata cluster `cluster` to cluster
  // 8 (the end of the file), points the field at `pointer` to it (`hex`)
  // and moves its refcount there; the image must stay clean.
  void MoveClusterToTheEnd(const std::string& name, int cluster,
                           uint64_t pointer, const std::string& hex) {
    Sh(absl::StrCat("dd if=", name, " of=", name, " bs=64k skip=", cluster,
                    " seek=8 count=1 conv=notrunc status=none"));
    PatchHex(Path(name), pointer, hex);
    PatchHex(Path(name), 0x20000 + cluster * 2, "0000");
    PatchHex(Path(name), 0x20000 + 8 * 2, "0001");
    ASSERT_EQ(QemuCheck(name), 0);
  }

  // Checks `name` with our checker and with qemu-img on copies, in `mode`,
  // and expects the same lines, counts and (after a repair) bytes. Returns
  // our outcome for further expectations. Leaves `name` untouched.
  Outcome CompareWithQemu(const std::string& name, RepairMode mode) {
    const std::string ours = name + ".ours";
    const std::string theirs = name + ".qemu";
    std::filesystem::copy_file(
        Path(name), Path(ours),
        std::filesystem::copy_options::overwrite_existing);
    std::filesystem::copy_file(
        Path(name), Path(theirs),
        std::filesystem::copy_options::overwrite_existing);
    Outcome o = CheckFile(Path(ours), mode);
    Shell q = RunShell(dir_, absl::StrCat("qemu-img check --output=json ",
                                          ModeFlag(mode), theirs));
    // qemu-img's own error lines carry its name; ours say imgtool.
    std::vector<std::string> qemu_lines;
    for (std::string& l : Lines(q.err)) {
      if (absl::StartsWith(l, "qemu-img: Check failed")) continue;
      absl::StrReplaceAll({{"qemu-img: ", "imgtool: "}}, &l);
      qemu_lines.push_back(l);
    }
    EXPECT_THAT(o.messages, UnorderedElementsAreArray(qemu_lines))
        << "mode " << ModeFlag(mode) << "; qemu-img said:\n"
        << q.err;
    if (q.rc == 1 && q.out.empty()) {
      // The check could not be done: no report.
      EXPECT_FALSE(o.status.ok()) << "qemu-img: " << q.err;
    } else {
      EXPECT_TRUE(o.status.ok()) << o.status;
      const CheckResult& r = o.result;
      EXPECT_EQ(r.corruptions, JsonNumber(q.out, "corruptions"));
      EXPECT_EQ(r.leaks, JsonNumber(q.out, "leaks"));
      EXPECT_EQ(r.check_errors, JsonNumber(q.out, "check-errors"));
      EXPECT_EQ(r.corruptions_fixed, JsonNumber(q.out, "corruptions-fixed"));
      EXPECT_EQ(r.leaks_fixed, JsonNumber(q.out, "leaks-fixed"));
      EXPECT_EQ(r.image_end_offset, JsonNumber(q.out, "image-end-offset"));
      EXPECT_EQ(r.total_clusters, JsonNumber(q.out, "total-clusters"));
      EXPECT_EQ(r.allocated_clusters, JsonNumber(q.out, "allocated-clusters"));
      EXPECT_EQ(r.fragmented_clusters,
                JsonNumber(q.out, "fragmented-clusters"));
      EXPECT_EQ(r.compressed_clusters,
                JsonNumber(q.out, "compressed-clusters"));
    }
    if (mode != RepairMode::kNone) {
      EXPECT_TRUE(ReadAll(Path(ours)) == ReadAll(Path(theirs)))
          << "repaired files differ (" << ModeFlag(mode) << ")";
    }
    return o;
  }

  // All three modes.
  void CompareAllModes(const std::string& name) {
    for (RepairMode mode :
         {RepairMode::kNone, RepairMode::kLeaks, RepairMode::kAll}) {
      SCOPED_TRACE(ModeFlag(mode));
      CompareWithQemu(name, mode);
    }
  }

  // `n` bytes at `offset` of a file, in hex.
  std::string HexAt(const std::string& name, uint64_t offset, int n) {
    return RunShell(dir_, absl::StrCat("od -An -tx1 -j ", offset, " -N ", n,
                                       " ", name, " | tr -d ' \\n'"))
        .out;
  }

  // `qemu-img check` exit code of a file.
  int QemuCheck(const std::string& name) {
    return RunShell(dir_, "qemu-img check " + name).rc;
  }

  std::string dir_;
};

TEST_F(CheckTest, CleanImage) {
  MakeBaseImage("a.qcow2");
  Outcome o = CompareWithQemu("a.qcow2", RepairMode::kNone);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_THAT(o.messages, IsEmpty());
  EXPECT_EQ(o.result.corruptions, 0u);
  EXPECT_EQ(o.result.leaks, 0u);
  EXPECT_EQ(o.result.check_errors, 0u);
  EXPECT_EQ(o.result.image_end_offset, 524288u);
  EXPECT_EQ(o.result.total_clusters, 1024u);
  EXPECT_EQ(o.result.allocated_clusters, 3u);
  EXPECT_EQ(o.result.fragmented_clusters, 0u);
}

// Images of every shape qemu-img makes check clean, with qemu-img's
// statistics.
TEST_F(CheckTest, CleanImagesOfManyShapes) {
  struct Shape {
    const char* options;
    const char* size;
    const char* cluster_size;  // compressed writes are whole clusters
  };
  const Shape shapes[] = {
      {"cluster_size=512", "4M", "512"},
      {"cluster_size=2M", "64M", "2M"},
      {"refcount_bits=1", "64M", "64k"},
      {"refcount_bits=64", "64M", "64k"},
      {"compat=0.10", "64M", "64k"},
      {"extended_l2=on,cluster_size=128k", "64M", "128k"},
      {"lazy_refcounts=on", "64M", "64k"},
      {"cluster_size=4k,refcount_bits=8", "16M", "4k"},
  };
  int n = 0;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(s.options);
    const std::string name = absl::StrCat("shape", n++, ".qcow2");
    Sh(absl::StrCat("qemu-img create -q -f qcow2 -o ", s.options, " ", name,
                    " ", s.size));
    Sh(absl::StrCat(
        "qemu-io -c 'write -P 1 0 4k' -c 'write -P 2 100k 300k' "
        "-c 'write -z 1M 64k' -c 'write -c -P 3 2M ",
        s.cluster_size, "' -c 'write -P 4 3M 512' ", name, " >/dev/null"));
    Outcome o = CompareWithQemu(name, RepairMode::kNone);
    EXPECT_THAT(o.messages, IsEmpty());
    EXPECT_EQ(o.result.corruptions + o.result.leaks, 0u);
  }
}

TEST_F(CheckTest, SnapshotsAndCompressedClustersAreCounted) {
  MakeBaseImage("s.qcow2");
  Sh("qemu-img snapshot -c first s.qcow2");
  Sh("qemu-io -c 'write -P 5 0 64k' -c 'write -c -P 6 4M 64k' s.qcow2 "
     ">/dev/null");
  Sh("qemu-img snapshot -c second s.qcow2");
  Sh("qemu-io -c 'write -P 7 64k 64k' s.qcow2 >/dev/null");
  Outcome o = CompareWithQemu("s.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, IsEmpty());
  EXPECT_EQ(o.result.compressed_clusters, 1u);
  EXPECT_EQ(o.result.corruptions + o.result.leaks, 0u);
}

TEST_F(CheckTest, BitmapsAreCounted) {
  MakeBaseImage("b.qcow2");
  Sh("qemu-img bitmap --add b.qcow2 b0");
  Sh("qemu-io -c 'write -P 8 8M 1M' b.qcow2 >/dev/null");
  Sh("qemu-img bitmap --add b.qcow2 b1");
  Outcome o = CompareWithQemu("b.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, IsEmpty());
}

// Recipe: grow the file by one cluster and give that cluster refcount 1
// (refblock at 0x20000, 16-bit entries).
TEST_F(CheckTest, LeakedCluster) {
  MakeBaseImage("leak.qcow2");
  Sh("truncate -s 589824 leak.qcow2");
  PatchHex(Path("leak.qcow2"), 0x20000 + 2 * 8, "0001");
  Outcome o = CompareWithQemu("leak.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("Leaked cluster 8 refcount=1 reference=0"));
  EXPECT_EQ(o.result.leaks, 1u);
  EXPECT_EQ(o.result.corruptions, 0u);
  EXPECT_EQ(o.result.image_end_offset, 589824u);

  o = CompareWithQemu("leak.qcow2", RepairMode::kLeaks);
  EXPECT_THAT(o.messages,
              ElementsAre("Leaked cluster 8 refcount=1 reference=0",
                          "Repairing cluster 8 refcount=1 reference=0"));
  EXPECT_EQ(o.result.leaks_fixed, 1u);
  EXPECT_EQ(o.result.leaks, 0u);
  EXPECT_EQ(QemuCheck("leak.qcow2.ours"), 0);
  CompareWithQemu("leak.qcow2", RepairMode::kAll);
  EXPECT_EQ(QemuCheck("leak.qcow2.ours"), 0);
}

// Recipe (issue 15): the end of the file cuts the active L1 table, 0, 1, 4
// or 7 bytes into its one entry. qemu-img 7.2 reads the missing bytes as
// zeroes (a partly present entry as garbage: it reads the header as an L2
// table) and, cut at 0, calls the image clean; every other command refuses
// to open it. The check reports the cut, and -r all zeroes the partial
// entry, grows the file to the end of the table and frees the clusters
// past the end that only the lost entry referenced, so that the image
// stays clean when it grows over them.
TEST_F(CheckTest, ActiveL1TableCutByTheEndOfTheFile) {
  for (int cut : {0, 1, 4, 7}) {
    SCOPED_TRACE(absl::StrCat("cut ", cut));
    MakeBaseImage("cut.qcow2");
    const uint64_t size = 0x30000 + cut;
    Sh(absl::StrCat("truncate -s ", size, " cut.qcow2"));
    const std::string what = absl::StrFormat(
        "active L1 table at 0x30000 (8 bytes) extends beyond the end of the "
        "file (%u bytes)",
        size);
    Outcome o = CheckFile(Path("cut.qcow2"), RepairMode::kNone);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_THAT(o.messages,
                ElementsAre("ERROR " + what,
                            "Leaked cluster 4 refcount=1 reference=0",
                            "Leaked cluster 5 refcount=1 reference=0",
                            "Leaked cluster 6 refcount=1 reference=0",
                            "Leaked cluster 7 refcount=1 reference=0"));
    EXPECT_EQ(o.result.corruptions, 1u);
    EXPECT_EQ(o.result.leaks, 4u);

    o = CheckFile(Path("cut.qcow2"), RepairMode::kLeaks);
    EXPECT_EQ(o.result.corruptions, 1u);
    EXPECT_EQ(o.result.leaks_fixed, 4u);
    EXPECT_EQ(std::filesystem::file_size(Path("cut.qcow2")), size);

    o = CheckFile(Path("cut.qcow2"), RepairMode::kAll);
    ASSERT_TRUE(o.status.ok()) << o.status;
    EXPECT_THAT(o.messages, ElementsAre("Repairing " + what));
    EXPECT_EQ(o.result.corruptions, 0u);
    EXPECT_EQ(o.result.corruptions_fixed, 1u);
    EXPECT_EQ(std::filesystem::file_size(Path("cut.qcow2")), 0x30008u);
    EXPECT_EQ(HexAt("cut.qcow2", 0x30000, 8), "0000000000000000");
    EXPECT_EQ(QemuCheck("cut.qcow2"), 0);
    Sh("qemu-io -c 'write -P 3 0 64k' -c 'read -P 3 0 64k' "
       "-c 'read -P 0 1M 64k' cut.qcow2 >/dev/null");
    EXPECT_EQ(QemuCheck("cut.qcow2"), 0);
  }

  // 2 MiB clusters: header, reftable, refblock, L1 at 6 MiB.
  Sh("qemu-img create -q -f qcow2 -o cluster_size=2M big.qcow2 8M");
  Sh("qemu-io -c 'write -P 1 0 64k' big.qcow2 >/dev/null");
  Sh("truncate -s 6291457 big.qcow2");
  Outcome o = CheckFile(Path("big.qcow2"), RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR active L1 table at 0x600000 (8 bytes) "
                          "extends beyond the end of the file (6291457 "
                          "bytes)",
                          "Leaked cluster 4 refcount=1 reference=0",
                          "Leaked cluster 5 refcount=1 reference=0"));
  EXPECT_EQ(o.result.corruptions, 1u);
  o = CheckFile(Path("big.qcow2"), RepairMode::kAll);
  EXPECT_EQ(o.result.corruptions, 0u);
  EXPECT_EQ(o.result.corruptions_fixed, 1u);
  EXPECT_EQ(o.result.leaks_fixed, 2u);
  EXPECT_EQ(QemuCheck("big.qcow2"), 0);
}

// Recipe: the L2 table moved to the end of the file (cluster 8; L1 entry
// and refcounts patched), then the file cut 12 bytes into it: entry 0
// (guest 0 -> cluster 5) is whole, entry 1 (guest 64k -> cluster 6) has 4
// of its 8 bytes, entry 16 (guest 1M -> cluster 7) is gone.
TEST_F(CheckTest, L2TableCutByTheEndOfTheFile) {
  MakeBaseImage("l2cut.qcow2");
  MoveClusterToTheEnd("l2cut.qcow2", 4, 0x30000, "8000000000080000");
  Sh("truncate -s 524300 l2cut.qcow2");
  const std::string what =
      "active L2 table at 0x80000 (65536 bytes) extends beyond the end of "
      "the file (524300 bytes)";
  Outcome o = CheckFile(Path("l2cut.qcow2"), RepairMode::kNone);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR " + what,
                          "Leaked cluster 6 refcount=1 reference=0",
                          "Leaked cluster 7 refcount=1 reference=0"));
  EXPECT_EQ(o.result.corruptions, 1u);

  o = CheckFile(Path("l2cut.qcow2"), RepairMode::kAll);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.result.corruptions, 0u);
  EXPECT_EQ(o.result.corruptions_fixed, 1u);
  EXPECT_EQ(o.result.leaks_fixed, 2u);
  EXPECT_EQ(std::filesystem::file_size(Path("l2cut.qcow2")), 0x90000u);
  EXPECT_EQ(HexAt("l2cut.qcow2", 0x80008, 8), "0000000000000000");
  EXPECT_EQ(QemuCheck("l2cut.qcow2"), 0);
  Sh("qemu-io -r -c 'read -P 1 0 64k' -c 'read -P 0 64k 64k' "
     "-c 'read -P 0 1M 64k' l2cut.qcow2 >/dev/null");
}

// Recipe: the refcount table moved to the end of the file (cluster 8;
// header and refcounts patched), then the file cut 4 bytes into its entry
// for the one refcount block: every refcount reads as 0 and -r all
// rebuilds the structure; the guest data is untouched.
TEST_F(CheckTest, RefcountTableCutByTheEndOfTheFile) {
  MakeBaseImage("rtcut.qcow2");
  MoveClusterToTheEnd("rtcut.qcow2", 1, 48, "0000000000080000");
  Sh("truncate -s 524292 rtcut.qcow2");
  Outcome o = CheckFile(Path("rtcut.qcow2"), RepairMode::kNone);
  ASSERT_TRUE(o.status.ok()) << o.status;
  ASSERT_FALSE(o.messages.empty());
  EXPECT_EQ(o.messages.front(),
            "ERROR refcount table at 0x80000 (65536 bytes) extends beyond "
            "the end of the file (524292 bytes)");
  EXPECT_GE(o.result.corruptions, 2u);

  o = CheckFile(Path("rtcut.qcow2"), RepairMode::kAll);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_EQ(o.result.corruptions, 0u);
  EXPECT_EQ(QemuCheck("rtcut.qcow2"), 0);
  Sh("qemu-io -r -c 'read -P 1 0 128k' -c 'read -P 2 1M 64k' rtcut.qcow2 "
     ">/dev/null");
}

// Recipe (iotest 036): set autoclear bits 63 and 7, which QEMU does not
// know. qemu-img check -r opens the image for writing, which clears them
// (the header is rewritten); a plain check leaves them. With a leak too,
// the repair and the rewrite go together.
TEST_F(CheckTest, RepairClearsUnknownAutoclearBits) {
  MakeBaseImage("ac.qcow2");
  PatchHex(Path("ac.qcow2"), 88, "8000000000000080");
  Outcome o = CompareWithQemu("ac.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, IsEmpty());
  EXPECT_EQ(HexAt("ac.qcow2.ours", 88, 8), "8000000000000080");
  for (RepairMode mode : {RepairMode::kLeaks, RepairMode::kAll}) {
    SCOPED_TRACE(ModeFlag(mode));
    o = CompareWithQemu("ac.qcow2", mode);
    EXPECT_THAT(o.messages, IsEmpty());
    EXPECT_EQ(HexAt("ac.qcow2.ours", 88, 8), "0000000000000000");
    EXPECT_EQ(QemuCheck("ac.qcow2.ours"), 0);
  }
  Sh("truncate -s 589824 ac.qcow2");
  PatchHex(Path("ac.qcow2"), 0x20000 + 8 * 2, "0001");
  o = CompareWithQemu("ac.qcow2", RepairMode::kAll);
  EXPECT_EQ(o.result.leaks_fixed, 1u);
  EXPECT_EQ(HexAt("ac.qcow2.ours", 88, 8), "0000000000000000");
}

// Recipe: set the refcount of data cluster 5 to 0. Needs a rebuild of the
// refcount structure: -r leaks gives up, -r all rebuilds it at the end of
// the file and frees the old one.
TEST_F(CheckTest, ZeroRefcountOfUsedClusterRebuildsRefcounts) {
  MakeBaseImage("zero.qcow2");
  Sh("cp zero.qcow2 before.qcow2");
  PatchHex(Path("zero.qcow2"), 0x20000 + 2 * 5, "0000");
  Outcome o = CompareWithQemu("zero.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              UnorderedElementsAreArray(
                  {"ERROR cluster 5 refcount=0 reference=1",
                   "ERROR OFLAG_COPIED data cluster: l2_entry=8000000000050000 "
                   "refcount=0"}));
  EXPECT_EQ(o.result.corruptions, 2u);

  o = CompareWithQemu("zero.qcow2", RepairMode::kLeaks);
  EXPECT_EQ(o.status.message(), "Check failed: Input/output error");

  o = CompareWithQemu("zero.qcow2", RepairMode::kAll);
  ASSERT_TRUE(o.status.ok()) << o.status;
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR cluster 5 refcount=0 reference=1",
                          "Rebuilding refcount structure",
                          "Repairing cluster 1 refcount=1 reference=0",
                          "Repairing cluster 2 refcount=1 reference=0"));
  EXPECT_EQ(o.result.corruptions_fixed, 1u);
  EXPECT_EQ(o.result.corruptions, 0u);
  // New refcount block at cluster 8, table at 9.
  EXPECT_EQ(o.result.image_end_offset, 655360u);
  EXPECT_EQ(QemuCheck("zero.qcow2.ours"), 0);
  EXPECT_EQ(RunShell(dir_, "qemu-img compare before.qcow2 zero.qcow2.ours").rc,
            0);
}

// Recipe: zero the stored refcount of host cluster 6 (in use) in images of
// several shapes (with 1-bit refcounts, the whole byte: clusters 0-7). The
// rebuilt refcount structure is byte-identical to qemu-img's.
TEST_F(CheckTest, RebuildOfManyShapes) {
  const char* shapes[] = {
      "refcount_bits=1",
      "refcount_bits=64",
      "cluster_size=512",
      "cluster_size=512,refcount_bits=64",
      "extended_l2=on,cluster_size=128k",
      "compat=0.10",
  };
  int n = 0;
  for (const char* options : shapes) {
    SCOPED_TRACE(options);
    const std::string name = absl::StrCat("rb", n++, ".qcow2");
    Sh(absl::StrCat("qemu-img create -q -f qcow2 -o ", options, " ", name,
                    " 64M"));
    Sh("qemu-io -c 'write -P 1 0 1M' -c 'write -P 2 10M 2M' "
       "-c 'write -c -P 3 20M 128k' " +
       name + " >/dev/null");
    uint64_t reftable = 0;
    uint64_t refblock = 0;
    uint32_t version = 0;
    uint32_t order = 4;
    ASSERT_TRUE(absl::SimpleHexAtoi(HexAt(name, 48, 8), &reftable));
    ASSERT_TRUE(absl::SimpleHexAtoi(HexAt(name, reftable, 8), &refblock));
    ASSERT_TRUE(absl::SimpleHexAtoi(HexAt(name, 4, 4), &version));
    if (version == 3) {
      ASSERT_TRUE(absl::SimpleHexAtoi(HexAt(name, 96, 4), &order));
    }
    const uint64_t bits = uint64_t{1} << order;
    PatchHex(Path(name), refblock + 6 * bits / 8,
          std::string(2 * std::max<uint64_t>(1, bits / 8), '0'));
    CompareAllModes(name);
    EXPECT_EQ(QemuCheck(name + ".ours"), 0);
  }
}

// Recipe: point guest cluster 1's L2 entry at guest cluster 0's host
// cluster 5 (cluster 6 is then leaked).
TEST_F(CheckTest, TwoL2EntriesShareACluster) {
  MakeBaseImage("shared.qcow2");
  PatchHex(Path("shared.qcow2"), 0x40008, "8000000000050000");
  Outcome o = CompareWithQemu("shared.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, UnorderedElementsAreArray(
                              {"ERROR cluster 5 refcount=1 reference=2",
                               "Leaked cluster 6 refcount=1 reference=0"}));
  EXPECT_EQ(o.result.corruptions, 1u);
  EXPECT_EQ(o.result.leaks, 1u);
  CompareWithQemu("shared.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("shared.qcow2", RepairMode::kAll);
  EXPECT_EQ(o.result.corruptions_fixed, 3u);  // refcount + 2 COPIED flags
  EXPECT_EQ(o.result.leaks_fixed, 1u);
  EXPECT_EQ(QemuCheck("shared.qcow2.ours"), 0);
}

// Recipe: L1 entry 0 -> 0x40200 (L2 table offset not cluster aligned).
TEST_F(CheckTest, MisalignedL2Table) {
  MakeBaseImage("l2.qcow2");
  PatchHex(Path("l2.qcow2"), 0x30000, "8000000000040200");
  Outcome o = CompareWithQemu("l2.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.messages.front(),
            "ERROR l2_offset=40200: Table is not cluster aligned; L1 entry "
            "corrupted");
  EXPECT_EQ(o.result.corruptions, 129u);
  CompareWithQemu("l2.qcow2", RepairMode::kLeaks);
  CompareWithQemu("l2.qcow2", RepairMode::kAll);
}

// Recipes: a data cluster at 4 GiB (past the end of the file), and one at
// the largest offset an L2 entry holds.
TEST_F(CheckTest, DataClusterPastEndOfFile) {
  MakeBaseImage("eof.qcow2");
  PatchHex(Path("eof.qcow2"), 0x40000, "8000000100000000");
  Outcome o = CompareWithQemu("eof.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              UnorderedElementsAreArray(
                  {"ERROR: counting reference for region exceeding the end of "
                   "the file by one cluster or more: offset 0x100000000 size "
                   "0x10000",
                   "Leaked cluster 5 refcount=1 reference=0",
                   "ERROR OFLAG_COPIED data cluster: l2_entry=8000000100000000 "
                   "refcount=0"}));
  CompareWithQemu("eof.qcow2", RepairMode::kLeaks);
  CompareWithQemu("eof.qcow2", RepairMode::kAll);

  MakeBaseImage("far.qcow2");
  PatchHex(Path("far.qcow2"), 0x40008, "80ffffffffff0000");
  CompareAllModes("far.qcow2");
}

// Recipe: set reserved bit 1 of an L2 entry and reserved bit 56 of an L1
// entry.
TEST_F(CheckTest, ReservedBits) {
  MakeBaseImage("resv.qcow2");
  PatchHex(Path("resv.qcow2"), 0x40000, "8000000000050002");
  Outcome o = CompareWithQemu("resv.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR found l2 entry with reserved bits set: "
                          "8000000000050002"));
  EXPECT_EQ(o.result.corruptions, 1u);
  CompareAllModes("resv.qcow2");

  MakeBaseImage("l1resv.qcow2");
  PatchHex(Path("l1resv.qcow2"), 0x30000, "8100000000040000");
  o = CompareWithQemu("l1resv.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR found L1 entry with reserved bits set: "
                          "8100000000040000"));
  CompareAllModes("l1resv.qcow2");
}

// Recipe: refcount table entry 1 -> 2^56 (refcount block far past the end
// of the file). Nothing may be sized by that offset; -r all cannot grow
// the file that far (as qemu-img on ext4) and rebuilds instead.
TEST_F(CheckTest, RefcountBlockFarPastEndOfFileKeepsMemoryBounded) {
  MakeBaseImage("far.qcow2");
  PatchHex(Path("far.qcow2"), 0x10008, "0100000000000000");
  struct rusage before;
  getrusage(RUSAGE_SELF, &before);
  Outcome o = CompareWithQemu("far.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR refcount block 1 is outside image"));
  CompareWithQemu("far.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("far.qcow2", RepairMode::kAll);
  EXPECT_EQ(o.result.corruptions_fixed, 1u);
  EXPECT_EQ(QemuCheck("far.qcow2.ours"), 0);
  struct rusage after;
  getrusage(RUSAGE_SELF, &after);
  EXPECT_LT(after.ru_maxrss - before.ru_maxrss, 64 * 1024);  // KiB

  // A block just past the end: -r all grows the file to hold it.
  MakeBaseImage("near.qcow2");
  PatchHex(Path("near.qcow2"), 0x10008, "00000000000a0000");
  CompareAllModes("near.qcow2");
  EXPECT_EQ(QemuCheck("near.qcow2.ours"), 0);
}

// Recipe: refcount table entry 0 -> 0x20200 (refcount block not cluster
// aligned): every refcount is unreadable, the check cannot complete, and a
// repair marks the image corrupt.
TEST_F(CheckTest, MisalignedRefcountBlock) {
  MakeBaseImage("rb.qcow2");
  PatchHex(Path("rb.qcow2"), 0x10000, "0000000000020200");
  Outcome o = CompareWithQemu("rb.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.result.check_errors, 8u);
  EXPECT_EQ(o.messages[1],
            "qcow2: Image is corrupt: Refblock offset 0x20200 unaligned "
            "(reftable index: 0); further non-fatal corruption events will be "
            "suppressed");
  CompareWithQemu("rb.qcow2", RepairMode::kLeaks);
  CompareWithQemu("rb.qcow2", RepairMode::kAll);
}

// Recipe: clear the COPIED flag of L1 entry 0 and of L2 entry 1 (guest
// 64 KiB, at 0x40008).
TEST_F(CheckTest, CopiedFlagsAreRepaired) {
  MakeBaseImage("copied.qcow2");
  PatchHex(Path("copied.qcow2"), 0x30000, "0000000000040000");
  PatchHex(Path("copied.qcow2"), 0x40008, "0000000000060000");
  Outcome o = CompareWithQemu("copied.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR OFLAG_COPIED L2 cluster: l1_index=0 "
                          "l1_entry=40000 refcount=1",
                          "ERROR OFLAG_COPIED data cluster: "
                          "l2_entry=60000 refcount=1"));
  // With nothing else wrong, -r leaks repairs COPIED flags too.
  o = CompareWithQemu("copied.qcow2", RepairMode::kLeaks);
  EXPECT_EQ(o.result.corruptions_fixed, 2u);
  EXPECT_EQ(QemuCheck("copied.qcow2.ours"), 0);
  CompareWithQemu("copied.qcow2", RepairMode::kAll);
}

// Recipe: COPIED flag on a compressed cluster's L2 entry.
TEST_F(CheckTest, CompressedClusterWithCopiedFlag) {
  Sh("qemu-img create -q -f qcow2 c.qcow2 64M");
  Sh("qemu-io -c 'write -c -P 3 0 64k' c.qcow2 >/dev/null");
  const std::string entry = HexAt("c.qcow2", 0x40000, 8);
  ASSERT_EQ(entry.substr(0, 2), "40");
  PatchHex(Path("c.qcow2"), 0x40000, "c0" + entry.substr(2));
  Outcome o = CompareWithQemu("c.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.result.corruptions, 1u);
  CompareAllModes("c.qcow2");
}

// Recipe: a preallocated zero cluster (qemu-io write -z of an allocated
// cluster keeps its host cluster) whose offset is made misaligned; -r all
// turns it into a plain zero cluster.
TEST_F(CheckTest, MisalignedPreallocatedZeroCluster) {
  MakeBaseImage("z.qcow2");
  Sh("qemu-io -c 'write -z 64k 64k' z.qcow2 >/dev/null");
  ASSERT_EQ(HexAt("z.qcow2", 0x40008, 8), "8000000000060001");
  PatchHex(Path("z.qcow2"), 0x40008, "8000000000060201");
  Outcome o = CompareWithQemu("z.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ::testing::Contains("ERROR offset=60200: Preallocated cluster is "
                                  "not properly aligned; L2 entry corrupted."));
  CompareWithQemu("z.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("z.qcow2", RepairMode::kAll);
  EXPECT_EQ(QemuCheck("z.qcow2.ours"), 0);

  // A misaligned data cluster cannot be repaired.
  MakeBaseImage("d.qcow2");
  PatchHex(Path("d.qcow2"), 0x40008, "8000000000060200");
  o = CompareWithQemu("d.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ::testing::Contains("ERROR offset=60200: Data cluster is not "
                                  "properly aligned; L2 entry corrupted."));
  CompareAllModes("d.qcow2");
}

// Recipes on an extended-L2 image (128 KiB clusters: L2 at 0x80000, entry
// 0 = 16 bytes): a subcluster both allocated and zero, and an unallocated
// cluster with allocation bits.
TEST_F(CheckTest, ExtendedL2BitmapErrors) {
  Sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=128k "
     "x.qcow2 64M");
  Sh("qemu-io -c 'write -P 1 0 4k' x.qcow2 >/dev/null");
  PatchHex(Path("x.qcow2"), 0x80008, "0000000100000001");
  PatchHex(Path("x.qcow2"), 0x80018, "0000000000000003");
  Outcome o = CompareWithQemu("x.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              UnorderedElementsAreArray(
                  {"ERROR offset=a0000: Allocated cluster has corrupted "
                   "subcluster allocation bitmap",
                   "ERROR: Unallocated cluster has non-zero subcluster "
                   "allocation map"}));
  CompareAllModes("x.qcow2");
}

// More extended-L2 recipes (128 KiB clusters: L2 at 0x80000; data at
// 0xa0000 for guest 0, a compressed cluster at 0xc0000 for guest 128k): a
// compressed cluster with subcluster bits (allocation, or zero only); and
// the zero flag (bit 0 of the entry), which extended L2 entries leave
// unused, on a normal and on an unallocated cluster: not an error.
TEST_F(CheckTest, ExtendedL2CompressedAndZeroFlagRecipes) {
  Sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=128k "
     "c.qcow2 64M");
  Sh("qemu-io -c 'write -P 1 0 4k' -c 'write -c -P 2 128k 128k' c.qcow2 "
     ">/dev/null");
  ASSERT_EQ(HexAt("c.qcow2", 0x80010, 8), "40000000000c0000");
  Sh("cp c.qcow2 alloc.qcow2 && cp c.qcow2 zero.qcow2 && "
     "cp c.qcow2 flag.qcow2 && cp c.qcow2 uflag.qcow2");
  PatchHex(Path("alloc.qcow2"), 0x80018, "0000000000000003");
  Outcome o = CompareWithQemu("alloc.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR compressed cluster 1 with non-zero "
                          "subcluster allocation bitmap, "
                          "entry=0x40000000000c0000",
                          "Leaked cluster 6 refcount=1 reference=0"));
  EXPECT_EQ(o.result.corruptions, 1u);
  EXPECT_EQ(o.result.leaks, 1u);
  CompareAllModes("alloc.qcow2");

  PatchHex(Path("zero.qcow2"), 0x80018, "ffffffff00000000");
  o = CompareWithQemu("zero.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.result.corruptions, 1u);
  CompareAllModes("zero.qcow2");

  PatchHex(Path("flag.qcow2"), 0x80000, "80000000000a0001");
  o = CompareWithQemu("flag.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, IsEmpty());
  EXPECT_EQ(o.result.corruptions + o.result.leaks, 0u);

  PatchHex(Path("uflag.qcow2"), 0x80020, "0000000000000001");
  o = CompareWithQemu("uflag.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages, IsEmpty());
  EXPECT_EQ(o.result.corruptions + o.result.leaks, 0u);
}

// Extended-L2 bitmap errors in the last subcluster of a 2 MiB cluster
// (L2 at 0x800000, guest 0 at 0xa00000, guest 2M a zero-subcluster entry),
// and in an L2 table only a snapshot still uses (128 KiB clusters: after
// the snapshot the active L2 table moved to 0x100000, the old one at
// 0x80000 belongs to the snapshot's L1 table).
TEST_F(CheckTest, ExtendedL2BitmapErrorsInLastSubclusterAndSnapshot) {
  Sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=2M "
     "big.qcow2 64M");
  Sh("qemu-io -c 'write -P 1 0 4k' -c 'write -z 2M 64k' big.qcow2 "
     ">/dev/null");
  ASSERT_EQ(HexAt("big.qcow2", 0x800000, 32),
            "8000000000a00000000000000000000100000000000000000000000100000000");
  Sh("cp big.qcow2 last.qcow2 && cp big.qcow2 ulast.qcow2");
  PatchHex(Path("last.qcow2"), 0x800008, "8000000080000000");
  Outcome o = CompareWithQemu("last.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR offset=a00000: Allocated cluster has "
                          "corrupted subcluster allocation bitmap"));
  CompareAllModes("last.qcow2");
  PatchHex(Path("ulast.qcow2"), 0x800018, "0000000180000000");
  o = CompareWithQemu("ulast.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR: Unallocated cluster has non-zero "
                          "subcluster allocation map"));
  CompareAllModes("ulast.qcow2");

  Sh("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=128k "
     "sn.qcow2 64M");
  Sh("qemu-io -c 'write -P 1 0 4k' sn.qcow2 >/dev/null");
  Sh("qemu-img snapshot -c first sn.qcow2");
  Sh("qemu-io -c 'write -P 2 0 4k' sn.qcow2 >/dev/null");
  ASSERT_EQ(HexAt("sn.qcow2", 0x80000, 16), "00000000000a00000000000000000001");
  ASSERT_EQ(HexAt("sn.qcow2", 0x100000, 8), "8000000000120000");
  PatchHex(Path("sn.qcow2"), 0x80008, "0000000100000001");
  o = CompareWithQemu("sn.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR offset=a0000: Allocated cluster has "
                          "corrupted subcluster allocation bitmap"));
  EXPECT_EQ(o.result.corruptions, 1u);
  CompareAllModes("sn.qcow2");
}

// Recipe: the L1 table placed on the refcount table's cluster (two tables
// on one cluster).
TEST_F(CheckTest, OverlappingMetadata) {
  MakeBaseImage("ov.qcow2");
  PatchHex(Path("ov.qcow2"), 40, "0000000000010000");  // l1_table_offset
  CompareAllModes("ov.qcow2");
}

// Recipes on an image with two snapshots (snapshot table at 0xd0000:
// entry 0 "first" with its L1 table at 0x80000, entry 1 "second" at
// 0xd0048): a misaligned snapshot L1 table offset, and an L1 size above
// QEMU's limit. Their clusters then look leaked.
TEST_F(CheckTest, SnapshotTableEntryErrors) {
  MakeBaseImage("sn.qcow2");
  Sh("qemu-img snapshot -c first sn.qcow2");
  Sh("qemu-io -c 'write -P 5 0 64k' sn.qcow2 >/dev/null");
  Sh("qemu-img snapshot -c second sn.qcow2");
  ASSERT_EQ(HexAt("sn.qcow2", 64, 8), "00000000000d0000");
  Sh("cp sn.qcow2 sn1.qcow2 && cp sn.qcow2 sn2.qcow2");
  PatchHex(Path("sn1.qcow2"), 0xd0000, "0000000000080200");
  Outcome o = CompareWithQemu("sn1.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.messages.front(),
            "ERROR snapshot 1 (first) l1_offset=0x80200: L1 table is not "
            "cluster aligned; snapshot table entry corrupted");
  EXPECT_EQ(o.result.leaks, 5u);
  CompareAllModes("sn1.qcow2");

  PatchHex(Path("sn2.qcow2"), 0xd0048 + 8, "00800000");
  o = CompareWithQemu("sn2.qcow2", RepairMode::kNone);
  EXPECT_EQ(o.messages.front(),
            "ERROR snapshot 2 (second) l1_size=0x800000: L1 table is too "
            "large; snapshot table entry corrupted");
  CompareAllModes("sn2.qcow2");
}

// Recipe: the snapshot table's offset (64) at 0x7fffffffffff0000, aligned
// and valid to qcow2_validate_table but past QEMU's BDRV_MAX_LENGTH
// (2^63 - 2^30): the read fails with EIO, and check in every mode reports
// it as qcow2_check_read_snapshot_table does ("Check failed: Input/output
// error", no report). testdata/fuzz/qcow2/sn_table_offset_huge.qcow2.
TEST_F(CheckTest, SnapshotTablePastTheLargestRequest) {
  MakeBaseImage("far.qcow2");
  Sh("qemu-img snapshot -c first far.qcow2");
  PatchHex(Path("far.qcow2"), 64, "7fffffffffff0000");
  Outcome o = CompareWithQemu("far.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("imgtool: ERROR failed to read the snapshot table: "
                          "Failed to read snapshot table: Input/output "
                          "error"));
  EXPECT_EQ(o.status.message(), "Check failed: Input/output error");
  CompareAllModes("far.qcow2");
  // An offset QEMU reads: an entry of zeroes, far past the end. (-r all
  // differs: QEMU's free of the old table there fails with EFBIG, ours
  // with EINVAL; left for later.)
  PatchHex(Path("far.qcow2"), 64, "7fffffffbfff0000");
  CompareWithQemu("far.qcow2", RepairMode::kNone);
  CompareWithQemu("far.qcow2", RepairMode::kLeaks);
}

// Recipe: the active L2 table moved onto the refcount block's cluster (L1
// entry 0 -> 0x20000): one cluster used as two tables.
TEST_F(CheckTest, L2TableOnRefcountBlock) {
  MakeBaseImage("ov2.qcow2");
  PatchHex(Path("ov2.qcow2"), 0x30000, "8000000000020000");
  Outcome o = CompareWithQemu("ov2.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ::testing::Contains("ERROR refcount block 0 refcount=2"));
  EXPECT_THAT(o.messages,
              ::testing::Contains("ERROR cluster 2 refcount=1 reference=2"));
  CompareAllModes("ov2.qcow2");
}

// Crash-safe order of a rebuild (zero refcount of data cluster 5): the
// new refcount block (cluster 8; written again once the table's cluster is
// counted in it) and table (cluster 9) are durable before
// the header points to them (12 bytes at 0x30); the old table and block
// (clusters 1-2) are freed on disk, flushed, and only then discarded.
TEST_F(CheckTest, RebuildWritesInCrashSafeOrder) {
  MakeBaseImage("order.qcow2");
  PatchHex(Path("order.qcow2"), 0x20000 + 2 * 5, "0000");
  EXPECT_THAT(
      RepairTrace(Path("order.qcow2"), RepairMode::kAll),
      ElementsAre("W 80000+10000", "W 80000+10000", "W 90000+10000", "F",
                  "W 30+c", "F", "W 80000+10000", "F", "D 10000+20000"));
  EXPECT_EQ(QemuCheck("order.qcow2"), 0);
}

// Crash-safe order of refcount and COPIED repairs (two L2 entries sharing
// cluster 5): the refcount block is written and flushed before the L2
// table's COPIED flags change, and the freed cluster 6 is discarded only
// after its refcount 0 is on disk.
TEST_F(CheckTest, CopiedFlagsChangeAfterRefcountsAreDurable) {
  MakeBaseImage("order.qcow2");
  PatchHex(Path("order.qcow2"), 0x40008, "8000000000050000");
  EXPECT_THAT(
      RepairTrace(Path("order.qcow2"), RepairMode::kAll),
      ElementsAre("W 20000+10000", "F", "D 60000+10000", "W 40000+10000"));
  EXPECT_EQ(QemuCheck("order.qcow2"), 0);
}

TEST_F(CheckTest, NotQcow2) {
  Sh("truncate -s 1M raw.img");
  Outcome o = CheckFile(Path("raw.img"), RepairMode::kNone);
  EXPECT_EQ(o.status.message(),
            absl::StrCat("Could not open '", Path("raw.img"),
                         "': Image is not in qcow2 format"));
}

// RebuildRefcounts (a dirty lazy-refcounts image opened for writing):
// repairs the refcounts and clears the dirty bit, like QEMU's open does.
TEST_F(CheckTest, RebuildRefcountsRepairsDirtyImage) {
  Sh("qemu-img create -q -f qcow2 -o lazy_refcounts=on dirty.qcow2 64M");
  Sh("qemu-io -c 'write -P 1 0 128k' dirty.qcow2 >/dev/null");
  PatchHex(Path("dirty.qcow2"), 0x20000 + 2 * 6, "0000");  // used: too low
  PatchHex(Path("dirty.qcow2"), 79, "01");                 // dirty bit
  absl::StatusOr<std::unique_ptr<io::Engine>> engine =
      io::CreateEngine(io::EngineKind::kAuto, 4, nullptr);
  ASSERT_TRUE(engine.ok());
  posix_file::FileOpenOptions options;
  options.set_filename(Path("dirty.qcow2"));
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(**engine, options, nullptr);
  ASSERT_TRUE(file.ok()) << file.status();
  std::ostringstream messages;
  absl::Status st = io::RunSync(**engine, RebuildRefcounts(**file, &messages));
  ASSERT_TRUE(st.ok()) << st;
  ASSERT_TRUE(io::RunSync(**engine, (*file)->Close()).ok());
  EXPECT_THAT(Lines(messages.str()),
              ::testing::Contains("Rebuilding refcount structure"));
  EXPECT_EQ(QemuCheck("dirty.qcow2"), 0);
  EXPECT_EQ(HexAt("dirty.qcow2", 72, 8), "0000000000000000");
}

// One snapshot table entry as stored: the 40-byte fixed part (its three
// size fields are rewritten from the other parts), the extra data, the id
// and the name. Raw bytes, so that entries with under 24 bytes of extra
// data (which format::EncodeSnapshotTable cannot write) can be made.
struct RawSnapshot {
  std::vector<uint8_t> header, extra, id, name;
};

uint64_t GetBE(const std::vector<uint8_t>& d, uint64_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | d[at + i];
  return v;
}

void PutBE(std::vector<uint8_t>& d, uint64_t at, int n, uint64_t v) {
  for (int i = n - 1; i >= 0; --i, v >>= 8) d[at + i] = v & 0xff;
}

// Reads the snapshot table of `path` (nb_snapshots at 60, the offset at
// 64), lets `edit` change its entries, and writes the table back in place,
// each entry 8-byte aligned as QEMU lays them out (the bytes after a
// shorter table stay as they were; a longer one may grow the file), as
// snapshot_oracle_test's faulty() does.
void EditSnapshotTable(
    const std::string& path,
    const std::function<void(std::vector<RawSnapshot>&)>& edit) {
  std::vector<uint8_t> d = testing::ReadFile(path);
  const uint64_t nb = GetBE(d, 60, 4);
  const uint64_t offset = GetBE(d, 64, 8);
  std::vector<RawSnapshot> table;
  uint64_t p = offset;
  auto take = [&](uint64_t n) {
    std::vector<uint8_t> part(d.begin() + p, d.begin() + p + n);
    p += n;
    return part;
  };
  for (uint64_t i = 0; i < nb; ++i) {
    p = (p + 7) & ~uint64_t{7};
    const uint64_t id_size = GetBE(d, p + 12, 2);
    const uint64_t name_size = GetBE(d, p + 14, 2);
    const uint64_t extra_size = GetBE(d, p + 36, 4);
    RawSnapshot e;
    e.header = take(40);
    e.extra = take(extra_size);
    e.id = take(id_size);
    e.name = take(name_size);
    table.push_back(std::move(e));
  }
  edit(table);
  std::vector<uint8_t> out;
  for (RawSnapshot& e : table) {
    out.resize((out.size() + 7) & ~size_t{7});
    PutBE(e.header, 12, 2, e.id.size());
    PutBE(e.header, 14, 2, e.name.size());
    PutBE(e.header, 36, 4, e.extra.size());
    for (const std::vector<uint8_t>* part : {&e.header, &e.extra, &e.id, &e.name}) {
      out.insert(out.end(), part->begin(), part->end());
    }
  }
  if (d.size() < offset + out.size()) d.resize(offset + out.size());
  std::copy(out.begin(), out.end(), d.begin() + offset);
  testing::WriteFile(path, d);
}

// The faults of snapshot_oracle_test's faulty() (QEMU 7.2's
// qcow2_read_snapshots, qcow2_check_read_snapshot_table and
// qcow2_check_fix_snapshot_table), each on the image of
// SnapshotTableEntryErrors ("first" at 0xd0000, "second" at 0xd0048, 24
// bytes of extra data each): check's lines and counts in every mode, the
// file after -r leaks and -r all byte-identical to qemu-img's, and qemu-img
// check of our repaired file as clean as of QEMU's.
class SnapshotTableFaultTest : public CheckTest {
 protected:
  // The image with two snapshots, then `edit` applied to its table.
  void MakeFaulty(const std::string& name,
                  const std::function<void(std::vector<RawSnapshot>&)>& edit) {
    MakeBaseImage(name);
    Sh("qemu-img snapshot -c first " + name);
    Sh("qemu-io -c 'write -P 5 0 64k' " + name + " >/dev/null");
    Sh("qemu-img snapshot -c second " + name);
    ASSERT_EQ(HexAt(name, 60, 12), "00000002" "00000000000d0000");
    if (edit) EditSnapshotTable(Path(name), edit);
  }

  // -r all on a copy; then qemu-img check's exit code of our file (and
  // expects QEMU's own repaired copy to give the same).
  int CheckAfterRepair(const std::string& name) {
    CompareWithQemu(name, RepairMode::kAll);
    const int ours = QemuCheck(name + ".ours");
    EXPECT_EQ(ours, QemuCheck(name + ".qemu"));
    return ours;
  }
};

// Entry 1 with 2000 bytes of extra data (QEMU's limit is 1024): no report
// ("Check failed: File too large"); -r all cuts it to 1024.
TEST_F(SnapshotTableFaultTest, ExtraDataTooBig) {
  MakeFaulty("big.qcow2", [](std::vector<RawSnapshot>& t) {
    t[1].extra.resize(2000);
  });
  Outcome o = CompareWithQemu("big.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("imgtool: ERROR failed to read the snapshot table: "
                          "Too much extra metadata in snapshot table entry 1",
                          "You can force-remove this extra metadata with "
                          "qemu-img check -r all"));
  EXPECT_EQ(o.status.message(), "Check failed: File too large");
  CompareWithQemu("big.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("big.qcow2", RepairMode::kAll);
  EXPECT_THAT(o.messages,
              ::testing::Contains("Discarding too much extra metadata in "
                                  "snapshot table entry 1 (2000 > 1024)"));
  EXPECT_EQ(o.result.corruptions_fixed, 1u);
  EXPECT_EQ(CheckAfterRepair("big.qcow2"), 0);
}

// A v3 image whose entries have 0 and 8 bytes of extra data (16 needed):
// two corruptions; -r all rewrites the table with the fields filled in.
TEST_F(SnapshotTableFaultTest, V3ExtraDataTooShort) {
  MakeFaulty("short.qcow2", [](std::vector<RawSnapshot>& t) {
    t[0].extra.clear();
    t[1].extra.resize(8);
  });
  Outcome o = CompareWithQemu("short.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ElementsAre("ERROR snapshot table entry 0 is incomplete",
                          "ERROR snapshot table entry 1 is incomplete"));
  EXPECT_EQ(o.result.corruptions, 2u);
  CompareWithQemu("short.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("short.qcow2", RepairMode::kAll);
  EXPECT_EQ(o.result.corruptions_fixed, 2u);
  EXPECT_EQ(CheckAfterRepair("short.qcow2"), 0);
}

// Entry 0's L1 table offset moved into its cluster (0x80200).
TEST_F(SnapshotTableFaultTest, L1TableUnaligned) {
  MakeFaulty("l1u.qcow2", [](std::vector<RawSnapshot>& t) {
    PutBE(t[0].header, 0, 8, GetBE(t[0].header, 0, 8) + 0x200);
  });
  Outcome o = CompareWithQemu("l1u.qcow2", RepairMode::kNone);
  ASSERT_FALSE(o.messages.empty());
  EXPECT_EQ(o.messages.front(),
            "ERROR snapshot 1 (first) l1_offset=0x80200: L1 table is not "
            "cluster aligned; snapshot table entry corrupted");
  EXPECT_EQ(o.result.corruptions, 1u);
  CompareWithQemu("l1u.qcow2", RepairMode::kLeaks);
  CheckAfterRepair("l1u.qcow2");
}

// Entry 1's L1 size 0x10000000 (above QEMU's 32 MiB L1 limit): its
// clusters look leaked; -r all repairs the refcounts but not the entry.
TEST_F(SnapshotTableFaultTest, L1TableTooLarge) {
  MakeFaulty("l1h.qcow2", [](std::vector<RawSnapshot>& t) {
    PutBE(t[1].header, 8, 4, 0x10000000);
  });
  Outcome o = CompareWithQemu("l1h.qcow2", RepairMode::kNone);
  ASSERT_FALSE(o.messages.empty());
  EXPECT_EQ(o.messages.front(),
            "ERROR snapshot 2 (second) l1_size=0x10000000: L1 table is too "
            "large; snapshot table entry corrupted");
  EXPECT_EQ(o.result.corruptions, 1u);
  EXPECT_EQ(o.result.leaks, 5u);
  CompareWithQemu("l1h.qcow2", RepairMode::kLeaks);
  EXPECT_EQ(CheckAfterRepair("l1h.qcow2"), 2);
}

// The table moved past the end of the file (16 MiB): two empty entries,
// the table's range past the end, the snapshots' clusters leaked; -r all
// writes a new table (the old one's free fails: "qcow2_free_clusters
// failed: Invalid argument").
TEST_F(SnapshotTableFaultTest, TablePastTheEndOfTheFile) {
  MakeFaulty("eof.qcow2", nullptr);
  PatchHex(Path("eof.qcow2"), 64, "0000000001000000");
  Outcome o = CompareWithQemu("eof.qcow2", RepairMode::kNone);
  EXPECT_THAT(o.messages,
              ::testing::IsSupersetOf(
                  {"ERROR snapshot table entry 0 is incomplete",
                   "ERROR snapshot table entry 1 is incomplete",
                   "ERROR: counting reference for region exceeding the end "
                   "of the file by one cluster or more: offset 0x1000000 "
                   "size 0x50"}));
  EXPECT_EQ(o.result.corruptions, 3u);
  EXPECT_EQ(o.result.leaks, 9u);
  CompareWithQemu("eof.qcow2", RepairMode::kLeaks);
  o = CompareWithQemu("eof.qcow2", RepairMode::kAll);
  EXPECT_THAT(o.messages,
              ::testing::Contains("qcow2_free_clusters failed: Invalid "
                                  "argument"));
  EXPECT_EQ(CheckAfterRepair("eof.qcow2"), 0);
}

}  // namespace
}  // namespace imgtool::qcow2
