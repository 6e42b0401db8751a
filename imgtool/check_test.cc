// RunCheck called directly, against `qemu-img check` 7.2 on copies of the
// same files under the same name: stdout must be identical, stderr the same
// lines (as a multiset, with "qemu-img" read as "imgtool"), and the exit
// code the same. Broken images are made from qemu-img-created ones by
// patching bytes; the recipe is in each test.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "imgtool/command.h"
#include "imgtool/testing/command_runner.h"
#include "io/engine.h"
#include "posix_file/file_node.h"
#include "qcow2/test_util.h"

namespace imgtool::cli {
namespace {

using testing::CommandResult;
using ::testing::UnorderedElementsAreArray;

using Shell = qcow2::testing::ShellOutput;
using qcow2::testing::PatchHex;
using qcow2::testing::ReadAll;
using qcow2::testing::RunShell;

// What main prints on stderr: an empty message (exit codes 2 and 3) is
// not printed.
std::string StderrText(const CommandResult& r) {
  return r.status.message().empty() ? r.err : r.stderr_text();
}

std::vector<std::string> Lines(const std::string& text) {
  std::vector<std::string> lines;
  for (absl::string_view l : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    lines.emplace_back(l);
  }
  return lines;
}

// Each test works in <root>/work (the image is made there), and compares
// in <root>/qemu and <root>/ours, each holding a copy of the image.
class CheckCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = testing::MakeTestDir();
    for (const char* d : {"work", "qemu", "ours"}) {
      std::filesystem::create_directories(root_ + "/" + d);
    }
  }
  void TearDown() override { EXPECT_EQ(chdir("/"), 0); }

  std::string Work(const std::string& name = "") const {
    return root_ + "/work" + (name.empty() ? "" : "/" + name);
  }

  void Sh(const std::string& command) {
    Shell r = RunShell(Work(), command);
    ASSERT_EQ(r.rc, 0) << command << "\n" << r.out << r.err;
  }

  // The standard 64 MiB image, 64 KiB clusters: header 0, reftable 1,
  // refblock 2 (16-bit refcounts), L1 3, L2 4, data clusters 5 (guest 0),
  // 6 (guest 64k), 7 (guest 1 MiB).
  void MakeBaseImage(const std::string& name) {
    Sh("qemu-img create -q -f qcow2 " + name + " 64M");
    Sh("qemu-io -c 'write -P 1 0 128k' -c 'write -P 2 1M 64k' " + name +
       " >/dev/null");
  }

  // Copies work/<name> to qemu/ and ours/ (if it exists; not if `copy` is
  // false: the copies are there already), runs `qemu-img
  // check <args> <name>` in qemu/ and RunCheck(<args> <name>) in ours/,
  // and compares. Returns our result.
  CommandResult Compare(const std::vector<std::string>& args,
                        const std::string& name, bool copy = true) {
    for (const char* d : {"qemu", "ours"}) {
      if (!copy) break;
      const std::string to = root_ + "/" + d + "/" + name;
      std::filesystem::remove(to);
      if (std::filesystem::exists(Work(name))) {
        std::filesystem::copy_file(Work(name), to);
      }
    }
    std::vector<std::string> quoted;
    for (const std::string& a : args) quoted.push_back("'" + a + "'");
    Shell q = RunShell(root_ + "/qemu", absl::StrCat("qemu-img check ",
                                                     absl::StrJoin(quoted, " "),
                                                     " '", name, "'"));
    EXPECT_EQ(chdir((root_ + "/ours").c_str()), 0);
    std::vector<std::string> full = args;
    full.push_back(name);
    CommandResult r = testing::RunCommand(RunCheck, full);
    const std::string what = absl::StrJoin(full, " ");
    EXPECT_EQ(r.out, q.out) << what;
    const std::string qemu_err =
        absl::StrReplaceAll(q.err, {{"qemu-img", "imgtool"}});
    EXPECT_THAT(Lines(StderrText(r)),
                UnorderedElementsAreArray(Lines(qemu_err)))
        << what << "\nqemu-img said:\n"
        << q.err;
    EXPECT_EQ(ExitCodeOf(r.status), q.rc) << what << ": " << r.status;
    return r;
  }

