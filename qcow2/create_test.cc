// CreateQcow2 against `qemu-img create -f qcow2`: the files must be
// byte-identical, and the option errors worded as qemu-img words them.
#include "qcow2/create.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::Shell;
using testing::TempPath;

struct Case {
  std::string name;
  std::string qemu_options;  // -o for qemu-img ("" = none)
  uint64_t size;
  Qcow2CreateOptions options;  // size filled in by the test
};

Qcow2CreateOptions Opts() { return Qcow2CreateOptions(); }

class CreateTest : public ::testing::Test {
 protected:
  // Creates `name` with both tools and compares the bytes.
  void ExpectSameAsQemu(const std::string& name, const std::string& qemu_options,
                        uint64_t size, Qcow2CreateOptions options) {
    const std::string ours = TempPath(name + ".ours.qcow2");
    const std::string theirs = TempPath(name + ".qemu.qcow2");
    options.set_size(size);
    {
      absl::StatusOr<std::unique_ptr<io::BlockNode>> file = env_.CreateEmpty(ours);
      ASSERT_TRUE(file.ok()) << file.status();
      absl::Status st = env_.Run(CreateQcow2(**file, options));
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(env_.Run((*file)->Close()).ok());
    }
    const std::string cmd = absl::StrCat(
        "cd ", TempPath(""), " && qemu-img create -q -f qcow2 ",
        qemu_options.empty() ? "" : "-o " + qemu_options + " ", theirs, " ",
        size);
    testing::ShellResult r = Shell(cmd);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(testing::FirstDifference(ours, theirs), -1) << name;
    testing::ShellResult check = Shell("qemu-img check " + ours);
    EXPECT_EQ(check.exit_code, 0) << check.output;
  }

  Env env_;
};

TEST_F(CreateTest, DefaultMatchesQemu) {
  ExpectSameAsQemu("default", "", uint64_t{1} << 30, Opts());
}

TEST_F(CreateTest, ClusterSizesMatchQemu) {
  for (uint64_t cs : {512, 4096, 65536, 2097152}) {
    Qcow2CreateOptions o;
    o.set_cluster_size(cs);
    ExpectSameAsQemu(absl::StrCat("cs", cs), absl::StrCat("cluster_size=", cs),
                     uint64_t{1} << 30, o);
  }
}

TEST_F(CreateTest, SmallClustersWithRefcountTableGrowthMatchQemu) {
  Qcow2CreateOptions o;
  o.set_cluster_size(512);
  o.set_refcount_bits(64);
  ExpectSameAsQemu("cs512rc64", "cluster_size=512,refcount_bits=64",
                   uint64_t{16} << 30, o);
}

TEST_F(CreateTest, UnalignedSizeIsRoundedUp) {
  ExpectSameAsQemu("odd", "", 1000, Opts());
}

TEST_F(CreateTest, Compat010MatchesQemu) {
  Qcow2CreateOptions o;
  o.set_compat("0.10");
  ExpectSameAsQemu("v2", "compat=0.10", 64 << 20, o);
}

TEST_F(CreateTest, ZstdCompressionTypeMatchesQemu) {
  Qcow2CreateOptions o;
  o.set_compression_type("zstd");
  ExpectSameAsQemu("zstd", "compression_type=zstd", 64 << 20, o);
  o.set_compression_type("zlib");
  ExpectSameAsQemu("zlib", "compression_type=zlib", 64 << 20, o);
  o.set_compression_type("zstd");
  o.set_extended_l2(true);
  o.set_preallocation("metadata");
  ExpectSameAsQemu("zstdext", "compression_type=zstd,extended_l2=on,preallocation=metadata",
                   9 << 20, o);
}

TEST_F(CreateTest, LazyRefcountsMatchQemu) {
  Qcow2CreateOptions o;
  o.set_lazy_refcounts(true);
  ExpectSameAsQemu("lazy", "lazy_refcounts=on", 64 << 20, o);
}

TEST_F(CreateTest, RefcountBitsMatchQemu) {
  for (uint32_t bits : {1, 8, 64}) {
    Qcow2CreateOptions o;
    o.set_refcount_bits(bits);
    ExpectSameAsQemu(absl::StrCat("rc", bits), absl::StrCat("refcount_bits=", bits),
                     uint64_t{1} << 30, o);
  }
}

