// Extended L2 entries (subclusters) in Qcow2Node, with qemu-img/qemu-io as
// the oracle: creation byte for byte, random writes / zero writes / discards
// at subcluster and cluster granularity checked with `qemu-img check`,
// `qemu-img compare` and `qemu-img map`, images QEMU wrote, the amount of
// copy-on-write from the backing file, and concurrent subcluster writes.
#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "base/status_macros.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/task.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using ::testing::HasSubstr;
using testing::Env;
using testing::Pattern;
using testing::ReadFile;
using testing::RunMixedBatches;
using testing::Shell;
using testing::ShellResult;
using testing::TempPath;
using testing::WriteFile;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

// Counts the reads, the bytes read, the writes and the write-zeroes requests
// through it; forwards everything to `target`.
class CountingNode final : public testing::ForwardingNode {
 public:
  explicit CountingNode(std::unique_ptr<io::BlockNode> target)
      : ForwardingNode(std::move(target)) {}
  uint64_t bytes_read = 0;
  uint64_t reads = 0;
  uint64_t writes = 0;
  uint64_t write_zeroes = 0;

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    bytes_read += buf.size();
    ++reads;
    return ForwardingNode::DoRead(offset, buf);
  }
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override {
    ++writes;
    return ForwardingNode::DoWrite(offset, data);
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    ++write_zeroes;
    return ForwardingNode::DoWriteZeroes(offset, length, flags);
  }
};

// One line of `qemu-img map --output=json`.
struct MapEntry {
  uint64_t start = 0;
  uint64_t length = 0;
  int depth = 0;
  bool present = false;
  bool zero = false;
  bool data = false;
  bool has_offset = false;
  uint64_t offset = 0;
  bool operator==(const MapEntry&) const = default;
};

std::string ToString(const std::vector<MapEntry>& map) {
  std::string out;
  for (const MapEntry& e : map) {
    absl::StrAppendFormat(&out, "%u+%u d%d p%d z%d D%d", e.start, e.length,
                          e.depth, e.present, e.zero, e.data);
    if (e.has_offset) absl::StrAppendFormat(&out, " @%u", e.offset);
    out += "\n";
  }
  return out;
}

std::string Field(const std::string& line, const std::string& key) {
  const std::string k = "\"" + key + "\": ";
  const size_t at = line.find(k);
  if (at == std::string::npos) return "";
  const size_t from = at + k.size();
  const size_t to = line.find_first_of(",}", from);
  return line.substr(from, to - from);
}

std::vector<MapEntry> ParseQemuMap(const std::string& json) {
  std::vector<MapEntry> out;
  for (absl::string_view sv : absl::StrSplit(json, '\n')) {
    const std::string line(sv);
    if (line.find("\"start\"") == std::string::npos) continue;
    MapEntry e;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "start"), &e.start)) << line;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "length"), &e.length)) << line;
    EXPECT_TRUE(absl::SimpleAtoi(Field(line, "depth"), &e.depth)) << line;
    e.present = Field(line, "present") == "true";
    e.zero = Field(line, "zero") == "true";
    e.data = Field(line, "data") == "true";
    const std::string off = Field(line, "offset");
    e.has_offset = !off.empty();
    if (e.has_offset) {
      EXPECT_TRUE(absl::SimpleAtoi(off, &e.offset)) << line;
    }
    out.push_back(e);
  }
  return out;
}

class SubclusterTest : public ::testing::Test {
 protected:
  std::string Create(const std::string& name, uint64_t size,
                     Qcow2CreateOptions options) {
    const std::string path = TempPath(name);
    options.set_size(size);
    auto file = env_.CreateEmpty(path);
    EXPECT_TRUE(file.ok()) << file.status();
    absl::Status st = env_.Run(CreateQcow2(**file, options));
    EXPECT_TRUE(st.ok()) << st;
    EXPECT_TRUE(env_.Run((*file)->Close()).ok());
    return path;
  }

  std::unique_ptr<Qcow2Node> Open(const std::string& path, bool read_only = false) {
    auto node = env_.OpenQcow2(path, read_only);
    EXPECT_TRUE(node.ok()) << node.status();
    return node.ok() ? *std::move(node) : nullptr;
  }

  void Close(std::unique_ptr<Qcow2Node>& node) {
    absl::Status st = env_.Run(node->Close());
    EXPECT_TRUE(st.ok()) << st;
    node.reset();
  }

  std::vector<uint8_t> Read(io::BlockNode& node, uint64_t offset, uint64_t length) {
    std::vector<uint8_t> buf(length, 0xee);
    absl::Status st = env_.Run(node.Read(offset, io::IoVec(buf)));
    EXPECT_TRUE(st.ok()) << st;
    return buf;
  }

