// Round trips between Qcow2Node/CreateQcow2 and qemu-img/qemu-io 7.2, for
// cluster sizes 512, 4k, 64k and 2M (and extended L2 entries at 16k, 64k
// and 2M), with and without backing files:
//  (a) writes through Qcow2Node (concurrent batches of patterned writes,
//      compressed cluster writes, write zeroes with and without unmap, discards
//      at random, unaligned offsets and lengths, growing truncates) applied
//      identically to a raw reference: `qemu-img check` finds nothing and
//      `qemu-img compare` says identical;
//  (b) images written by qemu-img/qemu-io (compressed clusters from
//      `convert -c` and `write -c`, `write -z`, `write -z -u`, discard,
//      truncate) read back through Qcow2Node exactly as `qemu-img convert
//      -O raw` reads them;
//  (c) CreateQcow2 writes the bytes `qemu-img create` writes;
//  (d) block status through io::GetChainStatus equals `qemu-img map
//      --output=json` on the images of (a) and (b).
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io/chain_status.h"
#include "qcow2/create.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/testing/harness.h"

namespace imgtool::qcow2::testing {
namespace {

using ::testing::HasSubstr;

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * 1024;

enum class Backing { kNone, kRaw, kQcow2 };

const char* BackingName(Backing b) {
  switch (b) {
    case Backing::kNone:
      return "none";
    case Backing::kRaw:
      return "raw";
    case Backing::kQcow2:
      return "qcow2";
  }
  return "";
}

// One request of a batch.
struct Op {
  enum Kind { kWrite, kZero, kZeroUnmap, kDiscard, kCompressed } kind = kWrite;
  uint64_t offset = 0;
  uint64_t length = 0;
  std::vector<uint8_t> data;
  bool refused = false;  // kCompressed: the cluster was allocated
};

class RoundTripTest : public ::testing::Test {
 protected:
  void TearDown() override {
    RunCommand(absl::StrCat("rm -f ", TempPath("rt_*")));
  }

  // Runs `tasks` concurrently; the first error, if any.
  absl::Status RunConcurrently(std::vector<io::Task<absl::Status>> tasks) {
    size_t remaining = tasks.size();
    absl::Status first;
    for (io::Task<absl::Status>& t : tasks) {
      io::Spawn(std::move(t), [&](absl::Status st) {
        if (!st.ok() && first.ok()) first = st;
        --remaining;
      });
    }
    while (remaining > 0) {
      absl::Status st = env_.engine().Poll(/*wait=*/true);
      if (!st.ok()) return st;
    }
    return first;
  }

  static io::Task<absl::Status> Issue(Qcow2Node& node, Op& op) {
    switch (op.kind) {
      case Op::kCompressed: {
        absl::Status st =
            co_await node.WriteCompressed(op.offset, io::ConstIoVec(op.data));
        op.refused = absl::IsFailedPrecondition(st);
        co_return op.refused ? absl::OkStatus() : st;
      }
      case Op::kWrite:
        co_return co_await node.Write(op.offset, io::ConstIoVec(op.data));
      case Op::kZero:
      case Op::kZeroUnmap: {
        io::WriteZeroesFlags flags;
        flags.may_unmap = op.kind == Op::kZeroUnmap;
        co_return co_await node.WriteZeroes(op.offset, op.length, flags);
      }
      case Op::kDiscard:
        co_return co_await node.Discard(op.offset, op.length);
    }
    co_return absl::OkStatus();
  }

  // Creates a backing file of `size` bytes with qemu-img/qemu-io (patterned
  // data, for qcow2 also a zero cluster and a compressed one); "" for none.
  std::string MakeBacking(const std::string& name, Backing b, uint64_t size) {
    if (b == Backing::kNone) return "";
    const bool raw = b == Backing::kRaw;
    const std::string path =
        TempPath(absl::StrCat("rt_", name, raw ? ".base.raw" : ".base.qcow2"));
    const std::string src = WriteSource(name + ".base", 4 * kMiB, 99);
    std::string cmd = absl::StrCat(
        "qemu-img create -q -f ", raw ? "raw " : "qcow2 -o cluster_size=4k ",
        path, " ", size, " && qemu-io -f ", raw ? "raw" : "qcow2",
        " -c 'write -s ", src, " 1000 3M'", " -c 'write -P 0x61 ",
        size - 3 * kMiB - 77, " 1M'", " -c 'write -s ", src, " ",
        size - 1500 * kKiB, " 1200k'");
    if (!raw) {
      absl::StrAppend(&cmd, " -c 'write -z 64k 8k' -c 'write -c ",
                      (size & ~(64 * kKiB - 1)) - 256 * kKiB, " 4k'");
    }
    absl::StrAppend(&cmd, " ", path);
    CommandResult r = RunCommand(cmd);
    EXPECT_EQ(r.exit_code, 0) << cmd << "\n" << r.err;
    return path;
  }