  // qemu-img check exit code of ours/<name> (after a repair by us).
  int QemuCheckOurs(const std::string& name) {
    return RunShell(root_ + "/ours", "qemu-img check '" + name + "'").rc;
  }

  std::string root_;
};

TEST_F(CheckCommandTest, CleanImage) {
  MakeBaseImage("x.qcow2");
  CommandResult r = Compare({}, "x.qcow2");
  EXPECT_EQ(r.out,
            "No errors were found on the image.\n"
            "3/1024 = 0.29% allocated, 0.00% fragmented, 0.00% compressed "
            "clusters\n"
            "Image end offset: 524288\n");
  r = Compare({"--output=json"}, "x.qcow2");
  EXPECT_EQ(r.out,
            "{\n"
            "    \"image-end-offset\": 524288,\n"
            "    \"total-clusters\": 1024,\n"
            "    \"check-errors\": 0,\n"
            "    \"allocated-clusters\": 3,\n"
            "    \"filename\": \"x.qcow2\",\n"
            "    \"format\": \"qcow2\"\n"
            "}\n");
  r = Compare({"-q"}, "x.qcow2");
  EXPECT_EQ(r.out, "");
  Compare({"-f", "qcow2", "-U", "-T", "none"}, "x.qcow2");
  Compare({"-r", "all", "--output", "json"}, "x.qcow2");
}

TEST_F(CheckCommandTest, EmptyAndFragmentedImages) {
  Sh("qemu-img create -q -f qcow2 empty.qcow2 0");
  Compare({}, "empty.qcow2");
  Compare({"--output=json"}, "empty.qcow2");
  Sh("qemu-img create -q -f qcow2 -o cluster_size=4k frag.qcow2 16M");
  Sh("qemu-io -c 'write -P 1 1M 4k' -c 'write -P 2 0 4k' "
     "-c 'write -c -P 3 2M 4k' -c 'write -P 4 4k 4k' frag.qcow2 >/dev/null");
  CommandResult r = Compare({}, "frag.qcow2");
  EXPECT_EQ(Lines(r.out)[1],
            "4/4096 = 0.10% allocated, 75.00% fragmented, 25.00% compressed "
            "clusters");
  Compare({"--output=json"}, "frag.qcow2");
}

// Recipe: grow the file by one cluster and give that cluster refcount 1.
TEST_F(CheckCommandTest, LeakedCluster) {
  MakeBaseImage("x.qcow2");
  Sh("truncate -s 589824 x.qcow2");
  PatchHex(Work("x.qcow2"), 0x20000 + 2 * 8, "0001");
  CommandResult r = Compare({}, "x.qcow2");
  EXPECT_EQ(ExitCodeOf(r.status), 3);
  EXPECT_EQ(r.out,
            "\n1 leaked clusters were found on the image.\n"
            "This means waste of disk space, but no harm to data.\n"
            "3/1024 = 0.29% allocated, 0.00% fragmented, 0.00% compressed "
            "clusters\n"
            "Image end offset: 589824\n");
  EXPECT_EQ(StderrText(r), "Leaked cluster 8 refcount=1 reference=0\n");
  Compare({"--output=json"}, "x.qcow2");
  Compare({"-q"}, "x.qcow2");
  r = Compare({"-r", "leaks"}, "x.qcow2");
  EXPECT_EQ(r.out,
            "The following inconsistencies were found and repaired:\n\n"
            "    1 leaked clusters\n"
            "    0 corruptions\n\n"
            "Double checking the fixed image now...\n"
            "No errors were found on the image.\n"
            "3/1024 = 0.29% allocated, 0.00% fragmented, 0.00% compressed "
            "clusters\n"
            "Image end offset: 524288\n");
  EXPECT_EQ(QemuCheckOurs("x.qcow2"), 0);
  Compare({"-r", "all", "--output=json"}, "x.qcow2");
  EXPECT_EQ(QemuCheckOurs("x.qcow2"), 0);
}