  void ExpectClean(const std::string& path) {
    ShellResult r = Shell("qemu-img check " + path);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("No errors were found on the image."));
  }

  void ExpectContents(const std::string& path, const std::vector<uint8_t>& expected) {
    const std::string raw = path + ".expected.raw";
    WriteFile(raw, expected);
    ShellResult r = Shell("qemu-img compare -f qcow2 -F raw " + path + " " + raw);
    EXPECT_EQ(r.exit_code, 0) << r.output;
  }

  std::vector<uint8_t> QemuRead(const std::string& path) {
    const std::string raw = path + ".qemu.raw";
    ShellResult r = Shell("qemu-img convert -O raw " + path + " " + raw);
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return ReadFile(raw);
  }

  // Our block status through the chain, merged like qemu-img map merges.
  std::vector<MapEntry> OurMap(io::BlockNode& top) {
    std::vector<MapEntry> out;
    for (uint64_t pos = 0; pos < top.size();) {
      auto st = env_.Run(io::GetChainStatus(top, pos, top.size() - pos));
      EXPECT_TRUE(st.ok()) << st.status();
      if (!st.ok()) break;
      MapEntry e;
      e.start = pos;
      e.length = st->status.length;
      e.depth = st->depth;
      e.present = st->present;
      e.zero = st->status.zero;
      e.data = st->status.data;
      e.has_offset = st->status.offset_valid;
      e.offset = st->status.host_offset;
      if (!out.empty()) {
        MapEntry& l = out.back();
        if (l.depth == e.depth && l.present == e.present && l.zero == e.zero &&
            l.data == e.data && l.has_offset == e.has_offset &&
            (!e.has_offset || l.offset + l.length == e.offset)) {
          l.length += e.length;
          pos += e.length;
          continue;
        }
      }
      out.push_back(e);
      pos += e.length;
    }
    return out;
  }

  // `ours` (changed by us) is clean and has the same `qemu-img map` and
  // contents as `theirs` (changed the same way by QEMU).
  void ExpectSameAsQemus(const std::string& ours, const std::string& theirs) {
    ExpectClean(ours);
    ShellResult a = Shell("qemu-img map --output=json " + ours);
    ShellResult b = Shell("qemu-img map --output=json " + theirs);
    EXPECT_THAT(a.output, HasSubstr("\"start\": 0,"));
    EXPECT_EQ(a.output, b.output);
    ShellResult cmp = Shell("qemu-img compare " + ours + " " + theirs);
    EXPECT_EQ(cmp.exit_code, 0) << cmp.output;
  }

  void ExpectMapsAgree(const std::string& path) {
    ShellResult r = Shell("qemu-img map --output=json " + path + " 2>&1");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto node = Open(path, /*read_only=*/true);
    ASSERT_NE(node, nullptr);
    const std::vector<MapEntry> ours = OurMap(*node);
    const std::vector<MapEntry> theirs = ParseQemuMap(r.output);
    // The first difference only (the maps can be long).
    size_t i = 0;
    while (i < ours.size() && i < theirs.size() && ours[i] == theirs[i]) ++i;
    EXPECT_EQ(ToString(std::vector<MapEntry>(ours.begin() + i,
                                             ours.begin() + std::min(ours.size(), i + 3))),
              ToString(std::vector<MapEntry>(
                  theirs.begin() + i, theirs.begin() + std::min(theirs.size(), i + 3))))
        << "entry " << i << " of " << ours.size() << "/" << theirs.size();
    Close(node);
  }

  Env env_;
};

Qcow2CreateOptions Extended(uint64_t cluster_size) {
  Qcow2CreateOptions o;
  o.set_extended_l2(true);
  o.set_cluster_size(cluster_size);
  return o;
}

TEST_F(SubclusterTest, CreateIsByteIdentical) {
  const std::string backing = TempPath("create_backing.raw");
  WriteFile(backing, std::vector<uint8_t>(kMiB, 1));
  for (uint64_t cs : {32 * kKiB, 64 * kKiB, 128 * kKiB, 2 * kMiB}) {
    for (bool with_backing : {false, true}) {
      SCOPED_TRACE(absl::StrCat(cs, with_backing ? " backing" : ""));
      const std::string name = absl::StrCat("create_", cs, with_backing, ".qcow2");
      Qcow2CreateOptions o = Extended(cs);
      std::string qemu_opts = absl::StrCat("extended_l2=on,cluster_size=", cs);
      if (with_backing) {
        o.set_backing_file(backing);
        o.set_backing_fmt("raw");
        qemu_opts += " -b " + backing + " -F raw";
      }
      const std::string ours = Create(name, 3 * kMiB / 2 * 1024, o);
      const std::string theirs = TempPath("qemu_" + name);
      ShellResult r = Shell("qemu-img create -q -f qcow2 -o " + qemu_opts + " " +
                            theirs + " " + std::to_string(3 * kMiB / 2 * 1024));
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(ReadFile(ours), ReadFile(theirs));
      ExpectClean(ours);
    }
  }
  Qcow2CreateOptions o = Extended(8 * kKiB);
  o.set_size(kMiB);
  EXPECT_EQ(CheckCreateOptions(o).status().message(),
            "Extended L2 entries are only supported with cluster sizes of at "
            "least 16384 bytes");
}

// Random writes, zero writes and discards at subcluster and cluster
// granularity, mirrored into a raw reference.
TEST_F(SubclusterTest, RandomMixMatchesQemu) {
  for (uint64_t cs : {32 * kKiB, 64 * kKiB, 2 * kMiB}) {
    for (bool with_backing : {false, true}) {
      SCOPED_TRACE(absl::StrCat(cs, with_backing ? " backing" : ""));
      const uint64_t size = std::max<uint64_t>(8 * kMiB, 4 * cs);
      const uint64_t sc = cs / 32;
      std::vector<uint8_t> ref(size, 0);
      Qcow2CreateOptions o = Extended(cs);
      if (with_backing) {
        const std::string backing = TempPath(absl::StrCat("mix_base_", cs, ".raw"));
        ref = Pattern(size, 99);
        WriteFile(backing, ref);
        o.set_backing_file(backing);
        o.set_backing_fmt("raw");
      }
      const std::string path =
          Create(absl::StrCat("mix_", cs, with_backing, ".qcow2"), size, o);
      auto node = Open(path);
      ASSERT_NE(node, nullptr);
      std::mt19937_64 rng(cs + with_backing);
      for (int i = 0; i < 400; ++i) {
        const int op = rng() % 10;
        const int unit = rng() % 3;  // bytes, subclusters, clusters
        uint64_t offset, length;
        if (unit == 0) {
          length = 1 + rng() % (2 * sc + 100);
          offset = rng() % (size - length);
        } else {
          const uint64_t g = unit == 1 ? sc : cs;
          const uint64_t units = size / g;
          const uint64_t n = 1 + rng() % std::min<uint64_t>(units, unit == 1 ? 40 : 3);
          offset = (rng() % (units - n + 1)) * g;
          length = n * g;
        }
        if (op < 6) {
          std::vector<uint8_t> data = Pattern(length, 1000 + i);
          absl::Status st = env_.Run(node->Write(offset, io::ConstIoVec(data)));
          ASSERT_TRUE(st.ok()) << st;
          std::copy(data.begin(), data.end(), ref.begin() + offset);
        } else if (op < 8) {
          io::WriteZeroesFlags f;
          f.may_unmap = rng() % 2;
          absl::Status st = env_.Run(node->WriteZeroes(offset, length, f));
          ASSERT_TRUE(st.ok()) << st;
          std::fill(ref.begin() + offset, ref.begin() + offset + length, 0);
        } else {
          if (unit == 0) continue;  // partial subclusters may be dropped
          absl::Status st = env_.Run(node->Discard(offset, length));
          ASSERT_TRUE(st.ok()) << st;
          std::fill(ref.begin() + offset, ref.begin() + offset + length, 0);
        }
        if (i % 100 == 99) {
          ASSERT_EQ(Read(*node, 0, size), ref) << "after op " << i;
        }
      }
      EXPECT_EQ(Read(*node, 0, size), ref);
      Close(node);
      ExpectClean(path);
      ExpectContents(path, ref);
      ExpectMapsAgree(path);
      node = Open(path, /*read_only=*/true);
      EXPECT_EQ(Read(*node, 0, size), ref);
      Close(node);
    }
  }
}