  // A file of random bytes for qemu-io's `write -s`.
  std::string WriteSource(const std::string& name, uint64_t length,
                          uint64_t seed) {
    const std::string path = TempPath(absl::StrCat("rt_", name, ".src"));
    std::vector<uint8_t> bytes = Pattern(length, seed);
    FILE* f = fopen(path.c_str(), "wb");
    EXPECT_NE(f, nullptr);
    fwrite(bytes.data(), 1, bytes.size(), f);
    fclose(f);
    return path;
  }

  std::vector<uint8_t> ReadRaw(const std::string& image, uint64_t size) {
    const std::string out = image + ".conv.raw";
    CommandResult r =
        RunCommand(absl::StrCat("qemu-img convert -O raw ", image, " ", out));
    EXPECT_EQ(r.exit_code, 0) << r.err;
    std::vector<uint8_t> bytes = ReadFile(out);
    unlink(out.c_str());
    bytes.resize(size, 0);
    return bytes;
  }

  // (d): our chain map equals qemu-img map's.
  void ExpectSameMap(const std::string& image) {
    absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
        env_.OpenQcow2(image, /*read_only=*/true);
    ASSERT_TRUE(node.ok()) << node.status();
    absl::StatusOr<std::vector<MapEntry>> ours = env_.Run(ChainMap(**node));
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    ASSERT_TRUE(ours.ok()) << ours.status();
    CommandResult r = RunCommand("qemu-img map --output=json " + image);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    absl::StatusOr<std::vector<MapEntry>> theirs = ParseQemuMap(r.out);
    ASSERT_TRUE(theirs.ok()) << theirs.status();
    EXPECT_EQ(ToString(*ours), ToString(*theirs)) << image;
  }