// Recipe: refcount of data cluster 5 lowered to 0 and of data cluster 7
// raised to 2, plus a compressed cluster: corruptions, a leak, and every
// JSON key qemu-img prints.
TEST_F(CheckCommandTest, CorruptionsAndRebuild) {
  MakeBaseImage("x.qcow2");
  Sh("qemu-io -c 'write -c -P 3 2M 64k' -c 'write -P 4 3M 64k' x.qcow2 "
     ">/dev/null");
  Sh("cp x.qcow2 before.qcow2");
  PatchHex(Work("x.qcow2"), 0x20000 + 2 * 7, "0002");
  PatchHex(Work("x.qcow2"), 0x20000 + 2 * 5, "0000");
  CommandResult r = Compare({}, "x.qcow2");
  EXPECT_EQ(ExitCodeOf(r.status), 2);
  r = Compare({"--output=json"}, "x.qcow2");
  EXPECT_EQ(r.out,
            "{\n"
            "    \"image-end-offset\": 655360,\n"
            "    \"compressed-clusters\": 1,\n"
            "    \"total-clusters\": 1024,\n"
            "    \"corruptions\": 3,\n"
            "    \"check-errors\": 0,\n"
            "    \"leaks\": 1,\n"
            "    \"allocated-clusters\": 5,\n"
            "    \"filename\": \"x.qcow2\",\n"
            "    \"format\": \"qcow2\",\n"
            "    \"fragmented-clusters\": 2\n"
            "}\n");
  // -r leaks: the refcount structure needs rebuilding, so it gives up.
  r = Compare({"-r", "leaks"}, "x.qcow2");
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.status.message(), "Check failed: Input/output error");
  r = Compare({"-r", "all"}, "x.qcow2");
  EXPECT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(QemuCheckOurs("x.qcow2"), 0);
  EXPECT_EQ(
      RunShell(root_ + "/ours", "qemu-img compare ../work/before.qcow2 x.qcow2")
          .rc,
      0);
  Compare({"-r", "all", "--output=json"}, "x.qcow2");
}

// Recipe: two L2 entries point at one cluster; L2 table misaligned; data
// cluster past the end of the file; reserved bits.
TEST_F(CheckCommandTest, L1AndL2EntryErrors) {
  const struct {
    const char* name;
    uint64_t offset;
    const char* bytes;
  } recipes[] = {
      {"shared.qcow2", 0x40008, "8000000000050000"},
      {"l2.qcow2", 0x30000, "8000000000040200"},
      {"eof.qcow2", 0x40000, "8000000100000000"},
      {"resv.qcow2", 0x40000, "8000000000050002"},
      {"l1resv.qcow2", 0x30000, "8100000000040000"},
  };
  for (const auto& recipe : recipes) {
    SCOPED_TRACE(recipe.name);
    MakeBaseImage(recipe.name);
    PatchHex(Work(recipe.name), recipe.offset, recipe.bytes);
    Compare({}, recipe.name);
    Compare({"--output=json"}, recipe.name);
    Compare({"-r", "leaks"}, recipe.name);
    Compare({"-r", "all"}, recipe.name);
  }
  EXPECT_EQ(QemuCheckOurs("shared.qcow2"), 0);
}

// Recipe: refcount table entry 1 -> 2^56, far past the end of the file.
TEST_F(CheckCommandTest, RefcountBlockFarPastEndOfFile) {
  MakeBaseImage("x.qcow2");
  PatchHex(Work("x.qcow2"), 0x10008, "0100000000000000");
  Compare({}, "x.qcow2");
  Compare({"-r", "leaks", "--output=json"}, "x.qcow2");
  Compare({"-r", "all"}, "x.qcow2");
  EXPECT_EQ(QemuCheckOurs("x.qcow2"), 0);
}