TEST_F(SubclusterTest, ReadsWhatQemuIoWrote) {
  for (bool with_backing : {false, true}) {
    SCOPED_TRACE(with_backing ? "backing" : "no backing");
    const std::string base = TempPath("qemuio_base.raw");
    WriteFile(base, Pattern(4 * kMiB, 5));
    const std::string path = TempPath(absl::StrCat("qemuio_", with_backing, ".qcow2"));
    std::string create = "qemu-img create -q -f qcow2 -o extended_l2=on ";
    if (with_backing) create += "-b " + base + " -F raw ";
    ShellResult r = Shell(create + path + " 4M && qemu-io -f qcow2 -c 'write -P 1 4k 4k' "
                          "-c 'write -z 64k 8k' -c 'write -P 2 130000 5000' "
                          "-c 'write -z 1M 64k' -c 'discard 2M 64k' " + path);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const std::vector<uint8_t> expected = QemuRead(path);
    auto node = Open(path, /*read_only=*/true);
    ASSERT_NE(node, nullptr);
    EXPECT_EQ(Read(*node, 0, 4 * kMiB), expected);
    Close(node);
    ExpectMapsAgree(path);
  }
}

TEST_F(SubclusterTest, SmallWriteCopiesAtMostOneSubclusterFromBacking) {
  const std::string base = TempPath("cow_base.raw");
  std::vector<uint8_t> ref = Pattern(8 * kMiB, 3);
  WriteFile(base, ref);
  Qcow2CreateOptions o = Extended(2 * kMiB);
  o.set_backing_file(base);
  o.set_backing_fmt("raw");
  const std::string path = Create("cow.qcow2", 8 * kMiB, o);
  auto file = env_.OpenFile(path, /*read_only=*/false);
  ASSERT_TRUE(file.ok());
  CountingNode* counter = nullptr;
  BackingOpener opener = [&](std::string filename, std::string)
      -> io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> {
    CO_ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> f,
                        env_.OpenFile(filename, /*read_only=*/true));
    auto c = std::make_unique<CountingNode>(std::move(f));
    counter = c.get();
    co_return std::unique_ptr<io::BlockNode>(std::move(c));
  };
  auto node = env_.Run(Qcow2Node::Open(*std::move(file), Qcow2OpenOptions(), opener));
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_NE(counter, nullptr);
  const std::vector<uint8_t> data = Pattern(4096, 77);
  const uint64_t offset = 2 * kMiB + 70000;  // inside subcluster 1
  ASSERT_TRUE(env_.Run((*node)->Write(offset, io::ConstIoVec(data))).ok());
  EXPECT_GT(counter->bytes_read, 0u);
  EXPECT_LE(counter->bytes_read, 64 * kKiB);
  // A write of whole subclusters copies nothing.
  counter->bytes_read = 0;
  const std::vector<uint8_t> whole = Pattern(128 * kKiB, 78);
  ASSERT_TRUE(env_.Run((*node)->Write(4 * kMiB + 256 * kKiB, io::ConstIoVec(whole))).ok());
  EXPECT_EQ(counter->bytes_read, 0u);
  std::copy(data.begin(), data.end(), ref.begin() + offset);
  std::copy(whole.begin(), whole.end(), ref.begin() + 4 * kMiB + 256 * kKiB);
  EXPECT_EQ(Read(**node, 0, 8 * kMiB), ref);
  EXPECT_TRUE(env_.Run((*node)->Close()).ok());
  node->reset();
  // The host file ends inside the reserved clusters.
  const uint64_t file_size = ReadFile(path).size();
  EXPECT_NE(file_size % (2 * kMiB), 0u);
  ExpectClean(path);
  ExpectContents(path, ref);
}

// Opens `path` with its backing file (and optionally its image file) read
// through CountingNodes.
struct CountedImage {
  std::unique_ptr<Qcow2Node> node;
  CountingNode* backing = nullptr;
  CountingNode* file = nullptr;
};

CountedImage OpenCounted(Env& env, const std::string& path) {
  CountedImage out;
  auto file = env.OpenFile(path, /*read_only=*/false);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return out;
  auto counted_file = std::make_unique<CountingNode>(*std::move(file));
  out.file = counted_file.get();
  BackingOpener opener = [&env, &out](std::string filename, std::string)
      -> io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> {
    CO_ASSIGN_OR_RETURN(std::unique_ptr<io::BlockNode> f,
                        env.OpenFile(filename, /*read_only=*/true));
    auto c = std::make_unique<CountingNode>(std::move(f));
    out.backing = c.get();
    co_return std::unique_ptr<io::BlockNode>(std::move(c));
  };
  auto node = env.Run(
      Qcow2Node::Open(std::move(counted_file), Qcow2OpenOptions(), opener));
  EXPECT_TRUE(node.ok()) << node.status();
  if (node.ok()) out.node = *std::move(node);
  return out;
}