  // (a) for one configuration.
  void OurWritesMatchReference(uint64_t cluster_size, Backing backing,
                               const std::string& compat, uint64_t seed,
                               bool extended_l2 = false) {
    const std::string name =
        absl::StrCat("a", cluster_size, BackingName(backing), compat,
                     extended_l2 ? "ext" : "");
    SCOPED_TRACE(name);
    const bool v3 = compat != "0.10";
    uint64_t size = (cluster_size >= 65536 ? 24 * kMiB : 6 * kMiB) + 1536;
    // A raw backing file longer than the image (growing must hide its
    // data), a qcow2 one shorter (reads past its end are zeroes).
    const uint64_t backing_size = backing == Backing::kRaw
                                      ? size + 3 * kMiB + 512
                                      : size - 2 * kMiB - 512;
    const std::string base = MakeBacking(name, backing, backing_size);
    std::vector<uint8_t> base_bytes;
    if (!base.empty()) base_bytes = ReadRaw(base, backing_size);

    const std::string image = TempPath(absl::StrCat("rt_", name, ".qcow2"));
    Qcow2CreateOptions o;
    o.set_size(size);
    o.set_cluster_size(cluster_size);
    o.set_compat(compat);
    o.set_extended_l2(extended_l2);
    if (!base.empty()) {
      o.set_backing_file(base);
      o.set_backing_fmt(BackingName(backing));
    }
    ASSERT_TRUE(env_.CreateImage(image, o).ok());
    // What the image shows: the backing file's bytes, zeroes past its end.
    std::vector<uint8_t> ref(size, 0);
    std::copy_n(base_bytes.begin(), std::min<uint64_t>(size, base_bytes.size()),
                ref.begin());
    // What a cluster without data of its own shows (v2 discards).
    auto backing_byte = [&](uint64_t i) -> uint8_t {
      return i < base_bytes.size() ? base_bytes[i] : 0;
    };
    // v2 with a backing file ignores discards (QEMU 7.2's qcow2_co_pdiscard:
    // without the zero flag they would show the backing file again).
    const bool discard_ignored = !v3 && !base.empty();

    absl::StatusOr<std::unique_ptr<Qcow2Node>> opened =
        env_.OpenQcow2(image, /*read_only=*/false);
    ASSERT_TRUE(opened.ok()) << opened.status();
    Qcow2Node& node = **opened;
    std::mt19937_64 rng(seed);
    auto rand = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
    uint64_t grown_from = size;  // v2 discards past it show zeroes
    int compressed_writes = 0;   // accepted ones
    std::vector<bool> compressed(size / cluster_size + 1,
                                 false);  // by guest cluster
    for (int round = 0; round < 40; ++round) {
      if (v3 && round % 8 == 7) {
        // Grow by up to 3 clusters (plus a few sectors).
        const uint64_t add = 512 * (1 + rand((3 * cluster_size + 4096) / 512));
        absl::Status st =
            env_.Run(node.Truncate(size + add, io::PreallocMode::kOff));
        ASSERT_TRUE(st.ok()) << st;
        size += add;
        ref.resize(size, 0);
        compressed.resize(size / cluster_size + 1, false);
      }
      std::vector<Op> ops;
      const uint64_t max_len =
          std::min<uint64_t>(4 * cluster_size + 1000, 3 * kMiB);
      for (int attempt = 0; attempt < 64 && ops.size() < 16; ++attempt) {
        Op op;
        const uint64_t k = rand(10);
        op.kind = k < 5   ? Op::kWrite
                  : k < 6 ? Op::kCompressed
                  : k < 7 ? Op::kZero
                  : k < 8 ? Op::kZeroUnmap
                          : Op::kDiscard;
        op.length = 1 + rand(max_len);
        if (rand(3) == 0) op.length = (op.length + 511) & ~uint64_t{511};
        if (rand(4) == 0)
          op.length = (op.length / cluster_size + 1) * cluster_size;
        op.length = std::min(op.length, size);
        op.offset = rand(size - op.length + 1);
        if (rand(3) == 0) op.offset &= ~(cluster_size - 1);
        if (rand(8) == 0) op.offset = size - op.length;  // up to the end
        if (op.kind == Op::kCompressed) {
          // One whole cluster (the image's last one may be partial); half
          // of them compress.
          op.offset = rand(size) & ~(cluster_size - 1);
          op.length = std::min(cluster_size, size - op.offset);
          if (rand(2) == 0) {
            op.data.assign(op.length, static_cast<uint8_t>(1 + rand(255)));
          } else {
            op.data = Pattern(op.length, seed * 100000 + round * 100 + attempt);
          }
        }
        bool overlaps = false;
        for (const Op& other : ops) {
          overlaps |= op.offset < other.offset + other.length &&
                      other.offset < op.offset + op.length;
        }
        if (overlaps) continue;
        if (op.kind == Op::kWrite)
          op.data = Pattern(op.length, seed * 100000 + round * 100 + attempt);
        ops.push_back(std::move(op));
      }
      std::vector<io::Task<absl::Status>> tasks;
      for (Op& op : ops) tasks.push_back(Issue(node, op));
      absl::Status st = RunConcurrently(std::move(tasks));
      ASSERT_TRUE(st.ok()) << st;
      for (const Op& op : ops) {
        switch (op.kind) {
          case Op::kWrite:
            std::copy(op.data.begin(), op.data.end(), ref.begin() + op.offset);
            break;
          case Op::kCompressed:
            if (op.refused) break;
            ++compressed_writes;
            std::copy(op.data.begin(), op.data.end(), ref.begin() + op.offset);
            break;
          case Op::kZero:
          case Op::kZeroUnmap:
            std::fill_n(ref.begin() + op.offset, op.length, 0);
            break;
          case Op::kDiscard: {
            if (discard_ignored) break;
            // Whole clusters (subclusters with extended L2 entries, except
            // in compressed clusters) only; a partial last one of the image
            // counts when the range reaches the end. v3 leaves zero
            // clusters, v2 (without a backing file) unallocated ones.
            const uint64_t mask =
                (extended_l2 ? cluster_size / 32 : cluster_size) - 1;
            const uint64_t start = (op.offset + mask) & ~mask;
            uint64_t end = op.offset + op.length;
            end = end == size ? end : end & ~mask;
            for (uint64_t i = start; i < end; ++i) {
              const uint64_t c = i / cluster_size;
              const bool whole_cluster =
                  op.offset <= c * cluster_size &&
                  (op.offset + op.length >= (c + 1) * cluster_size ||
                   op.offset + op.length == size);
              if (compressed[c] && !whole_cluster) continue;  // dropped
              ref[i] = v3 || i >= grown_from ? 0 : backing_byte(i);
            }
            break;
          }
        }
        // Which clusters are compressed now: a compressed write makes one,
        // anything else that changes a cluster ends it (a partial discard
        // of a compressed cluster is dropped).
        for (uint64_t c = op.offset / cluster_size;
             c <= (op.offset + op.length - 1) / cluster_size; ++c) {
          if (op.kind == Op::kCompressed) {
            compressed[c] = !op.refused || compressed[c];
          } else if (op.kind != Op::kDiscard ||
                     (!discard_ignored && op.offset <= c * cluster_size &&
                      (op.offset + op.length >= (c + 1) * cluster_size ||
                       op.offset + op.length == size))) {
            compressed[c] = false;
          }
        }
      }
      if (round % 10 == 9) {
        ASSERT_TRUE(env_.Run(node.Flush()).ok());
      }
      // The image must read as the reference after every batch; a
      // difference names the requests that touched it.
      std::vector<uint8_t> now(size);
      ASSERT_TRUE(env_.Run(node.Read(0, io::IoVec(now))).ok());
      if (now != ref) {
        const uint64_t at =
            std::mismatch(now.begin(), now.end(), ref.begin()).first -
            now.begin();
        std::string batch;
        for (const Op& op : ops) {
          absl::StrAppend(
              &batch, "  kind ", static_cast<int>(op.kind), " offset ",
              op.offset, " length ", op.length, op.refused ? " (refused)" : "",
              op.offset <= at && at < op.offset + op.length ? "  <-- covers it"
                                                            : "",
              "\n");
        }
        FAIL() << "round " << round << ": byte " << at << " reads "
               << int{now[at]} << ", expected " << int{ref[at]}
               << "; batch (kinds: 0 write, 1 zero, 2 zero+unmap, "
               << "3 discard, 4 compressed):\n"
               << batch;
      }
    }
    EXPECT_GT(compressed_writes, 0);
    // Read back through the node before closing.
    std::vector<uint8_t> back(size);
    ASSERT_TRUE(env_.Run(node.Read(0, io::IoVec(back))).ok());
    EXPECT_TRUE(back == ref) << "read-back differs from the reference";
    ASSERT_TRUE(env_.Run(node.Close()).ok());
    opened->reset();

    QemuCheck check = RunQemuCheck(image);
    EXPECT_EQ(check.exit_code, 0) << check.err << check.output;
    CommandResult human = RunCommand("qemu-img check " + image);
    EXPECT_THAT(human.out, HasSubstr("No errors were found on the image."));
    const std::string ref_path = image + ".ref.raw";
    {
      FILE* f = fopen(ref_path.c_str(), "wb");
      ASSERT_NE(f, nullptr);
      fwrite(ref.data(), 1, ref.size(), f);
      fclose(f);
    }
    CommandResult cmp = RunCommand(absl::StrCat(
        "qemu-img compare -f qcow2 -F raw ", image, " ", ref_path));
    EXPECT_EQ(cmp.exit_code, 0) << cmp.out << cmp.err;
    EXPECT_THAT(cmp.out, HasSubstr("Images are identical."));
    ExpectSameMap(image);
  }

