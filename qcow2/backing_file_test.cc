// Qcow2Node::ChangeBackingFile against `qemu-img rebase -u` (QEMU 7.2's
// qcow2_change_backing_file): the same header bytes for every header
// layout, nothing written when the name does not fit, and the header
// written only after the data before it is flushed.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::FirstDifference;
using testing::ReadAll;
using testing::Shell;
using testing::ShellResult;
using testing::TempPath;

class BackingFileTest : public ::testing::Test {
 protected:
  // qemu-img create -f qcow2 -o OPTIONS PATH 1M, as PATH and PATH.qemu.
  std::string CreatePair(const std::string& name, const std::string& options) {
    const std::string path = TempPath(name);
    ShellResult r = Shell(absl::StrCat("rm -f ", path, " ", path,
                                       ".qemu && qemu-img create -q -f qcow2 ",
                                       options.empty() ? "" : "-o " + options,
                                       " ", path, " 1M && cp ", path, " ", path,
                                       ".qemu"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return path;
  }

  // Opens `path` read-write without opening a backing file (qemu-img
  // rebase -u opens it so).
  std::unique_ptr<Qcow2Node> Open(const std::string& path,
                                  bool read_only = false) {
    auto file = env_.OpenFile(path, read_only);
    EXPECT_TRUE(file.ok()) << file.status();
    if (!file.ok()) return nullptr;
    auto node = env_.Run(
        Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), nullptr));
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? *std::move(node) : nullptr;
  }

  absl::Status Change(const std::string& path, std::optional<std::string> name,
                      std::optional<std::string> format) {
    std::unique_ptr<Qcow2Node> node = Open(path);
    if (node == nullptr) return absl::InternalError("open failed");
    absl::Status st = env_.Run(
        node->ChangeBackingFile(std::move(name), std::move(format)));
    absl::Status closed = env_.Run(node->Close());
    return st.ok() ? closed : st;
  }

  // qemu-img rebase -u ARGS on PATH.qemu.
  void QemuRebase(const std::string& path, const std::string& args) {
    ShellResult r = Shell(
        absl::StrCat("qemu-img rebase -u ", args, " ", path, ".qemu 2>&1"));
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }

  Env env_;
};

// Set, change, change the format only, and clear, over header layouts
// that put the name in different places: v3 with the feature table (64k,
// 2M), without it (4k, 512), v2 (72-byte header), extended L2.
TEST_F(BackingFileTest, SameHeaderAsQemuImgRebaseUnsafe) {
  const std::vector<std::string> layouts = {
      "",
      "cluster_size=2M",
      "cluster_size=4k",
      "cluster_size=512",
      "compat=0.10",
      "compat=0.10,cluster_size=512",
      "extended_l2=on,cluster_size=128k",
      "lazy_refcounts=on",
  };
  int i = 0;
  for (const std::string& options : layouts) {
    SCOPED_TRACE(options);
    const std::string path = CreatePair(absl::StrCat("bf", i++, ".qcow2"), options);
    ASSERT_TRUE(Change(path, "base.qcow2", "qcow2").ok());
    QemuRebase(path, "-b base.qcow2 -F qcow2");
    EXPECT_EQ(FirstDifference(path, path + ".qemu"), -1) << "set";

    const std::string longer = "sub/dir/a-much-longer-backing-file-name.raw";
    ASSERT_TRUE(Change(path, longer, "raw").ok());
    QemuRebase(path, "-b " + longer + " -F raw");
    EXPECT_EQ(FirstDifference(path, path + ".qemu"), -1) << "change";

    ASSERT_TRUE(Change(path, "b", "qcow2").ok());
    QemuRebase(path, "-b b -F qcow2");
    EXPECT_EQ(FirstDifference(path, path + ".qemu"), -1) << "shorten";

    ASSERT_TRUE(Change(path, std::nullopt, std::nullopt).ok());
    QemuRebase(path, "-b ''");
    EXPECT_EQ(FirstDifference(path, path + ".qemu"), -1) << "clear";
  }
}