// Copy-on-write reads head and tail with one backing read when at most
// 16 KiB lies between them (QEMU's merge), with two reads otherwise; with
// standard and with extended L2 entries.
TEST_F(SubclusterTest, CopyOnWriteMergesHeadAndTailReads) {
  const std::string base = TempPath("merge_base.raw");
  std::vector<uint8_t> ref = Pattern(8 * kMiB, 5);
  WriteFile(base, ref);
  for (const bool extended : {false, true}) {
    SCOPED_TRACE(extended ? "extended" : "standard");
    std::vector<uint8_t> expect = ref;
    Qcow2CreateOptions o;
    o.set_cluster_size(extended ? 1 * kMiB : 64 * kKiB);  // sc 32 KiB
    o.set_extended_l2(extended);
    o.set_backing_file(base);
    o.set_backing_fmt("raw");
    const std::string path =
        Create(extended ? "merge_ext.qcow2" : "merge_std.qcow2", 8 * kMiB, o);
    CountedImage img = OpenCounted(env_, path);
    ASSERT_NE(img.node, nullptr);
    ASSERT_NE(img.backing, nullptr);
    const uint64_t unit = extended ? 32 * kKiB : 64 * kKiB;  // COW unit
    // 4 KiB in the middle of a unit: head and tail in one read of the unit.
    const std::vector<uint8_t> small = Pattern(4 * kKiB, 11);
    const uint64_t a = 3 * unit + 8 * kKiB;
    ASSERT_TRUE(env_.Run(img.node->Write(a, io::ConstIoVec(small))).ok());
    EXPECT_EQ(img.backing->reads, 1u);
    EXPECT_EQ(img.backing->bytes_read, unit);
    std::copy(small.begin(), small.end(), expect.begin() + a);
    // 16 KiB between head and tail: still one read.
    img.backing->reads = img.backing->bytes_read = 0;
    const std::vector<uint8_t> mid = Pattern(16 * kKiB, 12);
    const uint64_t b = 9 * unit + 4 * kKiB;
    ASSERT_TRUE(env_.Run(img.node->Write(b, io::ConstIoVec(mid))).ok());
    EXPECT_EQ(img.backing->reads, 1u);
    EXPECT_EQ(img.backing->bytes_read, unit);
    std::copy(mid.begin(), mid.end(), expect.begin() + b);
    // 20 KiB between them: two reads, head and tail only.
    img.backing->reads = img.backing->bytes_read = 0;
    const std::vector<uint8_t> big = Pattern(20 * kKiB, 13);
    const uint64_t c = 17 * unit + 4 * kKiB;
    ASSERT_TRUE(env_.Run(img.node->Write(c, io::ConstIoVec(big))).ok());
    EXPECT_EQ(img.backing->reads, 2u);
    EXPECT_EQ(img.backing->bytes_read, unit - 20 * kKiB);
    std::copy(big.begin(), big.end(), expect.begin() + c);
    EXPECT_EQ(Read(*img.node, 0, 8 * kMiB), expect);
    Close(img.node);
    ExpectClean(path);
    ExpectContents(path, expect);
  }
}

// Without backing data the padding of a new subcluster is zeroed with the
// file's write zeroes instead of written from a buffer (QEMU's
// handle_alloc_space); the untouched subclusters stay unallocated.
TEST_F(SubclusterTest, CopyOnWriteOfZeroesUsesWriteZeroes) {
  const std::string path = Create("zcow.qcow2", 8 * kMiB, Extended(2 * kMiB));
  CountedImage img = OpenCounted(env_, path);
  ASSERT_NE(img.node, nullptr);
  std::vector<uint8_t> expect(8 * kMiB, 0);
  const std::vector<uint8_t> data = Pattern(4 * kKiB, 21);
  const uint64_t offset = 2 * kMiB + 64 * kKiB + 8 * kKiB;  // sc 1, inside
  ASSERT_TRUE(env_.Run(img.node->Write(offset, io::ConstIoVec(data))).ok());
  EXPECT_EQ(img.file->write_zeroes, 1u);
  std::copy(data.begin(), data.end(), expect.begin() + offset);
  // In place into the reserved cluster, next to zero subclusters: the same.
  const uint64_t offset2 = 2 * kMiB + 5 * 64 * kKiB + 12 * kKiB;
  ASSERT_TRUE(env_.Run(img.node->WriteZeroes(2 * kMiB + 5 * 64 * kKiB,
                                             64 * kKiB, {}))
                  .ok());
  img.file->write_zeroes = 0;
  ASSERT_TRUE(env_.Run(img.node->Write(offset2, io::ConstIoVec(data))).ok());
  EXPECT_EQ(img.file->write_zeroes, 1u);
  std::copy(data.begin(), data.end(), expect.begin() + offset2);
  EXPECT_EQ(Read(*img.node, 0, 8 * kMiB), expect);
  Close(img.node);
  ExpectClean(path);
  ExpectContents(path, expect);
  ExpectMapsAgree(path);
  ShellResult map = Shell("qemu-img map --output=json " + path);
  // Subcluster 1 and 5 hold data, the rest of the cluster is unallocated.
  EXPECT_THAT(map.output,
              HasSubstr("{ \"start\": 2162688, \"length\": 65536, "
                        "\"depth\": 0, \"present\": true, \"zero\": false, "
                        "\"data\": true"));
}