TEST_F(CreateTest, BackingFileMatchesQemu) {
  ASSERT_EQ(Shell("qemu-img create -q -f raw " + TempPath("base.raw") + " 64M").exit_code, 0);
  Qcow2CreateOptions o;
  o.set_backing_file("base.raw");
  o.set_backing_fmt("raw");
  ExpectSameAsQemu("backed", "backing_file=base.raw,backing_fmt=raw", 64 << 20, o);
  Qcow2CreateOptions v2;
  v2.set_backing_file("base.raw");
  v2.set_backing_fmt("raw");
  v2.set_compat("0.10");
  ExpectSameAsQemu("backed_v2", "backing_file=base.raw,backing_fmt=raw,compat=0.10",
                   64 << 20, v2);
}

TEST_F(CreateTest, MetadataPreallocationMatchesQemu) {
  Qcow2CreateOptions o;
  o.set_preallocation("metadata");
  ExpectSameAsQemu("meta1g", "preallocation=metadata", uint64_t{1} << 30, o);
  // Past the first refcount block (2 GiB of host clusters).
  ExpectSameAsQemu("meta5g", "preallocation=metadata", uint64_t{5} << 30, o);
  Qcow2CreateOptions small = o;
  small.set_cluster_size(4096);
  ExpectSameAsQemu("meta4k", "preallocation=metadata,cluster_size=4096",
                   uint64_t{100} << 20, small);
  Qcow2CreateOptions tiny = o;
  tiny.set_cluster_size(512);
  ExpectSameAsQemu("meta512", "preallocation=metadata,cluster_size=512",
                   uint64_t{20} << 20, tiny);
  Qcow2CreateOptions huge = o;
  huge.set_cluster_size(2 << 20);
  ExpectSameAsQemu("meta2m", "preallocation=metadata,cluster_size=2M",
                   uint64_t{3} << 30, huge);
  Qcow2CreateOptions lazy = o;
  lazy.set_lazy_refcounts(true);
  ExpectSameAsQemu("metalazy", "preallocation=metadata,lazy_refcounts=on",
                   (64 << 20) + 1000, lazy);
}

TEST_F(CreateTest, DataPreallocationMatchesQemu) {
  for (const char* mode : {"falloc", "full"}) {
    Qcow2CreateOptions o;
    o.set_preallocation(mode);
    ExpectSameAsQemu(mode, absl::StrCat("preallocation=", mode), 64 << 20, o);
  }
  Qcow2CreateOptions two_tables;
  two_tables.set_preallocation("falloc");
  two_tables.set_cluster_size(4096);
  ExpectSameAsQemu("falloc4k", "preallocation=falloc,cluster_size=4096", 5 << 20,
                   two_tables);
  // Many refcount blocks and a refcount table that has to grow.
  Qcow2CreateOptions tiny;
  tiny.set_preallocation("falloc");
  tiny.set_cluster_size(512);
  tiny.set_refcount_bits(64);
  ExpectSameAsQemu("falloc512", "preallocation=falloc,cluster_size=512,refcount_bits=64",
                   4 << 20, tiny);
  Qcow2CreateOptions odd;
  odd.set_preallocation("full");
  ExpectSameAsQemu("fullodd", "preallocation=full", (3 << 20) + 1000, odd);
}

// What CreateQcow2 sends to its file, one letter a request: 'W' write or
// write zeroes, 'F' flush, 'P' a truncate that preallocates (falloc, full),
// 'T' any other truncate.
class OpLetters final : public testing::ForwardingNode {
 public:
  OpLetters(std::unique_ptr<io::BlockNode> target, std::string* ops)
      : ForwardingNode(std::move(target)), ops_(ops) {}

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    *ops_ += 'W';
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
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override {
    *ops_ += prealloc == io::PreallocMode::kFalloc ||
                     prealloc == io::PreallocMode::kFull
                 ? 'P'
                 : 'T';
    return ForwardingNode::DoTruncate(size, prealloc);
  }

 private:
  std::string* ops_;
};