// A name that fits in 64k clusters but not in the 512-byte cluster 0 after
// the header and the backing format extension: ENOSPC in QEMU, and the
// image is left as it was.
TEST_F(BackingFileTest, NameThatDoesNotFitChangesNothing) {
  const std::string path = CreatePair("nofit.qcow2", "cluster_size=512");
  ASSERT_TRUE(Change(path, "old.qcow2", "qcow2").ok());
  const std::string before = ReadAll(path);
  // 112-byte header + 16-byte format extension + 8-byte end marker: 376
  // bytes are left.
  absl::Status st = Change(path, std::string(377, 'n'), "qcow2");
  EXPECT_TRUE(absl::IsResourceExhausted(st)) << st;
  EXPECT_EQ(st.message(), path + ": No space left in the file header");
  EXPECT_EQ(ReadAll(path), before);
  // 376 bytes fit, byte-identical to qemu-img's.
  ASSERT_TRUE(Change(path, std::string(376, 'n'), "qcow2").ok());
  QemuRebase(path, "-b old.qcow2 -F qcow2");
  QemuRebase(path, "-b " + std::string(376, 'n') + " -F qcow2");
  EXPECT_EQ(FirstDifference(path, path + ".qemu"), -1);
}

TEST_F(BackingFileTest, RefusesTooLongNamesAndReadOnlyImages) {
  const std::string path = CreatePair("long.qcow2", "");
  const std::string before = ReadAll(path);
  absl::Status st = Change(path, std::string(1024, 'x'), "raw");
  EXPECT_TRUE(absl::IsInvalidArgument(st)) << st;
  EXPECT_EQ(ReadAll(path), before);
  // 1023 bytes is QEMU's limit and fits in 64 KiB clusters.
  EXPECT_TRUE(Change(path, std::string(1023, 'x'), "raw").ok());

  std::unique_ptr<Qcow2Node> node = Open(path, /*read_only=*/true);
  ASSERT_NE(node, nullptr);
  st = env_.Run(node->ChangeBackingFile("y", "raw"));
  EXPECT_TRUE(absl::IsFailedPrecondition(st)) << st;
  EXPECT_TRUE(env_.Run(node->Close()).ok());
}

// Records the requests a qcow2 node sends to its file: 'W' a write,
// 'H' a write at offset 0 (the header), 'F' a flush.
class OpLetters final : public testing::ForwardingNode {
 public:
  OpLetters(std::unique_ptr<io::BlockNode> target, std::string* ops)
      : ForwardingNode(std::move(target)), ops_(ops) {}

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    *ops_ += offset == 0 ? 'H' : 'W';
    return ForwardingNode::DoWrite(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    *ops_ += 'W';
    return ForwardingNode::DoWriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoFlush() override {
    *ops_ += 'F';
    return ForwardingNode::DoFlush();
  }

 private:
  std::string* ops_;
};

// Safe rebase writes data, then changes the header: the data and the L2
// table pointing at it are durable before the header names the new
// backing file, which is one write of the first cluster, then synced.
TEST_F(BackingFileTest, HeaderIsWrittenOnceAfterTheDataIsFlushed) {
  const std::string path = CreatePair("order.qcow2", "cluster_size=4k");
  std::string ops;
  {
    auto file = env_.OpenFile(path, /*read_only=*/false);
    ASSERT_TRUE(file.ok()) << file.status();
    auto recorded = std::make_unique<OpLetters>(*std::move(file), &ops);
    auto node = env_.Run(
        Qcow2Node::Open(std::move(recorded), Qcow2OpenOptions(), nullptr));
    ASSERT_TRUE(node.ok()) << node.status();
    std::vector<uint8_t> data(8192, 0x5a);
    ASSERT_TRUE(env_.Run((*node)->Write(4096, io::ConstIoVec(data))).ok());
    const size_t before = ops.size();
    ASSERT_TRUE(env_.Run((*node)->ChangeBackingFile("b.raw", "raw")).ok());
    const std::string change = ops.substr(before);
    SCOPED_TRACE(ops);
    // Whatever was still cached goes out and is synced, then the header.
    const size_t header = change.find('H');
    ASSERT_NE(header, std::string::npos);
    EXPECT_EQ(change.find('H', header + 1), std::string::npos);
    ASSERT_GT(header, 0u);
    EXPECT_EQ(change[header - 1], 'F');
    EXPECT_EQ(change.substr(header), "HF");
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
  }
  ShellResult r = Shell(absl::StrCat("qemu-img create -q -f raw ",
                                     TempPath("b.raw"), " 1M && ",
                                     "qemu-img info --output=json ", path,
                                     " | grep -c '\"backing-filename\": \"b.raw\"'"
                                     " && qemu-img check ", path));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

}  // namespace
}  // namespace imgtool::qcow2