// Unaligned zero writes: a subcluster whose rest reads zeroes becomes a zero
// subcluster, otherwise the piece is written as data (QEMU 7.2's rule);
// `qemu-img map` of our image equals that of the image qemu-io changed.
TEST_F(SubclusterTest, UnalignedZeroWritesMatchQemu) {
  const std::string base = TempPath("uz_base.raw");
  WriteFile(base, Pattern(2 * kMiB, 9));
  // 64 KiB clusters: 2 KiB subclusters. Offsets: inside one subcluster,
  // across two, the head and tail of a longer range, on a data subcluster.
  const std::vector<std::pair<uint64_t, uint64_t>> zeroes = {
      {0x10100, 0x200}, {0x20700, 0x400},   {0x30300, 0x2000},
      {0x48000, 0x100}, {0x48900, 0x1800}, {0x1f0000 - 0x300, 0x300}};
  for (bool with_backing : {false, true}) {
    SCOPED_TRACE(with_backing ? "backing" : "no backing");
    std::string create = "qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k ";
    if (with_backing) create += "-b " + base + " -F raw ";
    const std::string ours = TempPath(absl::StrCat("uz_ours", with_backing, ".qcow2"));
    const std::string theirs = TempPath(absl::StrCat("uz_qemu", with_backing, ".qcow2"));
    std::string io = " -c 'write -P 7 0x48000 0x800'";  // a data subcluster
    for (auto [off, len] : zeroes) io += absl::StrFormat(" -c 'write -z %#x %#x'", off, len);
    ShellResult r = Shell(create + ours + " 2M && " + create + theirs +
                          " 2M && qemu-io -f qcow2" + io + " " + theirs);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    auto node = Open(ours);
    ASSERT_NE(node, nullptr);
    std::vector<uint8_t> data(0x800, 7);
    ASSERT_TRUE(env_.Run(node->Write(0x48000, io::ConstIoVec(data))).ok());
    for (auto [off, len] : zeroes) {
      absl::Status st = env_.Run(node->WriteZeroes(off, len, {}));
      ASSERT_TRUE(st.ok()) << st;
    }
    Close(node);
    ExpectSameAsQemus(ours, theirs);
  }
}

// Growing with preallocation=falloc/full allocates the new clusters (the
// partly used last cluster anew, its old part copied) like qemu-img resize:
// over a longer backing file extended L2 bitmaps say "all data", without
// one they stay unallocated. Same map and contents as qemu-img's.
TEST_F(SubclusterTest, PreallocatedResizeMatchesQemu) {
  const std::string base = TempPath("rz_base.raw");
  WriteFile(base, Pattern(4 * kMiB, 10));
  int n = 0;
  for (const char* mode : {"falloc", "full"}) {
    for (bool extended : {true, false}) {
      for (bool with_backing : {true, false}) {
        SCOPED_TRACE(absl::StrCat(mode, extended ? " extended" : " standard",
                                  with_backing ? " backing" : ""));
        std::string create = absl::StrCat(
            "qemu-img create -q -f qcow2 -o cluster_size=64k,extended_l2=",
            extended ? "on " : "off ");
        if (with_backing) create += "-b " + base + " -F raw ";
        const std::string ours = TempPath(absl::StrCat("rz_ours", n, ".qcow2"));
        const std::string theirs = TempPath(absl::StrCat("rz_qemu", n, ".qcow2"));
        ++n;
        const std::string write = " && qemu-io -f qcow2 -c 'write -P 17 970k 4k' ";
        ShellResult r = Shell(create + ours + " 1000k" + write + ours + " && " +
                              create + theirs + " 1000k" + write + theirs +
                              " && qemu-img resize -q --preallocation=" + mode +
                              " " + theirs + " 3M");
        ASSERT_EQ(r.exit_code, 0) << r.output;
        auto node = Open(ours);
        ASSERT_NE(node, nullptr);
        absl::Status st = env_.Run(node->Truncate(
            3 * kMiB, std::string(mode) == "full" ? io::PreallocMode::kFull
                                                   : io::PreallocMode::kFalloc));
        ASSERT_TRUE(st.ok()) << st;
        Close(node);
        ExpectSameAsQemus(ours, theirs);
      }
    }
  }
}

// A write over several unallocated clusters allocates them as one host
// range (as QEMU does), copying only the head of the first and the tail of
// the last subcluster; it stops at an allocated cluster. Same map and
// contents as qemu-io's.
TEST_F(SubclusterTest, WriteSpanningClustersAllocatesOnce) {
  const std::string base = TempPath("span_base.raw");
  WriteFile(base, Pattern(4 * kMiB, 31));
  // 64 KiB clusters, 2 KiB subclusters. Cluster 20 is written first.
  const std::vector<std::pair<uint64_t, uint64_t>> writes = {
      {20 * 64 * kKiB + 1000, 3000},
      {2 * 64 * kKiB + 5000, 3 * 64 * kKiB + 777},  // clusters 2..5
      {17 * 64 * kKiB + 300, 4 * 64 * kKiB},         // 17..21, stops at 20
      {32 * 64 * kKiB, 2 * 64 * kKiB}};              // whole clusters
  for (bool with_backing : {false, true}) {
    SCOPED_TRACE(with_backing ? "backing" : "no backing");
    std::string create = "qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k ";
    if (with_backing) create += "-b " + base + " -F raw ";
    const std::string ours = TempPath(absl::StrCat("span_ours", with_backing, ".qcow2"));
    const std::string theirs = TempPath(absl::StrCat("span_qemu", with_backing, ".qcow2"));
    std::string io;
    for (auto [off, len] : writes) io += absl::StrFormat(" -c 'write -P 9 %u %u'", off, len);
    ShellResult r = Shell(create + ours + " 4M && " + create + theirs +
                          " 4M && qemu-io -f qcow2" + io + " " + theirs);
    ASSERT_EQ(r.exit_code, 0) << r.output;
    CountedImage img = OpenCounted(env_, ours);
    ASSERT_NE(img.node, nullptr);
    for (auto [off, len] : writes) {
      if (img.backing != nullptr) img.backing->reads = 0;
      img.file->writes = 0;
      std::vector<uint8_t> data(len, 9);
      absl::Status st = env_.Run(img.node->Write(off, io::ConstIoVec(data)));
      ASSERT_TRUE(st.ok()) << st;
      if (off == 2 * 64 * kKiB + 5000) {
        // One write for all four clusters (after zeroing the padding when
        // there is no backing file).
        EXPECT_EQ(img.file->writes, 1u);
        if (img.backing != nullptr) {
          EXPECT_EQ(img.backing->reads, 2u);  // head and tail only
        }
      }
    }
    Close(img.node);
    ExpectSameAsQemus(ours, theirs);
  }
}