  // (b) for one configuration: the image is made by qemu-img convert -c (or
  // create) and changed by qemu-io; Qcow2Node must read what qemu reads.
  void QemuWritesReadBack(uint64_t cluster_size, Backing backing,
                          bool compressed_base, uint64_t seed,
                          bool extended_l2 = false) {
    const std::string name =
        absl::StrCat("b", cluster_size, BackingName(backing),
                     compressed_base ? "c" : "", extended_l2 ? "ext" : "");
    const std::string ext_opt = extended_l2 ? ",extended_l2=on" : "";
    SCOPED_TRACE(name);
    const uint64_t size = (cluster_size >= 65536 ? 24 * kMiB : 6 * kMiB) + 512;
    const std::string base = MakeBacking(
        name, backing, backing == Backing::kQcow2 ? size - kMiB : size + kMiB);
    const std::string image = TempPath(absl::StrCat("rt_", name, ".qcow2"));
    // qemu-img create takes the backing file with -b, convert with -B.
    const std::string backing_opts =
        base.empty() ? ""
                     : absl::StrCat(" -F ", BackingName(backing), " -",
                                    compressed_base ? "B" : "b", " ", base);
    std::vector<std::string> sources;
    for (int i = 0; i < 4; ++i) {
      sources.push_back(WriteSource(absl::StrCat(name, i),
                                    3 * cluster_size + 8192, seed + i));
    }
    std::string cmd;
    if (compressed_base) {
      // Compressible halves (patterns) and incompressible ones (random).
      const std::string src =
          TempPath(absl::StrCat("rt_", name, ".convsrc.raw"));
      CommandResult r = RunCommand(
          absl::StrCat("qemu-img create -q -f raw ", src, " ", size,
                       " && qemu-io -f raw -c 'write -P 0x11 0 ", size / 2,
                       "' -c 'write -s ", sources[0], " ", size / 3, " ",
                       3 * cluster_size + 8192, "' -c 'write -z ", size / 4,
                       " ", 2 * cluster_size, "' ", src));
      ASSERT_EQ(r.exit_code, 0) << r.err;
      cmd = absl::StrCat(
          "qemu-img convert -c -O qcow2 -o cluster_size=", cluster_size,
          ext_opt, backing_opts, " ", src, " ", image);
    } else {
      cmd = absl::StrCat(
          "qemu-img create -q -f qcow2 -o cluster_size=", cluster_size, ext_opt,
          backing_opts, " ", image, " ", size);
    }
    CommandResult made = RunCommand(cmd);
    ASSERT_EQ(made.exit_code, 0) << cmd << "\n" << made.err;

    // qemu-io requests: unaligned writes from random sources, zero writes,
    // unmapping zero writes, discards, compressed writes on clusters nothing
    // else touched, and one growing truncate with writes past the old end.
    std::mt19937_64 rng(seed);
    auto rand = [&](uint64_t n) { return n == 0 ? 0 : rng() % n; };
    std::vector<bool> touched(size / cluster_size + 1, compressed_base);
    std::vector<std::string> script;
    uint64_t cur_size = size;
    for (int i = 0; i < 60; ++i) {
      if (i == 40) {
        cur_size += 3 * cluster_size + 1024;
        script.push_back(absl::StrCat("truncate ", cur_size));
      }
      const uint64_t k = rand(10);
      uint64_t len = 1 + rand(3 * cluster_size + 8192);
      if (k >= 4) len = (len + 511) & ~uint64_t{511};  // zero/discard
      len = std::min(len, cur_size);
      uint64_t off = i >= 40 && rand(2) == 0 ? size + rand(cur_size - size)
                                             : rand(cur_size);
      if (rand(3) == 0 || k >= 4) off &= ~uint64_t{511};
      len = std::min(len, cur_size - off);
      if (len == 0) continue;
      if (k < 4) {
        script.push_back(
            absl::StrCat("write -s ", sources[rand(4)], " ", off, " ", len));
      } else if (k < 6) {
        script.push_back(absl::StrCat("write -z ", off, " ", len));
      } else if (k < 7) {
        script.push_back(absl::StrCat("write -z -u ", off, " ", len));
      } else if (k < 8) {
        script.push_back(absl::StrCat("discard ", off, " ", len));
      } else {
        const uint64_t c = rand(size / cluster_size);
        if (touched[c]) continue;
        off = c * cluster_size;
        len = cluster_size;
        script.push_back(absl::StrCat("write -c -P ", 1 + rand(200), " ",
                                      c * cluster_size, " ", cluster_size));
      }
      for (uint64_t c = off / cluster_size;
           c <= (off + len - 1) / cluster_size && c < touched.size(); ++c) {
        touched[c] = true;
      }
    }
    std::string io_cmd = "qemu-io -f qcow2";
    for (const std::string& s : script)
      absl::StrAppend(&io_cmd, " -c '", s, "'");
    absl::StrAppend(&io_cmd, " ", image);
    CommandResult io = RunCommand(io_cmd);
    ASSERT_EQ(io.exit_code, 0) << io_cmd << "\n" << io.err;
    ASSERT_THAT(io.out + io.err, ::testing::Not(HasSubstr("failed"))) << io_cmd;
    CommandResult check = RunCommand("qemu-img check " + image);
    ASSERT_EQ(check.exit_code, 0) << check.out << check.err;

    const std::string qemu_raw = image + ".qemu.raw";
    const std::string our_raw = image + ".ours.raw";
    CommandResult conv = RunCommand(
        absl::StrCat("qemu-img convert -O raw ", image, " ", qemu_raw));
    ASSERT_EQ(conv.exit_code, 0) << conv.err;
    absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
        env_.OpenQcow2(image, /*read_only=*/true);
    ASSERT_TRUE(node.ok()) << node.status();
    absl::Status dumped = env_.DumpToRaw(**node, our_raw);
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    ASSERT_TRUE(dumped.ok()) << dumped;
    EXPECT_EQ(FirstDifference(qemu_raw, our_raw), -1) << io_cmd;
    ExpectSameMap(image);
  }