// qemu-img create -o preallocation=falloc|full flushes its file after the
// metadata writes and before it preallocates the data area (strace of
// qemu-img 7.2: ... pwrite refcount table, fdatasync, pwrite header,
// fdatasync, fallocate(327680, 2097152) for 64 KiB clusters, 2048000
// bytes): the metadata blocks are placed on the disk first, and the file's
// extents come out as qemu-img's (iotest 125 counts the blocks a later
// write adds). Before, the flushes of the qcow2 node during create stopped
// short of the file, so the metadata stayed in the page cache while the
// data area was preallocated.
TEST_F(CreateTest, DataPreallocationSyncsMetadataFirstAsQemu) {
  for (const char* mode : {"falloc", "full"}) {
    const std::string path = TempPath(absl::StrCat("order_", mode, ".qcow2"));
    std::string ops;
    {
      absl::StatusOr<std::unique_ptr<io::BlockNode>> file = env_.CreateEmpty(path);
      ASSERT_TRUE(file.ok()) << file.status();
      OpLetters node(std::move(*file), &ops);
      Qcow2CreateOptions o;
      o.set_preallocation(mode);
      o.set_cluster_size(65536);
      o.set_size(2048000);
      absl::Status st = env_.Run(CreateQcow2(node, o));
      ASSERT_TRUE(st.ok()) << st;
      ASSERT_TRUE(env_.Run(node.Close()).ok());
    }
    SCOPED_TRACE(absl::StrCat(mode, ": ", ops));
    const size_t prealloc = ops.find('P');
    ASSERT_NE(prealloc, std::string::npos);
    EXPECT_EQ(ops.find('P', prealloc + 1), std::string::npos);
    // Every write before the preallocation is flushed before it.
    ASSERT_GT(prealloc, 0u);
    EXPECT_EQ(ops[prealloc - 1], 'F');
    EXPECT_NE(ops.find('W'), std::string::npos);
    EXPECT_LT(ops.find('W'), prealloc);
    // And the file is qemu-img's.
    const std::string theirs = TempPath(absl::StrCat("order_", mode, ".qemu.qcow2"));
    testing::ShellResult r = Shell(absl::StrCat(
        "qemu-img create -q -f qcow2 -o preallocation=", mode,
        ",cluster_size=65536 ", theirs, " 2048000"));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_EQ(testing::FirstDifference(path, theirs), -1);
  }
}

TEST_F(CreateTest, OptionErrorsUseQemuWording) {
  auto error = [](Qcow2CreateOptions o) {
    if (o.size() == 0) o.set_size(1 << 20);
    return std::string(CheckCreateOptions(o).status().message());
  };
  Qcow2CreateOptions o;
  o.set_compat("0.9");
  EXPECT_EQ(error(o), "Parameter 'version' does not accept value '0.9'");
  o = Opts();
  o.set_preallocation("foo");
  EXPECT_EQ(error(o), "Parameter 'preallocation' does not accept value 'foo'");
  o = Opts();
  o.set_cluster_size(1000);
  EXPECT_EQ(error(o), "Cluster size must be a power of two between 512 and 2048k");
  o = Opts();
  o.set_refcount_bits(3);
  EXPECT_EQ(error(o), "Refcount width must be a power of two and may not exceed 64 bits");
  o = Opts();
  o.set_compat("0.10");
  o.set_lazy_refcounts(true);
  EXPECT_EQ(error(o),
            "Lazy refcounts only supported with compatibility level 1.1 and "
            "above (use version=v3 or greater)");
  o = Opts();
  o.set_compression_type("ZSTD");
  EXPECT_EQ(error(o), "Parameter 'compression-type' does not accept value 'ZSTD'");
  o = Opts();
  o.set_compat("0.10");
  o.set_compression_type("zstd");
  EXPECT_EQ(error(o),
            "Non-zlib compression type is only supported with compatibility "
            "level 1.1 and above (use version=v3 or greater)");
  o = Opts();
  o.set_backing_fmt("raw");
  EXPECT_EQ(error(o), "Backing format cannot be used without backing file");
  o = Opts();
  o.set_backing_file("b");
  o.set_preallocation("metadata");
  EXPECT_EQ(error(o),
            "Backing file and preallocation can only be used at the same time "
            "if extended_l2 is on");
  o = Opts();
  o.set_extended_l2(true);
  o.set_cluster_size(4096);
  EXPECT_EQ(error(o),
            "Extended L2 entries are only supported with cluster sizes of at "
            "least 16384 bytes");
  o = Opts();
  o.set_extended_l2(true);
  o.set_size(1 << 20);
  EXPECT_TRUE(CheckCreateOptions(o).ok());
  o.set_backing_file("b");
  o.set_preallocation("metadata");
  EXPECT_TRUE(CheckCreateOptions(o).ok());
  o = Opts();
  o.set_size(uint64_t{1} << 60);
  EXPECT_THAT(error(o), HasSubstr("The image size is too large for file format 'qcow2'"));
}

}  // namespace
}  // namespace imgtool::qcow2