// Growing with preallocation when the last, partly used cluster is
// compressed keeps its data (the new cluster is all data; QEMU 7.2 leaves
// its bitmap 0 and reads zeroes there instead).
TEST_F(SubclusterTest, PreallocatedResizeKeepsCompressedLastCluster) {
  const std::string src = TempPath("rzc_src.raw");
  std::vector<uint8_t> ref(1000 * kKiB, 0);
  std::fill(ref.begin() + 900 * kKiB, ref.end(), 0x33);
  WriteFile(src, ref);
  const std::string path = TempPath("rzc.qcow2");
  ShellResult r = Shell("qemu-img convert -c -O qcow2 -o extended_l2=on,cluster_size=64k " +
                        src + " " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  absl::Status st = env_.Run(node->Truncate(3 * kMiB, io::PreallocMode::kFalloc));
  ASSERT_TRUE(st.ok()) << st;
  ref.resize(3 * kMiB, 0);
  EXPECT_EQ(Read(*node, 0, 3 * kMiB), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
}

// Growing over a longer backing file from a size inside a cluster: QEMU
// zeroes the rest of the old last cluster from the next subcluster on (zero
// subclusters, no allocation) and writes explicit zeroes only up to that
// subcluster; metadata preallocation keeps the old subcluster bitmap and
// copies only up to the touched subclusters' ends. Files byte for byte
// qemu-img resize's. Before, the zero subclusters of the old last cluster
// were lost with preallocation=metadata (the guest read the backing file's
// bytes there) and the new part of that cluster became data.
TEST_F(SubclusterTest, GrowingOverBackingFileMatchesQemu) {
  const std::string base = TempPath("gb_base.raw");
  WriteFile(base, Pattern(8 * kMiB, 12));
  int n = 0;
  for (const char* old_size : {"3000k", "3001k"}) {
    for (const char* io : {"", "write -z 2944k 56k", "write -P 1 2944k 4k"}) {
      for (bool metadata : {false, true}) {
        for (uint64_t new_size : {3006 * kKiB, 4 * kMiB}) {
          SCOPED_TRACE(absl::StrCat(old_size, " '", io, "' ", metadata ? "metadata " : "",
                                    new_size));
          const std::string create =
              absl::StrCat("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=64k -b ",
                           base, " -F raw ");
          const std::string prep =
              *io == '\0' ? "" : absl::StrCat(" && qemu-io -f qcow2 -c '", io, "' ");
          const std::string ours = TempPath(absl::StrCat("gb_ours", n, ".qcow2"));
          const std::string theirs = TempPath(absl::StrCat("gb_qemu", n, ".qcow2"));
          ++n;
          ShellResult r = Shell(absl::StrCat(
              create, ours, " ", old_size, prep, prep.empty() ? "" : ours, " && ", create,
              theirs, " ", old_size, prep, prep.empty() ? "" : theirs,
              " && qemu-img resize -q --preallocation=", metadata ? "metadata " : "off ",
              theirs, " ", new_size));
          ASSERT_EQ(r.exit_code, 0) << r.output;
          auto node = Open(ours);
          ASSERT_NE(node, nullptr);
          absl::Status st = env_.Run(node->Truncate(
              new_size, metadata ? io::PreallocMode::kMetadata : io::PreallocMode::kOff));
          ASSERT_TRUE(st.ok()) << st;
          Close(node);
          ExpectSameAsQemus(ours, theirs);
          EXPECT_TRUE(ReadFile(ours) == ReadFile(theirs));
        }
      }
    }
  }
}

TEST_F(SubclusterTest, ConcurrentWritesToSubclustersOfOneCluster) {
  for (bool with_backing : {false, true}) {
    SCOPED_TRACE(with_backing ? "backing" : "no backing");
    const uint64_t size = 8 * kMiB;
    std::vector<uint8_t> ref(size, 0);
    Qcow2CreateOptions o = Extended(2 * kMiB);
    if (with_backing) {
      const std::string base = TempPath("conc_base.raw");
      ref = Pattern(size, 11);
      WriteFile(base, ref);
      o.set_backing_file(base);
      o.set_backing_fmt("raw");
    }
    const std::string path = Create(absl::StrCat("conc_", with_backing, ".qcow2"), size, o);
    auto node = Open(path);
    ASSERT_NE(node, nullptr);
    std::vector<uint64_t> offsets;
    std::vector<std::vector<uint8_t>> buffers;
    // 32 writes, one per subcluster of cluster 1, some unaligned; and 16
    // into every other subcluster of cluster 2.
    for (int i = 0; i < 32; ++i) {
      offsets.push_back(2 * kMiB + i * 64 * kKiB + (i % 3) * 1000);
      buffers.push_back(Pattern(i % 2 ? 64 * kKiB - (i % 3) * 1000 : 5000, 300 + i));
    }
    for (int i = 0; i < 16; ++i) {
      offsets.push_back(4 * kMiB + 2 * i * 64 * kKiB);
      buffers.push_back(Pattern(64 * kKiB, 400 + i));
    }
    for (size_t i = 0; i < offsets.size(); ++i) {
      std::copy(buffers[i].begin(), buffers[i].end(), ref.begin() + offsets[i]);
    }
    int done = 0;
    std::vector<absl::Status> results(offsets.size());
    for (size_t i = 0; i < offsets.size(); ++i) {
      io::Spawn(node->Write(offsets[i], io::ConstIoVec(buffers[i])),
                [&, i](absl::Status st) {
                  results[i] = st;
                  ++done;
                });
    }
    while (done < static_cast<int>(offsets.size())) {
      ASSERT_TRUE(env_.engine().Poll(true).ok());
    }
    for (const absl::Status& st : results) EXPECT_TRUE(st.ok()) << st;
    EXPECT_EQ(Read(*node, 0, size), ref);
    Close(node);
    ExpectClean(path);
    ExpectContents(path, ref);
    ExpectMapsAgree(path);
  }
}

// Batches of 64 concurrent writes, zero writes, subcluster discards and
// reads on disjoint byte ranges that share clusters and subclusters, over a
// backing file, with caches small enough to evict all the time.
TEST_F(SubclusterTest, ConcurrentMixedWorkloadWithSmallCaches) {
  for (uint64_t cs : {32 * kKiB, 256 * kKiB}) {
    SCOPED_TRACE(cs);
    const uint64_t size = 8 * kMiB;
    const uint64_t sc = cs / 32;
    const std::string base = TempPath(absl::StrCat("cmixed_base", cs, ".raw"));
    // As long as the image: past a shorter backing file qemu-img map
    // reports depth 0 where io::GetChainStatus reports the chain length.
    std::vector<uint8_t> ref = Pattern(size, 4321);
    WriteFile(base, ref);
    Qcow2CreateOptions o = Extended(cs);
    o.set_backing_file(base);
    o.set_backing_fmt("raw");
    const std::string path = Create(absl::StrCat("cmixed", cs, ".qcow2"), size, o);
    auto opened = env_.OpenQcow2(path, false, [] {
      Qcow2OpenOptions small;
      small.set_l2_cache_size(1);
      small.set_refcount_cache_size(1);
      return small;
    }());
    ASSERT_TRUE(opened.ok()) << opened.status();
    std::unique_ptr<Qcow2Node> node = *std::move(opened);
    std::mt19937_64 rng(cs);
    RunMixedBatches(env_, *node, ref, rng, /*batches=*/30,
                    /*slot=*/std::max<uint64_t>(3000, 3 * sc),
                    /*discard_unit=*/sc);
    if (HasFatalFailure()) return;
    EXPECT_EQ(Read(*node, 0, size), ref);
    Close(node);
    ExpectClean(path);
    ExpectContents(path, ref);
    ExpectMapsAgree(path);
  }
}

TEST_F(SubclusterTest, InvalidBitmapMarksCorrupt) {
  const std::string path = TempPath("invalid.qcow2");
  ShellResult r = Shell("qemu-img create -q -f qcow2 -o extended_l2=on " + path +
                        " 1M && qemu-io -f qcow2 -c 'write -P 1 0 4k' " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 64k clusters: L2 table at 0x40000; set the zero bit of allocated
  // subcluster 0 (bitmap word, bit 32).
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[0x40000 + 8 + 3] |= 1;
  WriteFile(path, bytes);
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  std::vector<uint8_t> buf(4096);
  absl::Status st = env_.Run(node->Read(0, io::IoVec(buf)));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("Marking image as corrupt: Invalid cluster "
                                      "entry found  (L2 offset: 0x40000, L2 index: 0)"));
  EXPECT_TRUE(node->corrupt());
  (void)env_.Run(node->Close());
  ShellResult info = Shell("qemu-img info " + path);
  EXPECT_THAT(info.output, HasSubstr("corrupt: true"));
}

// The other invalid combination, an unallocated cluster with allocation
// bits, is refused by reads and block status alike, with QEMU's message
// (qemu-io: 'read failed: Input/output error' after the same event).
// Entries QEMU reads although check may object stay readable: a
// compressed cluster with subcluster bits, the unused zero flag (bit 0).
TEST_F(SubclusterTest, UnallocatedClusterWithAllocationBitsMarksCorrupt) {
  const std::string path = TempPath("invalid_unalloc.qcow2");
  ShellResult r = Shell("qemu-img create -q -f qcow2 -o extended_l2=on " + path +
                        " 1M && qemu-io -f qcow2 -c 'write -P 1 0 4k' "
                        "-c 'write -c -P 2 64k 64k' " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // 64k clusters: L2 table at 0x40000, 16-byte entries. Entry 1 is the
  // compressed cluster, entry 2 unallocated.
  std::vector<uint8_t> bytes = ReadFile(path);
  ASSERT_EQ(bytes[0x40010] & 0xc0, 0x40);
  bytes[0x40018 + 7] = 0x03;  // compressed: allocation bits 0-1
  bytes[0x40000 + 7] |= 1;    // normal: zero flag
  bytes[0x40028 + 7] = 0x04;  // unallocated: allocation bit 2
  WriteFile(path, bytes);
  std::unique_ptr<Qcow2Node> node = Open(path);
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(Read(*node, 0, 4096), std::vector<uint8_t>(4096, 1));
  EXPECT_EQ(Read(*node, 65536, 65536), std::vector<uint8_t>(65536, 2));
  std::vector<uint8_t> buf(4096);
  EXPECT_FALSE(node->corrupt());

  absl::StatusOr<io::BlockStatus> status =
      env_.Run(node->GetBlockStatus(2 * 65536 + 8192, 4096));
  EXPECT_TRUE(absl::IsDataLoss(status.status())) << status.status();
  EXPECT_THAT(std::string(status.status().message()),
              HasSubstr("Invalid cluster entry found  (L2 offset: 0x40000, "
                        "L2 index: 0x2)"));
  EXPECT_TRUE(node->corrupt());
  absl::Status st = env_.Run(node->Read(2 * 65536 + 8192, io::IoVec(buf)));
  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
  (void)env_.Run(node->Close());
  EXPECT_THAT(Shell("qemu-img info " + path).output, HasSubstr("corrupt: true"));
}

TEST_F(SubclusterTest, PreallocatedCreateIsByteIdenticalAndKeepsBackingVisible) {
  const std::string backing = TempPath("prealloc_backing.raw");
  const std::vector<uint8_t> base = Pattern(4 * kMiB, 21);
  WriteFile(backing, base);
  for (const char* mode : {"metadata", "falloc", "full"}) {
    for (bool with_backing : {false, true}) {
      SCOPED_TRACE(absl::StrCat(mode, with_backing ? " backing" : ""));
      const std::string name = absl::StrCat("prealloc_", mode, with_backing, ".qcow2");
      Qcow2CreateOptions o = Extended(64 * kKiB);
      o.set_preallocation(mode);
      std::string qemu_opts = absl::StrCat("extended_l2=on,preallocation=", mode);
      if (with_backing) {
        o.set_backing_file(backing);
        o.set_backing_fmt("raw");
        qemu_opts += " -b " + backing + " -F raw";
      }
      const std::string ours = Create(name, 4 * kMiB, o);
      const std::string theirs = TempPath("qemu_" + name);
      ShellResult r = Shell("qemu-img create -q -f qcow2 -o " + qemu_opts + " " +
                            theirs + " 4M");
      ASSERT_EQ(r.exit_code, 0) << r.output;
      EXPECT_EQ(testing::FirstDifference(ours, theirs), -1);
      ExpectClean(ours);
      ExpectContents(ours, with_backing ? base : std::vector<uint8_t>(4 * kMiB, 0));
      ExpectMapsAgree(ours);
    }
  }
}

// Partial writes, zero writes and discards on compressed clusters of an
// extended-L2 image (compressed clusters are never subdivided).
TEST_F(SubclusterTest, CompressedClusters) {
  const std::string raw = TempPath("compressed_src.raw");
  std::vector<uint8_t> ref = Pattern(2 * kMiB, 8);
  WriteFile(raw, ref);
  const std::string path = TempPath("compressed.qcow2");
  ShellResult r = Shell("qemu-img convert -c -O qcow2 -o extended_l2=on " + raw + " " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  EXPECT_EQ(Read(*node, 0, 2 * kMiB), ref);
  const std::vector<uint8_t> data = Pattern(3000, 9);
  ASSERT_TRUE(env_.Run(node->Write(70000, io::ConstIoVec(data))).ok());
  std::copy(data.begin(), data.end(), ref.begin() + 70000);
  ASSERT_TRUE(env_.Run(node->WriteZeroes(256 * kKiB + 4096, 8192, {})).ok());
  std::fill(ref.begin() + 256 * kKiB + 4096, ref.begin() + 256 * kKiB + 12288, 0);
  ASSERT_TRUE(env_.Run(node->WriteZeroes(512 * kKiB, 64 * kKiB, {})).ok());
  std::fill(ref.begin() + 512 * kKiB, ref.begin() + 576 * kKiB, 0);
  ASSERT_TRUE(env_.Run(node->Discard(1 * kMiB, 64 * kKiB)).ok());
  std::fill(ref.begin() + 1 * kMiB, ref.begin() + 1 * kMiB + 64 * kKiB, 0);
  EXPECT_EQ(Read(*node, 0, 2 * kMiB), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
}

// Writes into clusters shared with an internal snapshot copy them (with
// their allocated subclusters); the snapshot keeps its contents.
TEST_F(SubclusterTest, SharedClustersOfSnapshots) {
  const std::string path = TempPath("snap.qcow2");
  ShellResult r = Shell("qemu-img create -q -f qcow2 -o extended_l2=on " + path +
                        " 2M && qemu-io -f qcow2 -c 'write -P 7 0 4k' "
                        "-c 'write -P 8 20k 6k' -c 'write -z 40k 2k' "
                        "-c 'write -P 9 64k 64k' " + path +
                        " && qemu-img snapshot -c s1 " + path);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::vector<uint8_t> before = QemuRead(path);
  std::vector<uint8_t> ref = before;
  auto node = Open(path);
  ASSERT_NE(node, nullptr);
  const std::vector<uint8_t> a = Pattern(1000, 31);
  ASSERT_TRUE(env_.Run(node->Write(10000, io::ConstIoVec(a))).ok());
  std::copy(a.begin(), a.end(), ref.begin() + 10000);
  ASSERT_TRUE(env_.Run(node->WriteZeroes(96 * kKiB, 4 * kKiB, {})).ok());
  std::fill(ref.begin() + 96 * kKiB, ref.begin() + 100 * kKiB, 0);
  EXPECT_EQ(Read(*node, 0, 2 * kMiB), ref);
  Close(node);
  ExpectClean(path);
  ExpectContents(path, ref);
  const std::string snap = path + ".s1.raw";
  r = Shell("qemu-img convert -l snapshot.name=s1 -O raw " + path + " " + snap);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(ReadFile(snap), before);
}

TEST_F(SubclusterTest, SubclusterSizeBelow512IsRefused) {
  const std::string path = TempPath("small_sc.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 -o extended_l2=on,cluster_size=16k " +
                  path + " 1M").exit_code, 0);
  std::vector<uint8_t> bytes = ReadFile(path);
  bytes[23] = 13;  // cluster_bits 13: 8 KiB clusters, 256-byte subclusters
  WriteFile(path, bytes);
  auto node = env_.OpenQcow2(path, /*read_only=*/true);
  ASSERT_FALSE(node.ok());
  EXPECT_THAT(node.status().message(), HasSubstr("Unsupported subcluster size: 256"));
}

}  // namespace
}  // namespace imgtool::qcow2