  Env env_;
};

TEST_F(RoundTripTest, OurWritesMatchRawReferenceNoBacking) {
  for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
    OurWritesMatchReference(cs, Backing::kNone, "1.1", cs + 1);
  }
  OurWritesMatchReference(4096, Backing::kNone, "0.10", 5);
}

TEST_F(RoundTripTest, OurWritesMatchRawReferenceRawBacking) {
  for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
    OurWritesMatchReference(cs, Backing::kRaw, "1.1", cs + 2);
  }
}

TEST_F(RoundTripTest, OurWritesMatchRawReferenceQcow2Backing) {
  for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
    OurWritesMatchReference(cs, Backing::kQcow2, "1.1", cs + 3);
  }
  OurWritesMatchReference(65536, Backing::kQcow2, "0.10", 6);
}

TEST_F(RoundTripTest, OurWritesMatchRawReferenceExtendedL2) {
  for (Backing b : {Backing::kNone, Backing::kRaw, Backing::kQcow2}) {
    OurWritesMatchReference(65536, b, "1.1", 11 + static_cast<int>(b),
                            /*extended_l2=*/true);
  }
  OurWritesMatchReference(16384, Backing::kQcow2, "1.1", 15,
                          /*extended_l2=*/true);
  OurWritesMatchReference(2 * kMiB, Backing::kRaw, "1.1", 16,
                          /*extended_l2=*/true);
}