// Recipe: refcount table entry 0 -> 0x20200 (misaligned refcount block):
// the report is printed, then "Check failed" (exit 1).
TEST_F(CheckCommandTest, InternalErrors) {
  MakeBaseImage("x.qcow2");
  PatchHex(Work("x.qcow2"), 0x10000, "0000000000020200");
  CommandResult r = Compare({}, "x.qcow2");
  EXPECT_EQ(r.status.message(), "Check failed");
  Compare({"--output=json"}, "x.qcow2");
  Compare({"-r", "all"}, "x.qcow2");
}

TEST_F(CheckCommandTest, RawImagesHaveNoChecks) {
  Sh("truncate -s 1M x.raw");
  CommandResult r = Compare({}, "x.raw");
  EXPECT_EQ(ExitCodeOf(r.status), 63);
  Compare({"-f", "raw"}, "x.raw");
  Compare({"-r", "all"}, "x.raw");  // with the probing warning
  Compare({"-f", "qcow2"}, "x.raw");
  MakeBaseImage("x.qcow2");
  Compare({"-f", "raw"}, "x.qcow2");
  Compare({"-f", "foo"}, "x.qcow2");
}

// Another process writing the image (here: file nodes open read-write in
// this process, OFD locks): a raw image, or one checked as raw or file,
// still answers "does not support checks" (QEMU's raw format shares
// writes); a qcow2 image, probed or named, cannot be checked. Before,
// check took qcow2's locks before probing and failed on every image in use.
TEST_F(CheckCommandTest, ImageInUseByAWriter) {
  Sh("truncate -s 1M x.raw");
  MakeBaseImage("x.qcow2");
  auto engine = io::CreateEngine(io::EngineKind::kThreads, 1, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::vector<std::unique_ptr<posix_file::FileNode>> holders;
  for (const char* name : {"x.raw", "x.qcow2"}) {
    for (const char* d : {"qemu", "ours"}) {
      const std::string to = root_ + "/" + d + "/" + name;
      std::filesystem::copy_file(Work(name), to);
      posix_file::FileOpenOptions options;
      options.set_filename(to);
      options.set_read_only(false);
      auto holder = posix_file::FileNode::Open(**engine, options, nullptr);
      ASSERT_TRUE(holder.ok()) << holder.status();
      holders.push_back(*std::move(holder));
    }
  }
  EXPECT_EQ(ExitCodeOf(Compare({}, "x.raw", /*copy=*/false).status), 63);
  Compare({"-f", "raw"}, "x.raw", false);
  Compare({"-f", "file"}, "x.raw", false);
  Compare({"--image-opts"}, "driver=raw,file.filename=x.raw", false);
  Compare({"-f", "qcow2"}, "x.raw", false);
  EXPECT_THAT(Compare({}, "x.qcow2", false).stderr_text(),
              ::testing::HasSubstr("Failed to get shared \"write\" lock"));
  Compare({"-f", "qcow2"}, "x.qcow2", false);
  Compare({"-f", "raw"}, "x.qcow2", false);
  Compare({"-r", "leaks"}, "x.qcow2", false);
  Compare({"-U"}, "x.qcow2", false);
  for (auto& h : holders) ASSERT_TRUE(io::RunSync(**engine, h->Close()).ok());
}

TEST_F(CheckCommandTest, UsageErrors) {
  MakeBaseImage("x.qcow2");
  Compare({"-r", "foo"}, "x.qcow2");
  Compare({"--output=xml"}, "x.qcow2");
  Compare({"-T", "bogus"}, "x.qcow2");
  Compare({"-r", "all", "-U"}, "x.qcow2");
  Compare({}, "nonexist.qcow2");
  CommandResult r = testing::RunCommand(RunCheck, {});
  EXPECT_EQ(r.stderr_text(),
            "imgtool: Expecting one image file name\n"
            "Try 'imgtool --help' for more information\n");
}

}  // namespace
}  // namespace imgtool::cli