TEST_F(RoundTripTest, QemuWrittenExtendedL2ImagesReadBack) {
  for (uint64_t cs : {16384, 65536, 2 * 1024 * 1024}) {
    for (Backing b : {Backing::kNone, Backing::kRaw, Backing::kQcow2}) {
      QemuWritesReadBack(cs, b, /*compressed_base=*/false,
                         cs * 7 + static_cast<int>(b),
                         /*extended_l2=*/true);
    }
    QemuWritesReadBack(cs, Backing::kQcow2, /*compressed_base=*/true, cs * 9,
                       /*extended_l2=*/true);
  }
}

TEST_F(RoundTripTest, QemuWrittenImagesReadBack) {
  for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
    for (Backing b : {Backing::kNone, Backing::kRaw, Backing::kQcow2}) {
      QemuWritesReadBack(cs, b, /*compressed_base=*/false,
                         cs * 3 + static_cast<int>(b));
    }
  }
}

TEST_F(RoundTripTest, QemuCompressedImagesReadBack) {
  for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
    for (Backing b : {Backing::kNone, Backing::kQcow2}) {
      QemuWritesReadBack(cs, b, /*compressed_base=*/true,
                         cs * 5 + static_cast<int>(b));
    }
  }
}

// (c): CreateQcow2 against qemu-img create, byte for byte.
TEST_F(RoundTripTest, CreateIsByteIdenticalToQemuImgCreate) {
  const std::string raw_base = TempPath("rt_c.base.raw");
  const std::string qcow2_base = TempPath("rt_c.base.qcow2");
  ASSERT_EQ(RunCommand(absl::StrCat("qemu-img create -q -f raw ", raw_base,
                                    " 10M && "
                                    "qemu-img create -q -f qcow2 ",
                                    qcow2_base, " 3G"))
                .exit_code,
            0);
  struct Case {
    std::string qemu_options;
    uint64_t size;
    std::function<void(Qcow2CreateOptions&)> set;
  };
  const std::vector<Case> cases = {
      {"cluster_size=512", 100 * kMiB,
       [](auto& o) { o.set_cluster_size(512); }},
      {"cluster_size=4k,refcount_bits=1,lazy_refcounts=on", 3 * 1024 * kMiB,
       [](auto& o) {
         o.set_cluster_size(4096);
         o.set_refcount_bits(1);
         o.set_lazy_refcounts(true);
       }},
      {"cluster_size=64k", 1024 * kMiB + 512, [](auto&) {}},
      {"cluster_size=2M,refcount_bits=64", uint64_t{1} << 40,
       [](auto& o) {
         o.set_cluster_size(2 * kMiB);
         o.set_refcount_bits(64);
       }},
      {"compat=0.10,cluster_size=4k", 50 * kMiB,
       [](auto& o) {
         o.set_compat("0.10");
         o.set_cluster_size(4096);
       }},
      {"cluster_size=512,backing_file=" + raw_base + ",backing_fmt=raw",
       10 * kMiB,
       [&](auto& o) {
         o.set_cluster_size(512);
         o.set_backing_file(raw_base);
         o.set_backing_fmt("raw");
       }},
      {"backing_file=" + qcow2_base + ",backing_fmt=qcow2", 3 * 1024 * kMiB,
       [&](auto& o) {
         o.set_backing_file(qcow2_base);
         o.set_backing_fmt("qcow2");
       }},
      {"compat=0.10,backing_file=" + qcow2_base +
           ",backing_fmt=qcow2,cluster_size=2M",
       5 * 1024 * kMiB,
       [&](auto& o) {
         o.set_compat("0.10");
         o.set_cluster_size(2 * kMiB);
         o.set_backing_file(qcow2_base);
         o.set_backing_fmt("qcow2");
       }},
      {"cluster_size=128k,extended_l2=on", 1024 * kMiB,
       [](auto& o) {
         o.set_cluster_size(128 * kKiB);
         o.set_extended_l2(true);
       }},
      {"extended_l2=on,preallocation=metadata,backing_file=" + raw_base +
           ",backing_fmt=raw",
       10 * kMiB,
       [&](auto& o) {
         o.set_extended_l2(true);
         o.set_preallocation("metadata");
         o.set_backing_file(raw_base);
         o.set_backing_fmt("raw");
       }},
      {"cluster_size=4k,preallocation=metadata", 64 * kMiB,
       [](auto& o) {
         o.set_cluster_size(4096);
         o.set_preallocation("metadata");
       }},
  };
  int i = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.qemu_options);
    const std::string ours = TempPath(absl::StrCat("rt_c", i, ".ours.qcow2"));
    const std::string theirs = TempPath(absl::StrCat("rt_c", i, ".qemu.qcow2"));
    ++i;
    Qcow2CreateOptions o;
    o.set_size(c.size);
    c.set(o);
    absl::Status st = env_.CreateImage(ours, o);
    ASSERT_TRUE(st.ok()) << st;
    CommandResult r =
        RunCommand(absl::StrCat("qemu-img create -q -f qcow2 -o ",
                                c.qemu_options, " ", theirs, " ", c.size));
    ASSERT_EQ(r.exit_code, 0) << r.err;
    EXPECT_TRUE(ReadFile(ours) == ReadFile(theirs));
    EXPECT_EQ(FirstDifference(ours, theirs), -1);
  }
}

// Driver fix: growing an image over a longer backing file zeroes the new
// area (QEMU adds BDRV_REQ_ZERO_WRITE), so the backing data past the old
// end stays hidden; the layout is the one `qemu-img resize` makes.
TEST_F(RoundTripTest, GrowingOverLongerBackingFileReadsZeroes) {
  const std::string base = TempPath("rt_grow.base.raw");
  const std::string ours = TempPath("rt_grow.ours.qcow2");
  const std::string theirs = TempPath("rt_grow.qemu.qcow2");
  ASSERT_EQ(RunCommand(
                absl::StrCat("qemu-img create -q -f raw ", base,
                             " 8M && qemu-io -f raw -c 'write -P 7 0 8M' ",
                             base, " && qemu-img create -q -f qcow2 -F raw -b ",
                             base, " ", ours, " 1000k && cp ", ours, " ",
                             theirs, " && qemu-img resize -q ", theirs, " 6M"))
                .exit_code,
            0);
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
      env_.OpenQcow2(ours, /*read_only=*/false);
  ASSERT_TRUE(node.ok()) << node.status();
  ASSERT_TRUE(
      env_.Run((*node)->Truncate(6 * kMiB, io::PreallocMode::kOff)).ok());
  std::vector<uint8_t> buf(6 * kMiB);
  ASSERT_TRUE(env_.Run((*node)->Read(0, io::IoVec(buf))).ok());
  ASSERT_TRUE(env_.Run((*node)->Close()).ok());
  EXPECT_EQ(std::count(buf.begin(), buf.begin() + 1000 * kKiB, 7), 1000 * kKiB);
  EXPECT_EQ(std::count(buf.begin() + 1000 * kKiB, buf.end(), 0),
            6 * kMiB - 1000 * kKiB);
  EXPECT_EQ(FirstDifference(ours, theirs), -1);
  EXPECT_EQ(RunCommand("qemu-img check " + ours).exit_code, 0);
  CommandResult cmp =
      RunCommand(absl::StrCat("qemu-img compare ", ours, " ", theirs));
  EXPECT_EQ(cmp.exit_code, 0) << cmp.out << cmp.err;
}

// Driver fix: a version 2 image can't hide the longer backing file's data
// (no zero clusters), so growing fails as in QEMU.
TEST_F(RoundTripTest, GrowingV2OverLongerBackingFileFails) {
  const std::string base = TempPath("rt_grow2.base.raw");
  const std::string image = TempPath("rt_grow2.qcow2");
  ASSERT_EQ(
      RunCommand(
          absl::StrCat("qemu-img create -q -f raw ", base, " 8M && ",
                       "qemu-img create -q -f qcow2 -o compat=0.10 -F raw -b ",
                       base, " ", image, " 1M"))
          .exit_code,
      0);
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
      env_.OpenQcow2(image, /*read_only=*/false);
  ASSERT_TRUE(node.ok()) << node.status();
  absl::Status st =
      env_.Run((*node)->Truncate(2 * kMiB, io::PreallocMode::kOff));
  EXPECT_TRUE(absl::IsUnimplemented(st)) << st;
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("Failed to zero out new clusters"));
  EXPECT_EQ((*node)->size(), 1 * kMiB);
  ASSERT_TRUE(env_.Run((*node)->Close()).ok());
}

// Driver fix: preallocated zero clusters report their own host offsets, so
// a run of them at non-contiguous host clusters is not one extent.
TEST_F(RoundTripTest, ZeroClustersWithScatteredHostOffsetsMapLikeQemu) {
  const std::string image = TempPath("rt_zeroalloc.qcow2");
  ASSERT_EQ(
      RunCommand(absl::StrCat(
                     "qemu-img create -q -f qcow2 -o cluster_size=4k ", image,
                     " 1M && qemu-io -f qcow2 -c 'write 0 4k' -c 'write 8k 4k' "
                     "-c 'write 4k 4k' -c 'write -z 0 12k' ",
                     image))
          .exit_code,
      0);
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
      env_.OpenQcow2(image, /*read_only=*/true);
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<io::BlockStatus> st =
      env_.Run((*node)->GetBlockStatus(0, 12 * kKiB));
  ASSERT_TRUE(env_.Run((*node)->Close()).ok());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_TRUE(st->zero);
  EXPECT_FALSE(st->data);
  EXPECT_EQ(st->length, 4 * kKiB);
  ExpectSameMap(image);
}

// Driver fix (found by crash_writer): the host cluster that compressed data
// is packed into may be freed (its compressed clusters overwritten) and
// handed out again as a data cluster; the next compressed write must not
// be appended into it.
TEST_F(RoundTripTest, CompressedWriteAfterItsClusterWasFreedAndReused) {
  const std::string image = TempPath("rt_creuse.qcow2");
  Qcow2CreateOptions o;
  o.set_size(4 * kMiB);
  ASSERT_TRUE(env_.CreateImage(image, o).ok());
  absl::StatusOr<std::unique_ptr<Qcow2Node>> opened =
      env_.OpenQcow2(image, false);
  ASSERT_TRUE(opened.ok()) << opened.status();
  Qcow2Node& node = **opened;
  const uint64_t cs = node.cluster_size();
  std::vector<uint8_t> compressible(cs, 0x41);
  const std::vector<uint8_t> data1 = Pattern(cs, 1);
  const std::vector<uint8_t> data2 = Pattern(cs, 2);
  // Compressed guest cluster 0 goes into a fresh host cluster H.
  ASSERT_TRUE(env_.Run(node.WriteCompressed(0, compressible)).ok());
  // Overwriting it frees H; guest cluster 1 then gets H as its data cluster.
  ASSERT_TRUE(env_.Run(node.Write(0, data1)).ok());
  ASSERT_TRUE(env_.Run(node.Flush()).ok());
  ASSERT_TRUE(env_.Run(node.Write(cs, data2)).ok());
  // This compressed cluster must go elsewhere.
  ASSERT_TRUE(env_.Run(node.WriteCompressed(2 * cs, compressible)).ok());
  std::vector<uint8_t> back(3 * cs);
  ASSERT_TRUE(env_.Run(node.Read(0, io::IoVec(back))).ok());
  ASSERT_TRUE(env_.Run(node.Close()).ok());
  EXPECT_TRUE(std::equal(data1.begin(), data1.end(), back.begin()));
  EXPECT_TRUE(std::equal(data2.begin(), data2.end(), back.begin() + cs));
  EXPECT_TRUE(std::equal(compressible.begin(), compressible.end(),
                         back.begin() + 2 * cs));
  QemuCheck check = RunQemuCheck(image);
  EXPECT_EQ(check.exit_code, 0) << check.err;
  CommandResult read = RunCommand(
      absl::StrCat("qemu-io -c 'read -P 0x41 ", 2 * cs, " ", cs, "' ", image));
  EXPECT_EQ(read.exit_code, 0);
  EXPECT_THAT(read.out, ::testing::Not(HasSubstr("fail"))) << read.out;
}

// io::GetChainStatus past the end of a shorter backing file: the top image
// answers "zero, not present" at depth 0, as in qemu-img map.
TEST_F(RoundTripTest, ChainStatusDepthPastShorterBackingFile) {
  const std::string base = TempPath("rt_depth.base.raw");
  const std::string image = TempPath("rt_depth.qcow2");
  ASSERT_EQ(RunCommand(absl::StrCat("qemu-img create -q -f raw ", base,
                                    " 1M && "
                                    "qemu-img create -q -f qcow2 -F raw -b ",
                                    base, " ", image, " 2M"))
                .exit_code,
            0);
  CommandResult r = RunCommand("qemu-img map --output=json " + image);
  EXPECT_THAT(
      r.out,
      HasSubstr("{ \"start\": 1048576, \"length\": 1048576, \"depth\": 0, "
                "\"present\": false, \"zero\": true, \"data\": false}"));
  absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
      env_.OpenQcow2(image, /*read_only=*/true);
  ASSERT_TRUE(node.ok()) << node.status();
  absl::StatusOr<io::ChainStatus> st =
      env_.Run(io::GetChainStatus(**node, 1 * kMiB, 1 * kMiB));
  ASSERT_TRUE(env_.Run((*node)->Close()).ok());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_FALSE(st->present);
  EXPECT_TRUE(st->status.zero);
  EXPECT_EQ(st->status.length, 1 * kMiB);
  EXPECT_EQ(st->depth, 0);
}

}  // namespace
}  // namespace imgtool::qcow2::testing
